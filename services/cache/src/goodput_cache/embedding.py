"""Where L2 gets its vectors: the embedder service over gRPC, or the same model in-process.

Both give L2-normalised all-MiniLM-L6-v2 vectors (:class:`goodput_minilm.OnnxMiniLM`, the model the embedder
serves), so entries stored through one can be searched through the other.

Example::

    vectoriser = LocalVectoriser()                  # or RemoteVectoriser(make_channel("embedder:50053"))
    (await vectoriser.embed(["how do I reset my password?"])).shape   # (1, 384)
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Protocol

import numpy as np
from grpc import aio

from goodput_core.clients import EmbeddingClient

__all__ = ["LocalVectoriser", "RemoteVectoriser", "VectorMemo", "Vectoriser"]


class Vectoriser(Protocol):
    dim: int

    async def embed(self, texts: list[str]) -> np.ndarray: ...


class LocalVectoriser:
    """The embedder's ONNX model, loaded in this process; model calls run in a thread."""

    def __init__(self, *, model_path: str = "", threads: int = 1, spin: bool = False) -> None:
        from goodput_minilm import OnnxMiniLM

        self.model = OnnxMiniLM(model_path=model_path, threads=threads, spin=spin)
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
        self._client = EmbeddingClient(channel, timeout_s=timeout_s)

    async def embed(self, texts: list[str]) -> np.ndarray:
        resp = await self._client.embed(texts)
        return np.asarray(resp.vectors, dtype=np.float32).reshape(len(texts), -1)


class VectorMemo:
    """The vectors of the last ``entries`` questions embedded, least recently used first out.

    Why: a lookup that misses is followed, once the answer is generated, by a store of the same question; without
    the memo the question is embedded twice, and the embedding is most of the cache's CPU. Keys are a 128-bit
    digest of the question (memory stays ~1.6 KiB per entry however long questions are); one memo serves one model,
    so its vectors never go stale. ``entries=0`` turns it off. Not thread-safe: used from the event loop only.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, text: str) -> np.ndarray | None:
        key = self._key(text)
        vector = self._vectors.get(key)
        if vector is not None:
            self._vectors.move_to_end(key)
        return vector

    def put(self, text: str, vector: np.ndarray) -> None:
        if self.entries <= 0:
            return
        key = self._key(text)
        self._vectors[key] = vector
        self._vectors.move_to_end(key)
        while len(self._vectors) > self.entries:
            self._vectors.popitem(last=False)
