"""Prometheus metrics: a registry per service (no global state, so several services can share one process in
tests), a gRPC server interceptor counting every call, and the `/metrics` + `/healthz` HTTP app.

Example:
    >>> registry = CollectorRegistry()
    >>> app = ops_app(registry, ready=lambda: True)   # serve with uvicorn on the service's HTTP port
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from goodput_core.handlers import rewrap

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GrpcServerMetrics(aio.ServerInterceptor):
    """Counts calls by method and status and times them (streams: until the last message)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter("goodput_grpc_server_handled_total", "gRPC calls completed, by status code.",
                               ["service", "method", "code"], registry=registry)
        self.seconds = Histogram("goodput_grpc_server_handling_seconds", "gRPC call duration.",
                                 ["service", "method"], buckets=LATENCY_BUCKETS, registry=registry)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        _, _, rest = handler_call_details.method.partition("/")
        service, _, method = rest.partition("/")
        if service.startswith(("grpc.health", "grpc.reflection")):
            return handler
        labels = (service, method)
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
    reports the work its prefork children did. A failed read gives the family without samples, not a failed
    scrape; ``known`` label values are always reported (0 until counted).

    Example (in a service, ``read`` is ``lambda: {k.decode(): int(v) for k, v in redis.hgetall(key).items()}``):
        >>> registry = CollectorRegistry()
        >>> registry.register(SharedCounter("goodput_embedder_jobs", "Reindex jobs by outcome.", "outcome",
        ...                                 read=lambda: {"completed": 3}, known=("failed",)))
        >>> registry.get_sample_value("goodput_embedder_jobs_total", {"outcome": "completed"})
        3
        >>> registry.get_sample_value("goodput_embedder_jobs_total", {"outcome": "failed"})
        0
    """

    def __init__(self, name: str, documentation: str, label: str, *, read: Callable[[], dict[str, int]],
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
        for value in sorted(set(self.known) | set(counts)):
            family.add_metric([value], counts.get(value, 0))
        return [family]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=[self.label])


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
