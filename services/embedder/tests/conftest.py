"""Real components for the embedder's tests: the ONNX model, a real Redis (goodput_testing's ``redis_url``: the
local one, or one started for the session), and a real retriever (qdrant-client local mode + tantivy, in memory)
serving IndexStore in-process on a free port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry

from goodput_minilm import OnnxMiniLM

from goodput_embedder.config import EmbedderSettings
from goodput_embedder.indexer import Indexer
from goodput_embedder.store_client import GrpcStoreWriter
from goodput_retriever.__main__ import build as build_retriever
from goodput_retriever.config import RetrieverSettings
from goodput_retriever.search import Retriever


@pytest.fixture(scope="session")
def model() -> OnnxMiniLM:
    return OnnxMiniLM()


class CountingModel:
    """The real model, counting the texts it embeds (and optionally failing after a number of calls)."""

    def __init__(self, model: OnnxMiniLM) -> None:
        self.model = model
        self.name, self.dim = model.name, model.dim
        self.texts = 0
        self.calls = 0
        self.fail_after: int | None = None
        self.batches: list[int] = []  # texts per call
        self.called = threading.Event()  # set by the first call
        self.gate: threading.Event | None = None  # when set up, a call waits for it (holds the model busy)
        # When set up, every call waits for a permit: the test moves the model call by call. ``held`` counts the
        # calls that have reached it.
        self.step: threading.Semaphore | None = None
        self.held = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("injected failure (the job was killed here)")
        self.calls += 1
        self.texts += len(texts)
        self.batches.append(len(texts))
        self.called.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.step is not None:
            self.held += 1
            if not self.step.acquire(timeout=30):
                raise RuntimeError("the test never let this model call through")
        return self.model.embed(texts)

    def count_tokens(self, texts: list[str]) -> int:
        return self.model.count_tokens(texts)


class LocalQueryEmbedder:
    def __init__(self, model: OnnxMiniLM) -> None:
        self.model = model

    async def embed_query(self, text: str) -> Sequence[float]:
        return (await asyncio.to_thread(self.model.embed, [text]))[0].tolist()


@dataclass
class RunningRetriever:
    address: str
    retriever: Retriever


@pytest.fixture
async def retriever(model: OnnxMiniLM) -> AsyncIterator[RunningRetriever]:
    settings = RetrieverSettings(grpc_port=0, http_port=0, qdrant_path=":memory:", tantivy_path=":memory:",
                                 drain_grace_s=0)
    runner, retr = build_retriever(settings, CollectorRegistry(), None, embedder=LocalQueryEmbedder(model))
    await runner.start()
    yield RunningRetriever(f"127.0.0.1:{runner.grpc_port}", retr)
    await runner.stop()


@pytest.fixture
def settings(redis_url: str, redis_prefix: str, retriever: RunningRetriever) -> EmbedderSettings:
    return EmbedderSettings(redis_url=redis_url, retriever_addr=retriever.address, key_prefix=redis_prefix,
                            version_channel=f"{redis_prefix}:kb-version", grpc_port=0, http_port=0,
                            worker_http_port=0, drain_grace_s=0)


@pytest.fixture
def counting(model: OnnxMiniLM) -> CountingModel:
    return CountingModel(model)


@pytest.fixture
def indexer(settings: EmbedderSettings, counting: CountingModel) -> Iterator[Indexer]:
    client = redis.Redis.from_url(settings.redis_url)
    store = GrpcStoreWriter(settings.retriever_addr, timeout_s=30)
    yield Indexer(settings, embed=counting.embed, store=store, redis_client=client)
    for key in client.scan_iter(f"{settings.key_prefix}:*"):
        client.delete(key)
    store.close()
    client.close()
