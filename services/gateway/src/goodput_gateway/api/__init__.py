"""The gateway's REST API: OpenAI's routes and Goodput's, each an ``APIRouter`` whose routes take what they need as
FastAPI dependencies (:mod:`.deps`: the caller, authenticated once per request; the body; the stores), every
generation answered by one :func:`.respond.respond`, and errors in OpenAI's JSON shape
(``{"error": {"message", "type", "param", "code"}}``).

Example (the gateway's servers, :func:`goodput_gateway.__main__.build`)::

    app = create_app(service, tracer=tracer, ready=lambda: runner.ready, jobs_queue=jobs)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry import trace
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from goodput_core.context import REQUEST_ID_HEADER
from goodput_core.errors import GoodputError, Unavailable

from goodput_gateway.api import batches, jobs, knowledge, openai, responses, streams
from goodput_gateway.jobs import JobQueue
from goodput_gateway.jobs.batches import BatchStore
from goodput_gateway.limits import HeaderLimit
from goodput_gateway.responses import ResponseStore
from goodput_gateway.resume import StreamBuffer
from goodput_gateway.service import GatewayService
from goodput_gateway.wire import error_response

__all__ = ["create_app"]

log = logging.getLogger("goodput.gateway.rest")
GENERATION_ROUTES = ("chat", "completions", "responses")  # routes whose requests goodput_gateway_requests counts


def create_app(service: GatewayService, *, tracer: trace.Tracer,
               ready: Callable[[], bool], jobs_queue: JobQueue | None = None,
               responses_store: ResponseStore | None = None,
               stream_buffer: StreamBuffer | None = None) -> FastAPI:
    """The public REST app, never with `/metrics` (served on the gateway's metrics port, which callers cannot
    reach: its tenant and key counts are not theirs to read); ``responses_store`` keeps the Responses API's
    responses (default: in this process); ``stream_buffer`` records streamed answers for resume (default: in this
    process, on with RESUME__WINDOW_S); with ``jobs_queue``, the jobs and OpenAI's Files and Batch APIs."""
    app = FastAPI(title="Goodput gateway", version="v1", docs_url=None, redoc_url=None)
    app.add_middleware(HeaderLimit, max_bytes=service.settings.limits.header_bytes)
    app.state.service, app.state.tracer = service, tracer
    app.state.streams = stream_buffer or StreamBuffer(service.settings, redis=None)
    app.state.responses = responses_store or ResponseStore(service.settings, redis=None)
    for router in (openai.router, responses.router, streams.router, knowledge.router):
        app.include_router(router)
    if jobs_queue is not None:
        app.state.jobs, app.state.batches = jobs_queue, BatchStore(jobs_queue)
        app.include_router(jobs.router)
        app.include_router(batches.router)

    @app.exception_handler(GoodputError)
    async def _goodput_error(request: Request, err: GoodputError) -> JSONResponse:
        route = request.scope.get("route")
        if getattr(route, "name", "") in GENERATION_ROUTES:  # a refused generation, whichever step refused it
            service.metrics.requests.labels(route.name, str(err.http_status), "unspecified").inc()  # type: ignore[union-attr]
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
    return app
