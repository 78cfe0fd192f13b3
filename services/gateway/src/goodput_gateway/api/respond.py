"""One way every REST generation is answered: :func:`respond` opens the generation under a span, counts the request,
gives the answer's headers, streams it (recorded for resume) or returns it whole with its ``Server-Timing``, and
closes it, which records the answer (:mod:`goodput_gateway.accounting`). The routes say only how their API shapes an
answer (a :class:`Shape`); refusals are shaped and counted by the app's error handler
(:func:`goodput_gateway.api.create_app`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from goodput_core.context import REQUEST_ID_HEADER, request_context
from goodput_core.errors import GoodputError
from goodput_core.priority import priority_name

from goodput_gateway.caching import CACHE_HEADER
from goodput_gateway.events import SSE_HEADERS
from goodput_gateway.generation import Call, Generation, Opened
from goodput_gateway.resume import STREAM_HEADER, StreamBuffer, sse_error, sse_events
from goodput_gateway.service import GatewayService
from goodput_gateway.wire import DEGRADED_HEADER, ROUTE_HEADER, SERVER_TIMING_HEADER, error_response

__all__ = ["Shape", "respond"]


@dataclass(frozen=True)
class Shape:
    """How one API writes an answer: whole (``body``: the generation collected into its JSON) or streamed
    (``events``: its server-sent events); a resumable stream is named ``stream_id(opened)`` and an error of it is
    written by ``error``."""

    body: Callable[[Generation], Awaitable[dict[str, Any]]]
    events: Callable[[Generation, trace.Span], AsyncIterator[bytes]]
    stream_id: Callable[[Opened], str]
    error: Callable[[GoodputError], bytes] = sse_error


async def respond(request: Request, call: Call, shape: Shape, *, route: str, service: GatewayService,
                  streams: StreamBuffer) -> Response:
    tracer: trace.Tracer = request.app.state.tracer
    span = tracer.start_span(f"POST {request.url.path}", kind=SpanKind.SERVER,
                             attributes={"goodput.request_id": call.request_id, "http.route": request.url.path})
    with request_context(request_id=call.request_id), trace.use_span(span, end_on_exit=False):
        try:
            generation = await service.open(call)
        except BaseException as err:
            if isinstance(err, GoodputError):  # shaped and counted by the app's handler
                span.set_status(Status(StatusCode.ERROR, err.message))
            span.end()
            raise
    opened = generation.opened
    service.metrics.requests.labels(route, "200", priority_name(opened.priority)).inc()
    span.set_attribute("goodput.tenant", opened.tenant)
    span.set_attribute("goodput.worker", opened.worker_id)
    headers = _headers(opened)
    if opened.request.stream:
        events = _ended(shape.events(generation, span), span)
        if streams.enabled:  # the generation runs to its end on its own, each event numbered, for a resume
            sid = headers[STREAM_HEADER] = shape.stream_id(opened)
            events = sse_events(streams.stream(events, api="sse", tenant=opened.tenant, stream_id=sid,
                                               closer=generation.aclose), sid, error=shape.error)
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    try:
        with trace.use_span(span, end_on_exit=False):
            async with generation:
                body = await shape.body(generation)
                timeline = generation.timing()  # post-processing ends here: the body is built
    except GoodputError as err:
        span.set_status(Status(StatusCode.ERROR, err.message))
        return error_response(err, call.request_id)
    finally:
        span.end()
    if timeline is not None:  # where the time went, per stage (milliseconds)
        headers[SERVER_TIMING_HEADER] = timeline.server_timing()
    if DEGRADED_HEADER in headers:
        body["goodput_degraded"] = list(opened.timeline.degraded if opened.timeline is not None else ())
    return JSONResponse(body, headers=headers)


def _headers(opened: Opened) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: opened.request_id, **opened.rate_limits}
    if opened.cache is not None:  # X-Goodput-Cache: hit; layer=l2; similarity=0.973
        headers[CACHE_HEADER] = opened.cache.header()
    timeline = opened.timeline
    if timeline is not None and timeline.degraded:  # X-Goodput-Degraded: skip_rerank, fewer_chunks (in order)
        headers[DEGRADED_HEADER] = ", ".join(timeline.degraded)
    if timeline is not None and timeline.route is not None:  # model "auto": what it chose
        headers[ROUTE_HEADER] = timeline.route.header()
    return headers


async def _ended(events: AsyncIterator[bytes], span: trace.Span) -> AsyncIterator[bytes]:
    try:
        async for chunk in events:
            yield chunk
    finally:
        span.end()
