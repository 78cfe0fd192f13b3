"""`python -m goodput_cache`: the L1/L2 response cache behind gRPC."""

from __future__ import annotations

from typing import NamedTuple

from goodput.cache.v1 import cache_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from goodput_core.bootstrap import bootstrap
from goodput_core.clients import make_channel
from goodput_core.server import ServiceRunner, run_main
from goodput_core.tls import channel_credentials

from goodput_cache.cache import CacheMetrics, ResponseCache
from goodput_cache.config import CacheSettings
from goodput_cache.embedding import LocalVectoriser, RemoteVectoriser, Vectoriser
from goodput_cache.servicer import CacheServicer
from goodput_cache.verify import load_verifier


class CacheService(NamedTuple):
    runner: ServiceRunner
    cache: ResponseCache


def build(settings: CacheSettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
          vectoriser: Vectoriser | None = None) -> CacheService:
    """Wires the cache (also used by tests to run it in-process; they may pass a shared vectoriser)."""
    redis = Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s,
                           socket_connect_timeout=settings.redis_timeout_s)
    versions = (Redis.from_url(settings.kb_redis_url, socket_timeout=settings.redis_timeout_s,
                               socket_connect_timeout=settings.redis_timeout_s) if settings.kb_redis_url else None)
    if vectoriser is None and settings.semantic:
        vectoriser = (RemoteVectoriser(make_channel(settings.embedder_addr, provider,
                                                    credentials=channel_credentials(settings)),
                                       timeout_s=settings.embedder_timeout_s) if settings.embedder_addr
                      else LocalVectoriser(model_path=settings.embedder_model_path, threads=settings.embedder_threads,
                                           spin=settings.embedder_spin))
    cache = ResponseCache(settings, redis=redis, vectoriser=vectoriser, metrics=CacheMetrics(registry),
                          verifier=load_verifier(settings) if vectoriser is not None else None, versions=versions)
    runner = ServiceRunner(name="cache", settings=settings, registry=registry, provider=provider)
    runner.add(cache_pb2_grpc.add_CacheServicer_to_server, CacheServicer(cache), "goodput.cache.v1.Cache")
    runner.on_stop.append(cache.stop)
    return CacheService(runner, cache)


async def serve() -> None:
    rt = bootstrap("cache", CacheSettings)
    runner, cache = build(rt.settings, rt.registry, rt.provider)
    await runner.run(after_start=cache.start)


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
