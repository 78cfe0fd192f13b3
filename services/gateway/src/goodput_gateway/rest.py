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
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
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
from goodput_core.sampling import TokenLogprob

from goodput_gateway.caching import CACHE_HEADER
from goodput_gateway.encoding import dumps
from goodput_gateway.feedback import FeedbackRequest
from goodput_gateway.jobs import JOB_HEADER, JobQueue, Parked
from goodput_gateway.jobs.batch_routes import install_routes as install_batch_routes
from goodput_gateway.jobs.batches import BatchStore
from goodput_gateway.jobs.routes import install_routes as install_job_routes
from goodput_gateway.knowledge import install_routes as install_knowledge_routes
from goodput_gateway.limits import HeaderLimit, read_limited
from goodput_gateway.metering import parse_period
from goodput_gateway.metrics import StreamEnd, TextDelta
from goodput_gateway.rag import KB_HEADER
from goodput_gateway.requests import GenerationRequest
from goodput_gateway.responses import ResponseStore
from goodput_gateway.responses import install_routes as install_responses_routes
from goodput_gateway.resume import LAST_EVENT_ID, STREAM_HEADER, StreamBuffer, resume_response, sse_events
from goodput_gateway.resume import install_routes as install_resume_routes
from goodput_gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from goodput_gateway.service import Call, GatewayService, Generation, Opened
from goodput_gateway.tools import calling, named, new_call_id, tool_calls

__all__ = ["completion_body", "create_app", "error_response"]

log = logging.getLogger("goodput.gateway.rest")
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
    if isinstance(err, Parked):  # a shed P2 request parked as a job: the 429 says which
        headers[JOB_HEADER] = err.job_id
    headers.update(err.headers)  # e.g. the x-ratelimit-* values of a request refused by its quotas
    return JSONResponse(err.openai_body(), status_code=err.http_status, headers=headers)


def _sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + dumps(payload) + b"\n\n"


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
            events = _stream_events(generation, route, span)
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


def _ids(opened: Opened, route: str, response_id: str = "") -> tuple[str, str, int]:
    prefix = "chatcmpl" if route == "chat" else "cmpl"
    return f"{prefix}-{response_id or opened.request_id.removeprefix('req-') or uuid.uuid4().hex}", \
        ("chat.completion" if route == "chat" else "text_completion"), int(time.time())


def _usage(end: StreamEnd) -> dict[str, Any]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}


def _logprob(value: float) -> float:
    """A log probability JSON can carry (-inf, for a token the engine could not score, as OpenAI's -9999)."""
    return max(value, -9999.0)


def logprobs_json(tokens: Sequence[TokenLogprob], *, route: str, offset: int = 0) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice: chat's ``content`` entries (token, logprob, bytes, top_logprobs), or the
    legacy completions' parallel lists (``text_offset`` counted from ``offset`` characters into the answer).

    >>> t = TokenLogprob("Hi", -0.25, (("Hi", -0.25), ("Hey", -1.5)))
    >>> logprobs_json([t], route="chat")["content"][0]["top_logprobs"][1]
    {'token': 'Hey', 'logprob': -1.5, 'bytes': [72, 101, 121]}
    >>> logprobs_json([t, t], route="completions", offset=3)["text_offset"]
    [3, 5]
    """
    if route == "chat":
        return {"content": [{"token": t.token, "logprob": _logprob(t.logprob), "bytes": list(t.token.encode()),
                             "top_logprobs": [{"token": tok, "logprob": _logprob(lp), "bytes": list(tok.encode())}
                                              for tok, lp in t.top]} for t in tokens], "refusal": None}
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [None if math.isnan(t.logprob) else _logprob(t.logprob) for t in tokens],
            "top_logprobs": [{tok: _logprob(lp) for tok, lp in t.top} for t in tokens], "text_offset": offsets}


def _choice(opened: Opened, index: int, text: str, finish: str, logprobs: Sequence[TokenLogprob], *,
            route: str, chosen: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """One choice; ``chosen``: the calls a tool_choice auto answer made (the worker's parser read them)."""
    lp = logprobs_json(logprobs, route=route) if opened.request.sampling.logprobs is not None else None
    if route != "chat":
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": lp}
    calls = list(chosen) or tool_calls(opened.request, text)
    # a required/named answer's text is the call itself; an auto answer's is what the model said beside its calls
    message: dict[str, Any] = ({"role": "assistant", "content": (text or None) if chosen else None,
                                "tool_calls": calls} if calls
                               else {"role": "assistant", "content": text})
    return {"index": index, "message": message, "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
            "logprobs": lp}


SERVER_TIMING_HEADER = "Server-Timing"
DEGRADED_HEADER = "X-Goodput-Degraded"
ROUTE_HEADER = "X-Goodput-Route"
DEADLINE_HEADERS = ("x-goodput-deadline-ms", "request-timeout-ms")
MAX_DEADLINE_MS = 86_400_000


def deadline_header(headers: Any) -> float | None:
    """The caller's deadline in seconds from ``X-Goodput-Deadline-Ms`` or ``Request-Timeout-Ms`` (the header
    proposed for the openai SDK): milliseconds from arrival; the shorter when both are given; None when neither.

    >>> deadline_header({"request-timeout-ms": "1500"}), deadline_header({})
    (1.5, None)
    """
    found = []
    for name in DEADLINE_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not 0 < ms <= MAX_DEADLINE_MS:  # NaN fails this too
            raise InvalidArgument(f"{name} must be milliseconds, above 0 and at most {MAX_DEADLINE_MS}",
                                  param=name, code="invalid_value")
        found.append(ms / 1000)
    return min(found) if found else None


def completion_body(opened: Opened, text: str, end: StreamEnd, *, route: str, response_id: str = "",
                    logprobs: Sequence[TokenLogprob] = (),
                    answers: dict[int, tuple[list[str], list[TokenLogprob]]] | None = None,
                    prompt_logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """The OpenAI-shaped JSON answer (``chat.completion`` or ``text_completion``), with the Goodput extensions;
    ``answers`` (:attr:`Generation.answers`) gives every answer of a request for several (n), ``prompt_logprobs``
    the prompt's tokens of an echo."""
    cid, obj, created = _ids(opened, route, response_id)
    n = opened.request.sampling.n
    parts = [(text, list(logprobs), end.finish_reason)]
    if n > 1 and answers is not None:
        reasons = end.finish_reasons or (end.finish_reason,) * n
        parts = [("".join(answers.get(i, ([], []))[0]), answers.get(i, ([], []))[1],
                  reasons[i] if i < len(reasons) else "stop") for i in range(n)]
    if opened.request.sampling.echo:  # completions: the prompt first
        parts = [(opened.request.prompt + t, [*prompt_logprobs, *lp], f) for t, lp, f in parts]
    choices = [_choice(opened, i, t, f, lp, route=route, chosen=end.tool_calls if i == 0 else ())
               for i, (t, lp, f) in enumerate(parts)]
    body = {"id": cid, "object": obj, "created": created, "model": opened.model, "choices": choices,
            "usage": _usage(end), "system_fingerprint": None}
    if opened.sources:  # RAG extension: the chunks the answer was grounded on, beside `choices`
        body["sources"] = [asdict(s) for s in opened.sources]
    if opened.cache is not None:  # what the response cache did (hit, layer, similarity)
        body["goodput_cache"] = opened.cache.as_dict()
    return body


async def _stream_events(generation: Generation, route: str, span: trace.Span) -> AsyncIterator[bytes]:
    opened = generation.opened
    cid, obj, created = _ids(opened, route)
    obj = "chat.completion.chunk" if route == "chat" else "text_completion"
    model = opened.model

    asked = opened.request.sampling.logprobs is not None
    n = opened.request.sampling.n
    sent = [0] * n  # characters of each answer so far (the legacy logprobs' text_offset)

    # Tool calls stream as OpenAI's incremental tool_calls deltas: a named function's arguments as they are
    # generated; a `required` answer (one or more calls) once it is whole.
    calling_now = route == "chat" and calling(opened.request)
    function = named(opened.request) if calling_now else None
    held: list[str] = []

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False, index: int = 0,
              logprobs: Sequence[TokenLogprob] = (), calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        lp = logprobs_json(logprobs, route=route, offset=sent[index]) if asked and logprobs else None
        if route == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if calls is not None:
                delta["tool_calls"] = calls
            elif delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": lp}
        return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if route == "chat":
            first = chunk("", None, role=True)
            if opened.sources:  # RAG extension on the first chunk (the openai SDK keeps unknown fields)
                first["sources"] = [asdict(s) for s in opened.sources]
            if opened.cache is not None:
                first["goodput_cache"] = opened.cache.as_dict()
            if opened.timeline is not None and opened.timeline.degraded:
                first["goodput_degraded"] = list(opened.timeline.degraded)
            yield _sse(first)
            for i in range(1, n):  # every answer opens with its role
                yield _sse(chunk("", None, role=True, index=i))
        if function is not None:  # the call's id and name first, then its arguments as they come
            yield _sse(chunk(None, None, calls=[{"index": 0, "id": new_call_id(), "type": "function",
                                                 "function": {"name": function, "arguments": ""}}]))
        echo = opened.request.sampling.echo  # completions: the prompt first, in every answer
        async for event in generation:
            if echo and route != "chat":
                echo = False
                for i in range(n):
                    yield _sse(chunk(opened.request.prompt, None, index=i, logprobs=event.prompt_logprobs
                                     if isinstance(event, TextDelta) else ()))
                    sent[i] += len(opened.request.prompt)
            if isinstance(event, TextDelta):
                if not event.text and not event.logprobs:  # the prompt's logprobs alone: sent with the echo
                    continue
                if function is not None:
                    yield _sse(chunk(None, None, logprobs=event.logprobs, calls=[
                        {"index": 0, "function": {"arguments": event.text}}]))
                elif calling_now:
                    held.append(event.text)
                else:
                    message = chunk(event.text, None, logprobs=event.logprobs, index=event.index)
                    if opened.request.continuous_usage:  # vLLM's continuous usage stats: the usage so far
                        message["usage"] = {"prompt_tokens": event.prompt_tokens,
                                            "completion_tokens": event.completion_tokens,
                                            "total_tokens": event.prompt_tokens + event.completion_tokens}
                    yield _sse(message)
                sent[event.index] += len(event.text)
            else:
                finish = event.finish_reason
                if calling_now:
                    calls = [{"index": 0}] if function is not None else tool_calls(opened.request, "".join(held))
                    if function is None:
                        if calls:
                            for i, call in enumerate(calls):
                                yield _sse(chunk(None, None, calls=[{"index": i, **call}]))
                        else:  # not a whole call (cut by max_tokens): the text as it came
                            yield _sse(chunk("".join(held), None))
                    if calls and finish == "stop":
                        finish = "tool_calls"
                elif event.tool_calls:  # tool_choice auto: the calls the model chose, each whole, after any text
                    for i, call in enumerate(event.tool_calls):
                        yield _sse(chunk(None, None, calls=[{"index": i, **call}]))
                    if finish == "stop":
                        finish = "tool_calls"
                closing = [chunk(None if route == "chat" else "", finish)]
                closing += [chunk(None if route == "chat" else "", reason, index=i)
                            for i, reason in enumerate(event.finish_reasons[1:n], start=1)]
                if opened.request.include_usage:
                    closing.append({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                                    "usage": _usage(event)})
                timeline = generation.timing()
                if timeline is not None:  # Goodput extension, on the last chunk: where the time went
                    closing[-1]["goodput_timing"] = timeline.as_json(opened.profile)
                for message in closing:
                    yield _sse(message)
                yield b"data: [DONE]\n\n"
    except GoodputError as err:
        # Headers are sent: the error travels as an SSE event (the openai SDK raises it as an APIError).
        span.set_status(Status(StatusCode.ERROR, err.message))
        yield _sse(err.openai_body())
    finally:
        await generation.aclose()
        span.end()
