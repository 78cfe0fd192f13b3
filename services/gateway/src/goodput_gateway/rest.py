"""OpenAI-compatible REST API: `/v1/chat/completions`, `/v1/completions` (streaming SSE and not), `/v1/models`,
plus `/healthz` and `/metrics`. Errors use OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`).

Goodput extensions: the `priority` body field or `X-Goodput-Priority` header ("P0", "P1", "P2"); RAG with the
`knowledge_base` body field or `X-Goodput-Knowledge-Base` header (the answer then carries `sources` beside
`choices`, or on the first chunk of a stream); the knowledge routes of :mod:`goodput_gateway.knowledge`;
`GET /v1/usage` (the tenant's metered usage, :mod:`goodput_gateway.metering`); with deferred jobs configured, OpenAI's
Files and Batch APIs (:mod:`goodput_gateway.jobs.batch_routes`). Every generation response carries
OpenAI's `x-ratelimit-*` headers for the caller's limits (:mod:`goodput_gateway.quotas`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from goodput_core.context import REQUEST_ID_HEADER, new_request_id, request_context
from goodput_core.errors import GoodputError, InvalidArgument, NotFound, PermissionDenied, Unavailable
from goodput_core.metrics import metrics_response
from goodput_core.priority import priority_name

from goodput_gateway.caching import CACHE_HEADER
from goodput_gateway.events import SSE_HEADERS
from goodput_gateway.feedback import FeedbackRequest
from goodput_gateway.generation import Call
from goodput_gateway.jobs import JobQueue
from goodput_gateway.jobs.batch_routes import install_routes as install_batch_routes
from goodput_gateway.jobs.batches import BatchStore
from goodput_gateway.jobs.routes import install_routes as install_job_routes
from goodput_gateway.knowledge import install_routes as install_knowledge_routes
from goodput_gateway.limits import HeaderLimit, read_limited
from goodput_gateway.metering import parse_period
from goodput_gateway.rag import KB_HEADER
from goodput_gateway.requests import GenerationRequest
from goodput_gateway.responses import ResponseStore
from goodput_gateway.responses import install_routes as install_responses_routes
from goodput_gateway.resume import LAST_EVENT_ID, STREAM_HEADER, StreamBuffer, resume_response, sse_events
from goodput_gateway.resume import install_routes as install_resume_routes
from goodput_gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from goodput_gateway.service import GatewayService
from goodput_gateway.wire import (
    DEGRADED_HEADER,
    ROUTE_HEADER,
    SERVER_TIMING_HEADER,
    completion_body,
    deadline_header,
    error_response,
    stream_events,
)

__all__ = ["create_app"]

log = logging.getLogger("goodput.gateway.rest")
PRIORITY_HEADER = "x-goodput-priority"


def create_app(service: GatewayService, *, registry: CollectorRegistry, tracer: trace.Tracer,
               ready: Callable[[], bool], jobs: JobQueue | None = None, responses: ResponseStore | None = None,
               serve_metrics: bool = True, streams: StreamBuffer | None = None) -> FastAPI:
    """The REST app; ``serve_metrics=False`` leaves `/metrics` off it (served on the metrics port instead);
    ``responses`` stores the Responses API's responses (default: in this process); ``streams`` records streamed
    answers for resume (goodput_gateway.resume; default: in this process, on with RESUME_WINDOW_S)."""
    streams = streams or StreamBuffer(service.settings, redis=None)
    app = FastAPI(title="Goodput gateway", version="v1", docs_url=None, redoc_url=None)
    app.add_middleware(HeaderLimit, max_bytes=service.settings.max_header_bytes)
    app.state.goodput_service = service  # for in-process tests and debugging

    @app.exception_handler(GoodputError)
    async def _goodput_error(request: Request, err: GoodputError) -> JSONResponse:
        return error_response(err, request.headers.get(REQUEST_ID_HEADER))

    @app.exception_handler(RedisError)
    async def _store_error(request: Request, err: RedisError) -> JSONResponse:
        # Usage, files, batches and jobs live in Redis: a Redis that is down is a 503 the client can retry.
        log.warning("a store the gateway needs failed", extra={"error": repr(err), "path": request.url.path})
        return error_response(Unavailable(f"a store this route needs is unavailable ({type(err).__name__})",
                                          code="store_unavailable"), request.headers.get(REQUEST_ID_HEADER))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = {"error": {"message": str(err.detail), "type": "invalid_request_error", "param": None,
                          "code": "not_found" if err.status_code == 404 else "http_error"}}
        return JSONResponse(body, status_code=err.status_code)

    @app.get("/health")  # vLLM's name for it, which the field's benchmark clients probe first
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    if serve_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            return metrics_response(registry)

    async def served_models() -> list[dict[str, Any]]:
        """The generation models of healthy workers, then the embedding model (when an embedder answers)."""
        data: list[dict[str, Any]] = [
            {"id": m.id, "object": "model", "created": 0, "owned_by": "goodput", "max_model_len": m.max_model_len,
             **({"aliases": list(m.aliases)} if m.aliases else {})}
            for m in await service.pipeline.models()]
        embedding = await service.knowledge.embedding_model() if service.knowledge is not None else None
        if embedding is not None:
            data.append({"id": embedding[0], "object": "model", "created": 0, "owned_by": "goodput",
                         "dimensions": embedding[1]})
        return data

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        service.authenticate(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": await served_models()})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        service.authenticate(request.headers.get("authorization"))
        for model in await served_models():
            if model["id"] == model_id or model_id in model.get("aliases", ()):
                return JSONResponse(model)
        raise NotFound(f"The model '{model_id[:128]}' does not exist", param="model", code="model_not_found")

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> JSONResponse:
        """What became of an answer (used, discarded, regenerated): a discarded one is no goodput after all."""
        principal = service.authenticate(request.headers.get("authorization"))
        body = parse(FeedbackRequest, await read_json(request))
        if service.feedback is None:
            raise Unavailable("feedback is not taken by this gateway", code="feedback_disabled")
        return JSONResponse(await service.feedback.record(principal.tenant, body.request_id, body.verdict))

    @app.get("/v1/usage")
    async def usage(request: Request, period: str | None = None, tenant: str | None = None) -> JSONResponse:
        """The caller's tenant's usage in a month (default: this one) or a day, by model; an operator key may name
        any tenant, or ``*`` for all of them."""
        principal = service.authenticate(request.headers.get("authorization"))
        when = parse_period(period)
        if tenant and tenant != principal.tenant and not principal.operator:
            raise PermissionDenied("only an operator key may read another tenant's usage", param="tenant")
        meter = service.meter
        names = await meter.tenants(when) if tenant == "*" else [tenant or principal.tenant]
        data = [{"tenant": name, "model": model, **counts}
                for name in names for model, counts in (await meter.usage(name, when)).items()]
        body: dict[str, Any] = {"object": "list", "period": when, "data": data}
        if not tenant or tenant == principal.tenant:
            body["tenant"] = principal.tenant
            body["limits"] = asdict(principal.tenant_quota)
        return JSONResponse(body)

    async def read_json(request: Request) -> Any:
        """The body as JSON; called only after authentication. Read in pieces: 413 as soon as it passes
        max_body_bytes (a declared Content-Length above it is refused before any of it is read)."""
        raw = await read_limited(request.stream(), limit=service.settings.max_body_bytes,
                                 declared=request.headers.get("content-length"))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidArgument(f"request body is not valid UTF-8 (byte {err.start})",
                                  code="invalid_encoding") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"request body is not valid JSON: {err.msg} at line {err.lineno} column "
                                  f"{err.colno}", code="invalid_json") from None

    async def handle(request: Request, route: str, schema: type[ChatCompletionRequest | CompletionRequest]) -> Response:
        if streams.enabled and request.headers.get(LAST_EVENT_ID):  # an SSE client reconnecting: the rest, not anew
            return await resume_response(service, streams, request)
        arrived = time.monotonic()
        request_id = new_request_id()
        span = tracer.start_span(f"POST {request.url.path}", kind=SpanKind.SERVER,
                                 attributes={"goodput.request_id": request_id, "http.route": request.url.path})

        async def parse_body() -> GenerationRequest:  # after authentication: nothing is read before it
            body = parse(schema, await read_json(request))
            return body.to_request(header_priority=request.headers.get(PRIORITY_HEADER),
                                   header_kb=request.headers.get(KB_HEADER))

        with request_context(request_id=request_id), trace.use_span(span, end_on_exit=False):
            try:
                call = Call(parse=parse_body, authorization=request.headers.get("authorization"),
                            request_id=request_id, arrived=arrived, timeout_s=deadline_header(request.headers),
                            cache_control=request.headers.get("cache-control", ""))
                generation = await service.open(call)
            except GoodputError as err:
                service.metrics.requests.labels(route, str(err.http_status), "unspecified").inc()
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.end()
                return error_response(err, request_id)
            except BaseException:
                span.end()
                raise
        opened = generation.opened
        service.metrics.requests.labels(route, "200", priority_name(opened.priority)).inc()
        span.set_attribute("goodput.tenant", opened.tenant)
        span.set_attribute("goodput.worker", opened.worker_id)
        headers = {REQUEST_ID_HEADER: request_id, **opened.rate_limits}
        if opened.cache is not None:  # X-Goodput-Cache: hit; layer=l2; similarity=0.973
            headers[CACHE_HEADER] = opened.cache.header()
        degraded = opened.timeline.degraded if opened.timeline is not None else []
        if degraded:  # X-Goodput-Degraded: skip_rerank, fewer_chunks (the ladder's steps, in order)
            headers[DEGRADED_HEADER] = ", ".join(degraded)
        if opened.timeline is not None and opened.timeline.route is not None:  # model "auto": what it chose
            headers[ROUTE_HEADER] = opened.timeline.route.header()
        if opened.request.stream:
            events = stream_events(generation, route, span)
            if streams.enabled:  # the generation runs to its end on its own, each event numbered, for a resume
                headers[STREAM_HEADER] = request_id
                events = sse_events(streams.stream(events, api="sse", tenant=opened.tenant, stream_id=request_id,
                                                   closer=generation.aclose), request_id)
            return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        try:
            with trace.use_span(span, end_on_exit=False):
                async with generation:
                    text, end = await generation.collect()
                body = completion_body(opened, text, end, route=route, logprobs=generation.logprobs,
                                       answers=generation.answers, prompt_logprobs=generation.prompt_logprobs)
                timeline = generation.timing()  # post-processing ends here: the body is built
        except GoodputError as err:
            span.set_status(Status(StatusCode.ERROR, err.message))
            return error_response(err, request_id)
        finally:
            span.end()
        if timeline is not None:  # where the time went, per stage (milliseconds)
            headers[SERVER_TIMING_HEADER] = timeline.server_timing()
        if degraded:
            body["goodput_degraded"] = list(degraded)
        return JSONResponse(body, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions", CompletionRequest)

    install_knowledge_routes(app, service, read_json)
    install_responses_routes(app, service, read_json, responses or ResponseStore(service.settings, redis=None),
                             streams)
    install_resume_routes(app, service, streams)
    if jobs is not None:
        install_job_routes(app, service, read_json, jobs)
        install_batch_routes(app, service, read_json, BatchStore(jobs))
    return app
