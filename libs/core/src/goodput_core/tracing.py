"""OpenTelemetry tracing: one tracer provider per service, gRPC client and server interceptors that propagate the
W3C trace context across every hop, and exporters chosen by settings.

Example::

    provider = setup_tracing(service="gateway", exporter="otlp")
    channel = grpc.aio.insecure_channel(addr, interceptors=client_interceptors(provider))
    server = grpc.aio.server(interceptors=[server_interceptor(provider), ...])
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Health checks and load polls run every second: tracing them would drown the request traces. The scheduler's
# multiplexed lease stream lives as long as its gateway and carries many requests: each lease is a span of its own
# request's trace (goodput_scheduler.mux), and one span for the whole stream would say nothing but cost every message.
_UNTRACED_METHODS = frozenset({"/goodput.scheduler.v1.Scheduler/LeaseBatches"})
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection")


def traced(details: Any) -> bool:
    """Whether a call (a server's HandlerCallDetails or a channel's ClientCallDetails) gets a span. The same test as
    the instrumentation's composed ``filters`` (health checks, ``GetLoad``, the lease streams, reflection), in one
    function: those check the details' type against a typing Protocol once per filter, on every call."""
    method = details.method
    if isinstance(method, bytes):  # a channel's details carry bytes (grpc/grpc#31092)
        method = method.decode()
    service, _, name = method.lstrip("/").rpartition("/")
    return not (name == "GetLoad" or method in _UNTRACED_METHODS or service.startswith(_UNTRACED_SERVICES))


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line (for local debugging and multi-process tests)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(json.dumps({
                "name": s.name,
                "service": s.resource.attributes.get("service.name"),
                "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
                "span_id": f"{ctx.span_id:016x}" if ctx else None,
                "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None,
                "kind": s.kind.name,
                "start_ns": s.start_time,
                "end_ns": s.end_time,
                "attributes": {k: _jsonable(v) for k, v in (s.attributes or {}).items()},
                "status": s.status.status_code.name,
            }))
        with self._lock, open(self._path, "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def setup_tracing(*, service: str, exporter: str = "none", file: str = "",
                  span_exporter: SpanExporter | None = None) -> TracerProvider:
    """Builds the service's tracer provider, installs it globally (for libraries) and sets W3C propagation.

    ``span_exporter`` overrides the exporter chosen by name (tests pass an in-memory exporter).
    """
    exporting = span_exporter is not None or exporter != "none"
    # No exporter: a span is recorded only where the caller's trace is sampled (it still gets ids, for the logs, and
    # passes the trace on); recording spans nobody exports costs every request for nothing. OTEL_TRACES_SAMPLER
    # (OpenTelemetry's standard variable, e.g. parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG=0.01 under heavy
    # traffic) chooses otherwise, exporter or not.
    sampler = None if exporting or os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(ALWAYS_OFF)
    provider = TracerProvider(resource=Resource.create({"service.name": f"goodput-{service}"}), sampler=sampler)
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "file":
        if not file:
            raise ValueError("otel_exporter=file needs otel_file")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(file)))
    trace.set_tracer_provider(provider)
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]))
    return provider


def client_interceptors(provider: TracerProvider | None) -> list[Any]:
    """Interceptors for a ``grpc.aio`` channel: a client span per call and the trace context in the metadata."""
    return list(aio_client_interceptors(tracer_provider=provider, filter_=traced))


def server_interceptor(provider: TracerProvider | None) -> Any:
    """Interceptor for a ``grpc.aio`` server: a server span per call, child of the caller's span."""
    return aio_server_interceptor(tracer_provider=provider, filter_=traced)
