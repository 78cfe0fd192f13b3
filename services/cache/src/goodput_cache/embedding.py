"""Where L2 gets its vectors: the embedder service over gRPC, or the same model in-process.

Both give L2-normalised all-MiniLM-L6-v2 vectors (the embedder's :class:`goodput_embedder.models.OnnxMiniLM`), so
entries stored through one can be searched through the other.

Example:
    >>> vectoriser = LocalVectoriser()                  # or RemoteVectoriser(make_channel("embedder:50053"))
    >>> (await vectoriser.embed(["how do I reset my password?"])).shape
    (1, 384)
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
from grpc import aio

__all__ = ["LocalVectoriser", "RemoteVectoriser", "Vectoriser"]


class Vectoriser(Protocol):
    dim: int

    async def embed(self, texts: list[str]) -> np.ndarray: ...


class LocalVectoriser:
    """The embedder's ONNX model, loaded in this process; model calls run in a thread."""

    def __init__(self, *, model_path: str = "", threads: int = 1) -> None:
        from goodput_embedder.models import OnnxMiniLM

        self.model = OnnxMiniLM(model_path=model_path, threads=threads)
        self.dim = self.model.dim
        self._lock = asyncio.Lock()

    def embed_sync(self, texts: list[str]) -> np.ndarray:
        return self.model.embed(texts)

    async def embed(self, texts: list[str]) -> np.ndarray:
        async with self._lock:
            return await asyncio.to_thread(self.model.embed, texts)


class RemoteVectoriser:
    """The Embedding gRPC service (micro-batched with every other caller)."""

    dim = 384

    def __init__(self, channel: aio.Channel, *, timeout_s: float = 2.0) -> None:
        from goodput.embedder.v1 import embedder_pb2_grpc

        self._stub = embedder_pb2_grpc.EmbeddingStub(channel)
        self._timeout_s = timeout_s

    async def embed(self, texts: list[str]) -> np.ndarray:
        from goodput.embedder.v1 import embedder_pb2

        resp = await self._stub.Embed(embedder_pb2.EmbedRequest(texts=texts), timeout=self._timeout_s)
        return np.asarray([list(v.values) for v in resp.vectors], dtype=np.float32).reshape(len(texts), -1)
