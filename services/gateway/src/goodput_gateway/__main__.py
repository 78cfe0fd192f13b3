"""`python -m goodput_gateway`: the public gRPC API and the OpenAI-compatible REST API."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from goodput.cache.v1 import cache_pb2_grpc
from goodput.gateway.v1 import gateway_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2_grpc
from grpc import aio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.bootstrap import bootstrap
from goodput_core.clients import make_channel
from goodput_core.server import ServiceRunner, run_main
from goodput_core.tls import channel_credentials

from goodput_gateway.api import create_app
from goodput_gateway.auth import ApiKeyStore, KeysFileWatcher
from goodput_gateway.caching import GatewayCache
from goodput_gateway.config import GatewaySettings
from goodput_gateway.dependencies import gateway_breakers
from goodput_gateway.feedback import FeedbackStore
from goodput_gateway.guard import PublicApiGuard
from goodput_gateway.jobs import JobQueue
from goodput_gateway.knowledge import Knowledge
from goodput_gateway.ladder import Ladder, LadderMetrics
from goodput_gateway.metering import Meter
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.quotas import Quotas
from goodput_gateway.responses import ResponseStore
from goodput_gateway.resume import StreamBuffer
from goodput_gateway.service import GatewayService
from goodput_gateway.servicer import GatewayServicer
from goodput_gateway.storage import AsyncStorageLedger, StorageLedger, storage_prefix
from goodput_gateway.tenants import TenantLabels
from goodput_gateway.timing import TimingMetrics
from goodput_gateway.trace_recorder import TraceRecorder


@dataclass
class Wiring:
    """The gateway's composition: the service and what it holds open."""

    service: GatewayService
    _channels: list[aio.Channel]
    responses: ResponseStore  # stored Responses API responses (the data Redis, shared by every replica)
    _redis: aioredis.Redis | None = None
    streams: StreamBuffer | None = None  # streamed answers recorded for resume (goodput_gateway.resume)
    _stream_redis: aioredis.Redis | None = None  # its own Redis (RESUME__REDIS_URL), when not the data Redis
    _data_redis: aioredis.Redis | None = None  # the data Redis (REDIS_URL), when not the quota Redis

    async def settle(self) -> None:
        """Waits for the work sent off the response path (lease releases, cache stores, quota settlements) and
        writes the usage counted so far."""
        await self.service.pipeline.settle()
        if self.service.cache is not None:
            await self.service.cache.settle()
        await self.service.quotas.settle_all()
        if self.service.feedback is not None:
            await self.service.feedback.settle()
        await self.service.meter.flush()

    async def close(self) -> None:
        if self.streams is not None:  # streams still producing are cut (their followers told), before the pipeline
            await self.streams.close()
        await self.settle()
        if self.service.trace is not None:
            self.service.trace.close()  # writes the queued trace lines (a bounded wait, at shutdown)
        await self.service.meter.stop()
        await self.service.quotas.close()
        await self.service.pipeline.close()
        if self.service.knowledge is not None:
            await self.service.knowledge.close()
        for channel in self._channels:
            await channel.close(grace=None)
        if self._redis is not None:
            await self._redis.aclose()
        if self._stream_redis is not None:
            await self._stream_redis.aclose()
        if self._data_redis is not None:
            await self._data_redis.aclose()


SCHEDULER_SERVICE = "goodput.scheduler.v1.Scheduler"


def compose(settings: GatewaySettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
            jobs: JobQueue | None = None) -> Wiring:
    """The one composition root: the gateway's service with its clients, for the server and the jobs worker."""
    keys = ApiKeyStore.from_sources(file=settings.api_keys_file, inline=settings.api_keys)
    # Every internal call goes out over mutual TLS with the gateway's own certificate (the jobs worker's, in it).
    credentials = channel_credentials(settings)

    def dial(addr: str) -> aio.Channel:
        return make_channel(addr, provider, credentials=credentials)

    # to the scheduler replica that leads (its Scheduler health SERVING), following it when it changes
    # untraced: each admit on the lease stream carries its request's trace context, and an intercepted stream costs
    # every lease message two more hops
    scheduler_channel = make_channel(settings.scheduler_addr, provider, credentials=credentials,
                                     health_service=SCHEDULER_SERVICE, traced=False)
    channels = [scheduler_channel]
    metrics = GatewayMetrics(registry)
    breakers = gateway_breakers(settings.breakers, registry)  # one per dependency (goodput_gateway.dependencies)
    def dial_worker(addr: str) -> aio.Channel:  # the token path: its call's span is the pipeline's own
        return make_channel(addr, provider, credentials=credentials, traced=False)

    pipeline = Pipeline(settings, scheduler=scheduler_pb2_grpc.SchedulerStub(scheduler_channel),
                        channel_factory=dial_worker, metrics=metrics, breaker=breakers["scheduler"])
    knowledge = Knowledge(settings, channel_factory=dial, breakers=breakers)
    cache = None
    if settings.cache_addr:
        cache_channel = dial(settings.cache_addr)
        channels.append(cache_channel)
        cache = GatewayCache(settings, stub=cache_pb2_grpc.CacheStub(cache_channel), registry=registry,
                             breaker=breakers["cache"])
    # Quotas and usage live in Redis, shared by every replica (and the jobs workers); without one, in this process.
    quota_url = settings.quota_redis_url or settings.redis_url
    labels = TenantLabels(settings.metrics_tenants)
    quotas = Quotas(settings, redis_url=quota_url, registry=registry, labels=labels)
    usage_redis = (aioredis.Redis.from_url(quota_url, socket_timeout=2, socket_connect_timeout=2)
                   if quota_url else None)
    meter = Meter(settings, redis=usage_redis, registry=registry, labels=labels)
    # What tenants store (responses, answers kept for feedback, resume recordings) is on the data Redis (REDIS_URL)
    # where that is another instance, and its ledger (goodput_gateway.storage) beside the quota counters: filling a
    # store can never make quotas fail open.
    data_redis = None
    if settings.redis_url and settings.redis_url != quota_url:
        data_redis = aioredis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    state_redis = data_redis or usage_redis
    ledger = AsyncStorageLedger(usage_redis, prefix=storage_prefix(settings))
    timing = TimingMetrics(registry, settings.latency_profile, labels=labels)
    service = GatewayService(settings, keys=keys, pipeline=pipeline, metrics=metrics, knowledge=knowledge,
                             cache=cache, jobs=jobs, quotas=quotas, meter=meter,
                             timing_metrics=timing,
                             feedback=FeedbackStore(settings, redis=state_redis, metrics=timing, ledger=ledger,
                                                    quota_of=keys.storage_of),
                             ladder=Ladder(settings.latency_profile, metrics=LadderMetrics(registry, labels),
                                           enabled=settings.ladder.enabled, interval_s=settings.ladder.interval_s,
                                           raise_at=settings.ladder.raise_at, lower_at=settings.ladder.lower_at),
                             trace=TraceRecorder.from_settings(settings, registry=registry))
    # Stream resume's event buffers: rewritten at token rate and short-lived, so they may have a Redis of their own.
    stream_redis = None
    if settings.resume.redis_url and settings.resume.redis_url not in (quota_url, settings.redis_url):
        stream_redis = aioredis.Redis.from_url(settings.resume.redis_url, socket_timeout=2, socket_connect_timeout=2)
    streams = StreamBuffer(settings, redis=stream_redis or state_redis, registry=registry, ledger=ledger,
                           quota_of=keys.storage_of)
    return Wiring(service, channels, ResponseStore(settings, redis=state_redis, ledger=ledger), usage_redis, streams,
                  stream_redis, data_redis)


def build(settings: GatewaySettings, registry: CollectorRegistry, provider: TracerProvider | None) -> ServiceRunner:
    """The gateway's servers around :func:`compose` (also used by tests to run it in-process)."""
    jobs = None
    if settings.redis_url and settings.jobs.park_shed_p2:
        import redis

        quota_url = settings.quota_redis_url or settings.redis_url
        jobs = JobQueue(settings, redis.Redis.from_url(settings.redis_url, socket_timeout=2), registry=registry,
                        ledger=StorageLedger(redis.Redis.from_url(quota_url, socket_timeout=2),
                                             prefix=storage_prefix(settings)))
    wiring = compose(settings, registry, provider, jobs=jobs)
    tracer = (provider.get_tracer("goodput.gateway") if provider is not None
              else TracerProvider().get_tracer("goodput.gateway"))
    holder: dict[str, ServiceRunner] = {}
    app = create_app(wiring.service, tracer=tracer, ready=lambda: holder["runner"].ready,
                     jobs_queue=jobs, responses_store=wiring.responses,
                     stream_buffer=wiring.streams)
    # Its gRPC port is the public API (API keys), not an internal one: the key is checked before a message is read,
    # the message's size before it is parsed (guard.py).
    guard = PublicApiGuard(wiring.service.keys, max_message_bytes=settings.limits.grpc_message_bytes)
    # gRPC refuses a message above the limit before receiving the rest of it; h11 (not httptools, which has no
    # limit) stops reading a request head above LIMITS__HEADER_BYTES.
    runner = ServiceRunner(name="gateway", settings=settings, registry=registry, provider=provider, http_app=app,
                           public=True, interceptors=[guard],
                           grpc_options=[("grpc.max_receive_message_length", settings.limits.grpc_message_bytes)],
                           http_options={"http": "h11", "h11_max_incomplete_event_size": settings.limits.header_bytes})
    holder["runner"] = runner
    runner.add(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(wiring.service, streams=wiring.streams),
               "goodput.gateway.v1.Gateway")
    if jobs is not None and jobs.metrics.readings is not None:
        # Jobs by state are read from Redis in the background: a scrape never waits on Redis (nor, with it, the
        # streams this event loop serves).
        runner.on_start.append(_started(jobs.metrics.readings.start))
        runner.on_stop.append(jobs.metrics.readings.stop)
    # A rotated key stops working within api_keys_reload_s, without a restart.
    watcher = KeysFileWatcher(wiring.service.keys, file=settings.api_keys_file, inline=settings.api_keys,
                              interval_s=settings.api_keys_reload_s, registry=registry)
    runner.on_start.append(_started(watcher.start))
    runner.on_start.append(_started(wiring.service.meter.start))
    runner.on_stop.append(watcher.stop)
    runner.on_stop.append(wiring.close)
    return runner


def _started(start: Callable[[], object]) -> Callable[[], Coroutine[Any, Any, None]]:
    async def hook() -> None:
        start()
    return hook


async def serve() -> None:
    rt = bootstrap("gateway", GatewaySettings)
    try:
        runner = build(rt.settings, rt.registry, rt.provider)
    except (OSError, ValueError) as err:
        raise SystemExit(f"gateway: cannot load API keys: {err}") from None
    await runner.run()


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
