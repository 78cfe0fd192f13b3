"""`python -m goodput_embedder`: the Embedding (micro-batched) and Indexer gRPC APIs.

The Celery indexing workers are a separate process from the same package: ``celery -A goodput_embedder.jobs worker``.
"""

from __future__ import annotations

import redis
from goodput.embedder.v1 import embedder_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.bootstrap import bootstrap
from goodput_core.server import ServiceRunner, run_main
from goodput_core.tls import channel_credentials

from goodput_embedder.batcher import BatcherMetrics, MicroBatcher
from goodput_embedder.config import EmbedderSettings
from goodput_embedder.indexer import Indexer
from goodput_embedder.jobs import JobStore, create_app
from goodput_embedder.models import Embedder, load_model
from goodput_embedder.store_client import GrpcStoreWriter


def build(settings: EmbedderSettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
          model: Embedder | None = None) -> tuple[ServiceRunner, MicroBatcher]:
    """Wires the embedder (also used by tests to run it in-process; ``model`` overrides the configured one)."""
    model = model or load_model(settings)
    batcher = MicroBatcher(model, window_ms=settings.batch_window_ms, max_batch=settings.max_batch,
                           metrics=BatcherMetrics(registry))
    client = redis.Redis.from_url(settings.redis_url)
    store = GrpcStoreWriter(settings.retriever_addr, timeout_s=settings.write_timeout_s,
                            credentials=channel_credentials(settings))
    indexer = Indexer(settings, embed=model.embed, store=store, redis_client=client)
    jobs = JobStore(client, prefix=settings.key_prefix, ttl_s=settings.job_ttl_s)
    runner = ServiceRunner(name="embedder", settings=settings, registry=registry, provider=provider)
    from goodput_embedder.servicer import EmbeddingServicer, IndexerServicer

    runner.add(embedder_pb2_grpc.add_EmbeddingServicer_to_server, EmbeddingServicer(settings, batcher),
               "goodput.embedder.v1.Embedding")
    runner.add(embedder_pb2_grpc.add_IndexerServicer_to_server,
               IndexerServicer(settings, indexer, jobs, create_app(settings)), "goodput.embedder.v1.Indexer")

    async def close() -> None:
        await batcher.close()
        store.close()
        client.close()

    runner.on_stop.append(close)
    return runner, batcher


async def serve() -> None:
    rt = bootstrap("embedder", EmbedderSettings)
    runner, _ = build(rt.settings, rt.registry, rt.provider)
    await runner.run()


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
