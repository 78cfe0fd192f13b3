"""The retriever over real stores (qdrant-client local mode and tantivy, in memory) and the real ONNX model for
query embeddings."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from goodput_minilm import OnnxMiniLM

from goodput_retriever.config import RetrieverSettings
from goodput_retriever.qdrant_store import QdrantStore
from goodput_retriever.search import Retriever
from goodput_retriever.stores import StoredChunk
from goodput_retriever.tantivy_index import TantivyIndex


@pytest.fixture(scope="session")
def model() -> OnnxMiniLM:
    return OnnxMiniLM()


class ModelEmbedder:
    def __init__(self, model: OnnxMiniLM) -> None:
        self.model = model
        self.delay_s = 0.0  # a slow embedder: the behaviour under test is the dense leg running out of time
        self.fail = False

    async def embed_query(self, text: str) -> Sequence[float]:
        if self.fail:
            raise ConnectionError("embedder unavailable")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.model.embed([text])[0].tolist()


@pytest.fixture
def embedder(model: OnnxMiniLM) -> ModelEmbedder:
    return ModelEmbedder(model)


@pytest.fixture
def retriever(embedder: ModelEmbedder) -> Retriever:
    settings = RetrieverSettings(qdrant_path=":memory:", tantivy_path=":memory:", leg_timeout_s=0.5)
    return Retriever(settings, vectors=QdrantStore(location=":memory:"), lexical=TantivyIndex(":memory:"),
                     embedder=embedder)


def chunks(model: OnnxMiniLM, docs: dict[str, str]) -> list[StoredChunk]:
    vectors = model.embed(list(docs.values()))
    return [StoredChunk(chunk_id=f"{d}-0", document_id=d, text=t, vector=v.tolist())
            for (d, t), v in zip(docs.items(), vectors, strict=True)]
