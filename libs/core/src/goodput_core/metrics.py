"""Prometheus metrics: a registry per service (no global state, so several services can share one process in
tests), a gRPC server interceptor counting every call, the `/metrics` + `/healthz` HTTP app, and
:class:`StoreReadings`, which reads what a store holds off the scrape path so that `/metrics` never waits on it.

Example:
    >>> registry = CollectorRegistry()
    >>> app = ops_app(registry, ready=lambda: True)   # serve with uvicorn on the service's HTTP port
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from goodput_core.handlers import WrappingInterceptor, rewrap

log = logging.getLogger("goodput.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GrpcServerMetrics(WrappingInterceptor):
    """Counts calls by method and status and times them (streams: until the last message)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter("goodput_grpc_server_handled_total", "gRPC calls completed, by status code.",
                               ["service", "method", "code"], registry=registry)
        self.seconds = Histogram("goodput_grpc_server_handling_seconds", "gRPC call duration.",
                                 ["service", "method"], buckets=LATENCY_BUCKETS, registry=registry)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        _, _, rest = details.method.partition("/")
        service, _, name = rest.partition("/")
        if service.startswith(("grpc.health", "grpc.reflection")):
            return handler
        labels = (service, name)
        return rewrap(handler, unary=lambda fn: self._unary(fn, labels), stream=lambda fn: self._stream(fn, labels))

    def _record(self, labels: tuple[str, str], context: aio.ServicerContext, start: float,
                error: BaseException | None) -> None:
        code = _code_of(context, error)
        self.handled.labels(*labels, code.name).inc()
        self.seconds.labels(*labels).observe(time.perf_counter() - start)

    def _unary(self, fn: Callable[..., Awaitable[Any]], labels: tuple[str, str]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext) -> Any:
            start, error = time.perf_counter(), None
            try:
                return await fn(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._record(labels, context, start, error)
        return wrapper

    def _stream(self, fn: Callable[..., Any], labels: tuple[str, str]) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            start, error = time.perf_counter(), None
            try:
                async for item in fn(request, context):
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._record(labels, context, start, error)
        return wrapper


def _code_of(context: aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc versions
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (GeneratorExit,)) or type(error).__name__ == "CancelledError":
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class SharedCounter(Collector):
    """A counter kept outside this process and read at scrape time, one sample per label value: what every
    process of a pool counts into one place (a Redis hash the workers HINCRBY), so the process serving /metrics
    reports the work its prefork children did. A failed read (or ``None``: nothing read yet) gives the family
    without samples, not a failed scrape; ``known`` label values are always reported (0 until counted). Give it a
    getter of :class:`StoreReadings` as ``read`` so that the scrape does not wait on the store.

    Example (in a service, ``read`` is ``lambda: {k.decode(): int(v) for k, v in redis.hgetall(key).items()}``):
        >>> registry = CollectorRegistry()
        >>> registry.register(SharedCounter("goodput_embedder_jobs", "Reindex jobs by outcome.", "outcome",
        ...                                 read=lambda: {"completed": 3}, known=("failed",)))
        >>> registry.get_sample_value("goodput_embedder_jobs_total", {"outcome": "completed"})
        3
        >>> registry.get_sample_value("goodput_embedder_jobs_total", {"outcome": "failed"})
        0
    """

    def __init__(self, name: str, documentation: str, label: str, *, read: Callable[[], dict[str, int] | None],
                 known: tuple[str, ...] = ()) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.read = read
        self.known = known

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self._family()
        try:
            counts = self.read()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the store blinked
            return [family]
        if counts is None:  # not read yet (a getter of StoreReadings)
            return [family]
        for value in sorted(set(self.known) | set(counts)):
            family.add_metric([value], counts.get(value, 0))
        return [family]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=[self.label])


class StoreReadings(Collector):
    """Values read from a store (Redis) off the scrape path, so that a scrape only reads memory: a slow or hung
    store can never stall `/metrics`, nor, on an event loop, every stream beside it. A read that fails or times out
    keeps the last values; ``goodput_store_readings_age_seconds{source}`` says how old they are (``+Inf`` until the
    first read) and ``goodput_store_readings_failures_total{source}`` how many rounds failed.

    Two ways to run the reads (blocking functions, called in a worker thread, never on the caller's thread):

    - on an event loop, :meth:`start` refreshes every ``interval_s`` in an asyncio task, each round given up after
      ``timeout_s`` (``await stop()`` at shutdown); a scrape never waits;
    - in a process whose metrics server is a thread of its own (a Celery worker), ``scrape_wait_s`` > 0 starts a
      round when a scrape comes and waits for it that long at most, then serves what it has.

    Registered in ``registry`` before the metrics that read its values (so an on-scrape round is done before
    they are collected).

    Example:
        >>> registry = CollectorRegistry()
        >>> readings = StoreReadings("jobs", registry)
        >>> queued = readings.add("queued", lambda: 3)
        >>> queued() is None   # nothing read yet: a scrape reports no value rather than waiting
        True
        >>> readings.refresh()
        True
        >>> queued()
        3
        >>> registry.get_sample_value("goodput_store_readings_failures_total", {"source": "jobs"})
        0.0
    """

    def __init__(self, source: str, registry: CollectorRegistry | None, *, interval_s: float = 5.0,
                 timeout_s: float = 2.0, scrape_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.interval_s, self.timeout_s, self.scrape_wait_s = interval_s, timeout_s, scrape_wait_s
        self._clock = clock
        self._reads: dict[str, Callable[[], Any]] = {}
        self._values: dict[str, Any] = {}
        self._last_ok: float | None = None
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._round: threading.Thread | None = None
        if registry is not None:
            registry.register(self)

    def add(self, key: str, read: Callable[[], Any]) -> Callable[[], Any]:
        """Registers ``read`` (blocking); returns the getter of its last value (``None`` until it succeeded)."""
        self._reads[key] = read
        return lambda: self._values.get(key)

    def age_s(self) -> float:
        return float("inf") if self._last_ok is None else self._clock() - self._last_ok

    def refresh(self) -> bool:
        """One round of reads on this thread; keeps the last values if one fails."""
        try:
            values = {key: read() for key, read in self._reads.items()}
        except Exception as err:  # noqa: BLE001 - the store blinked: keep the last values, count it
            self._failed(err)
            return False
        self._values = values  # one assignment: a scrape sees the old round or the new one, never a mix
        self._last_ok = self._clock()
        return True

    def _failed(self, err: BaseException) -> None:
        self.failures += 1
        log.debug("store readings failed", extra={"source": self.source, "error": repr(err)})

    def _round_in_thread(self, wait_s: float) -> bool:
        """Starts a round in a thread unless one is still out (a hung store holds one thread, never more) and
        waits ``wait_s`` for it; False when it is not done by then."""
        if self._round is None or not self._round.is_alive():
            self._round = threading.Thread(target=self.refresh, name=f"store-readings-{self.source}", daemon=True)
            self._round.start()
        self._round.join(wait_s)
        if self._round.is_alive():
            self._failed(TimeoutError(f"no answer within {wait_s}s"))
            return False
        return True

    async def refresh_async(self) -> bool:
        """One round in a worker thread, given up (but left to finish on its own) after ``timeout_s``."""
        return await asyncio.to_thread(self._round_in_thread, self.timeout_s)

    def start(self) -> asyncio.Task[None]:
        """Refreshes on the running event loop every ``interval_s`` until :meth:`stop`."""
        async def loop() -> None:
            while True:
                await self.refresh_async()
                await asyncio.sleep(self.interval_s)
        if self._task is None:
            self._task = asyncio.create_task(loop(), name=f"store-readings-{self.source}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def describe(self) -> list[Any]:
        return list(self._families())

    def collect(self) -> list[Any]:
        if self.scrape_wait_s > 0:
            self._round_in_thread(self.scrape_wait_s)
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        age = GaugeMetricFamily("goodput_store_readings_age_seconds", "Seconds since the values read from a "
                                "store off the scrape path were last refreshed (+Inf before the first read).",
                                labels=["source"])
        age.add_metric([self.source], self.age_s())
        failures = CounterMetricFamily("goodput_store_readings_failures", "Rounds of store reads that failed or "
                                       "timed out (the last values are kept).", labels=["source"])
        failures.add_metric([self.source], float(self.failures))
        return age, failures


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def ops_app(registry: CollectorRegistry, *, ready: Callable[[], bool]) -> Starlette:
    """`/metrics` (Prometheus text format) and `/healthz` (200 when ready, 503 otherwise)."""

    async def metrics(_: Request) -> Response:
        return metrics_response(registry)

    async def healthz(_: Request) -> Response:
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)])
