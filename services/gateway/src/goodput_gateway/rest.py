"""OpenAI-compatible REST API: `/v1/chat/completions`, `/v1/completions` (streaming SSE and not), `/v1/models`,
plus `/healthz` and `/metrics`. Errors use OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`).

Goodput extensions: the `priority` body field or `X-Goodput-Priority` header ("P0", "P1", "P2"); RAG with the
`knowledge_base` body field or `X-Goodput-Knowledge-Base` header (the answer then carries `sources` beside
`choices`, or on the first chunk of a stream); the knowledge routes of :mod:`goodput_gateway.knowledge`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from goodput_core.context import REQUEST_ID_HEADER, new_request_id, request_context
from goodput_core.errors import GoodputError, InvalidArgument
from goodput_core.metrics import metrics_response
from goodput_core.priority import priority_name

from goodput_gateway.caching import CACHE_HEADER
from goodput_gateway.jobs import JobQueue, park_if_shed
from goodput_gateway.jobs import install_routes as install_job_routes
from goodput_gateway.knowledge import install_routes as install_knowledge_routes
from goodput_gateway.pipeline import GenerationStream, StreamEnd, TextDelta
from goodput_gateway.rag import KB_HEADER, knowledge_base_from
from goodput_gateway.requests import GenerationRequest, from_openai_chat, from_openai_completion
from goodput_gateway.service import GatewayService

PRIORITY_HEADER = "x-goodput-priority"
SSE_HEADERS = {
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",  # nginx and compatible proxies: do not buffer the event stream
    "Connection": "keep-alive",
}


def error_response(err: GoodputError, request_id: str | None = None) -> JSONResponse:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(int(err.retry_after_s + 0.999), 1))
    return JSONResponse(err.openai_body(), status_code=err.http_status, headers=headers)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def create_app(service: GatewayService, *, registry: CollectorRegistry, tracer: trace.Tracer,
               ready: Callable[[], bool], jobs: JobQueue | None = None) -> FastAPI:
    app = FastAPI(title="Goodput gateway", version="v1", docs_url=None, redoc_url=None)
    app.state.goodput_service = service  # for in-process tests and debugging

    @app.exception_handler(GoodputError)
    async def _goodput_error(request: Request, err: GoodputError) -> JSONResponse:
        return error_response(err, request.headers.get(REQUEST_ID_HEADER))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = {"error": {"message": str(err.detail), "type": "invalid_request_error", "param": None,
                          "code": "not_found" if err.status_code == 404 else "http_error"}}
        return JSONResponse(body, status_code=err.status_code)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(registry)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        service.authenticate(request.headers.get("authorization"))
        models = await service.pipeline.models()
        return JSONResponse({"object": "list", "data": [
            {"id": m.id, "object": "model", "created": 0, "owned_by": "goodput", "max_model_len": m.max_model_len}
            for m in models]})

    async def read_json(request: Request) -> Any:
        limit = service.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise InvalidArgument(f"request body is larger than {limit} bytes", code="request_too_large")
        raw = await request.body()
        if len(raw) > limit:
            raise InvalidArgument(f"request body is larger than {limit} bytes", code="request_too_large")
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

    async def handle(request: Request, route: str,
                     parse: Callable[..., GenerationRequest]) -> Response:
        arrived = time.monotonic()
        request_id = new_request_id()
        span = tracer.start_span(f"POST {request.url.path}", kind=SpanKind.SERVER,
                                 attributes={"goodput.request_id": request_id, "http.route": request.url.path})
        prio_label = "unspecified"
        with request_context(request_id=request_id), trace.use_span(span, end_on_exit=False):
            try:
                principal = service.authenticate(request.headers.get("authorization"))
                span.set_attribute("goodput.tenant", principal.tenant)
                body = await read_json(request)
                gen = parse(body, header_priority=request.headers.get(PRIORITY_HEADER))
                kb = knowledge_base_from(body, request.headers.get(KB_HEADER))
                stream = await service.begin(principal, gen, request_id=request_id, arrived=arrived,
                                             knowledge_base=kb,
                                             cache_control=request.headers.get("cache-control", ""))
                prio_label = priority_name(stream.priority)
            except GoodputError as err:
                service.metrics.requests.labels(route, str(err.http_status), prio_label).inc()
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.end()
                if jobs is not None:  # a shed P2 request is parked as a job, and the 429 says which
                    return await park_if_shed(jobs, service, err, request, route, error_response, request_id)
                return error_response(err, request_id)
            except BaseException:
                span.end()
                raise
        service.metrics.requests.labels(route, "200", prio_label).inc()
        span.set_attribute("goodput.worker", stream.start.worker_id if stream.start else "")
        headers = {REQUEST_ID_HEADER: request_id}
        if stream.cache is not None:  # X-Goodput-Cache: hit; layer=l2; similarity=0.973
            headers[CACHE_HEADER] = stream.cache.header()
        if gen.stream:
            return StreamingResponse(_stream_events(stream, gen, route, span), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        try:
            with trace.use_span(span, end_on_exit=False):
                body = await _collect(stream, gen, route)
        except GoodputError as err:
            span.set_status(Status(StatusCode.ERROR, err.message))
            return error_response(err, request_id)
        finally:
            span.end()
        return JSONResponse(body, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", from_openai_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions", from_openai_completion)

    install_knowledge_routes(app, service, read_json)
    if jobs is not None:
        install_job_routes(app, service, read_json, jobs)
    return app


def _ids(stream: GenerationStream, route: str) -> tuple[str, str, int]:
    prefix = "chatcmpl" if route == "chat" else "cmpl"
    return f"{prefix}-{stream.request_id.removeprefix('req-') or uuid.uuid4().hex}", \
        ("chat.completion" if route == "chat" else "text_completion"), int(time.time())


def _usage(end: StreamEnd) -> dict[str, int]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens}


async def _collect(stream: GenerationStream, gen: GenerationRequest, route: str) -> dict[str, Any]:
    text, end = await stream.collect()
    cid, obj, created = _ids(stream, route)
    choice: dict[str, Any]
    if route == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": end.finish_reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": end.finish_reason, "logprobs": None}
    model = stream.start.model if stream.start else gen.model
    body = {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(end), "system_fingerprint": None}
    if stream.sources:  # RAG extension: the chunks the answer was grounded on, beside `choices`
        body["sources"] = [asdict(s) for s in stream.sources]
    if stream.cache is not None:  # what the response cache did (hit, layer, similarity)
        body["goodput_cache"] = stream.cache.as_dict()
    return body


async def _stream_events(stream: GenerationStream, gen: GenerationRequest, route: str,
                         span: trace.Span) -> AsyncIterator[bytes]:
    cid, obj, created = _ids(stream, route)
    obj = "chat.completion.chunk" if route == "chat" else "text_completion"
    model = stream.start.model if stream.start else gen.model

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False) -> dict[str, Any]:
        if route == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if route == "chat":
            first = chunk("", None, role=True)
            if stream.sources:  # RAG extension on the first chunk (the openai SDK keeps unknown fields)
                first["sources"] = [asdict(s) for s in stream.sources]
            if stream.cache is not None:
                first["goodput_cache"] = stream.cache.as_dict()
            yield _sse(first)
        async for event in stream:
            if isinstance(event, TextDelta):
                yield _sse(chunk(event.text, None))
            else:
                yield _sse(chunk(None if route == "chat" else "", event.finish_reason))
                if gen.include_usage:
                    yield _sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": _usage(event)})
                yield b"data: [DONE]\n\n"
    except GoodputError as err:
        # Headers are sent: the error travels as an SSE event (the openai SDK raises it as an APIError).
        span.set_status(Status(StatusCode.ERROR, err.message))
        yield _sse(err.openai_body())
    finally:
        await stream.aclose()
        span.end()
