"""`python -m goodput_retriever`: hybrid search (Retrieval) and the stores' write side (IndexStore).

The retriever is the single owner of the stores. qdrant-client local mode with ``path=`` and a tantivy index
directory can each be opened by one process only, so the indexer (the embedder's gRPC server and its Celery
workers) never opens them: it writes through this process's IndexStore API. With a Qdrant server and
Elasticsearch the same path is kept, so there is one write path to reason about.
"""

from __future__ import annotations

from pathlib import Path

from goodput.retriever.v1 import retriever_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.bootstrap import bootstrap
from goodput_core.clients import make_channel
from goodput_core.server import ServiceRunner, run_main
from goodput_core.tls import channel_credentials

from goodput_retriever.config import RetrieverSettings
from goodput_retriever.qdrant_store import QdrantStore
from goodput_retriever.rerank import load_reranker
from goodput_retriever.search import QueryEmbedder, Retriever, RetrieverMetrics
from goodput_retriever.servicer import GrpcQueryEmbedder, IndexStoreServicer, RetrievalServicer
from goodput_retriever.stores import LexicalIndex, VectorStore


def make_stores(settings: RetrieverSettings) -> tuple[VectorStore, LexicalIndex, Path | None]:
    data = Path(settings.data_dir)
    persistent = False
    if settings.qdrant_url:
        vectors: VectorStore = QdrantStore(url=settings.qdrant_url, api_key=settings.qdrant_api_key)
        persistent = True
    else:
        location = settings.qdrant_path or str(data / "qdrant")
        if location != ":memory:":
            Path(location).mkdir(parents=True, exist_ok=True)
            persistent = True
        vectors = QdrantStore(location=location)
    lexical: LexicalIndex
    if settings.lexical_backend == "elasticsearch":
        from goodput_retriever.elastic_index import ElasticsearchIndex

        lexical = ElasticsearchIndex(url=settings.elasticsearch_url, api_key=settings.elasticsearch_api_key)
    else:
        from goodput_retriever.tantivy_index import TantivyIndex

        lexical = TantivyIndex(settings.tantivy_path or str(data / "tantivy"))
    versions = None
    if persistent:
        data.mkdir(parents=True, exist_ok=True)
        versions = data / "versions.json"
    return vectors, lexical, versions


def build(settings: RetrieverSettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
          embedder: QueryEmbedder | None = None) -> tuple[ServiceRunner, Retriever]:
    """Wires the retriever (also used by tests to run it in-process; ``embedder`` overrides the gRPC one)."""
    vectors, lexical, versions = make_stores(settings)
    channel = None
    if embedder is None:
        channel = make_channel(settings.embedder_addr, provider, credentials=channel_credentials(settings))
        embedder = GrpcQueryEmbedder(channel, timeout_s=settings.leg_timeout_s)
    retriever = Retriever(settings, vectors=vectors, lexical=lexical, embedder=embedder,
                          reranker=load_reranker(settings), metrics=RetrieverMetrics(registry),
                          versions_file=versions)
    runner = ServiceRunner(name="retriever", settings=settings, registry=registry, provider=provider)
    runner.add(retriever_pb2_grpc.add_RetrievalServicer_to_server, RetrievalServicer(retriever),
               "goodput.retriever.v1.Retrieval")
    runner.add(retriever_pb2_grpc.add_IndexStoreServicer_to_server, IndexStoreServicer(retriever),
               "goodput.retriever.v1.IndexStore")

    async def close() -> None:
        retriever.close()
        if channel is not None:
            await channel.close(grace=None)

    runner.on_stop.append(close)
    return runner, retriever


async def serve() -> None:
    rt = bootstrap("retriever", RetrieverSettings)
    runner, _ = build(rt.settings, rt.registry, rt.provider)
    await runner.run()


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
