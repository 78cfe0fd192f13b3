"""The jobs' REST routes: ``POST /v1/jobs`` (batch work, run later at P2) and ``GET /v1/jobs/{id}`` (the caller's
tenant's jobs only; once completed, with the same OpenAI-shaped body the synchronous call would have returned).

Example (wiring the gateway's REST app, :mod:`goodput_gateway.rest`)::

    install_routes(app, service, read_json, queue)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from goodput_core.errors import InvalidArgument

from goodput_gateway.jobs.store import JOB_HEADER, ROUTES, JobQueue
from goodput_gateway.requests import validate
from goodput_gateway.schemas import ChatCompletionRequest, CompletionRequest, JobRequest, parse

__all__ = ["install_routes"]


def install_routes(app: FastAPI, service: Any, read_json: Callable[[Request], Awaitable[Any]],
                   queue: JobQueue) -> None:
    """Adds ``POST /v1/jobs`` and ``GET /v1/jobs/{id}`` to the gateway's REST app."""

    @app.post("/v1/jobs")
    async def create_job(request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        submitted = parse(JobRequest, await read_json(request))
        route = ROUTES.get(submitted.endpoint)
        if route is None:
            raise InvalidArgument(f"endpoint must be one of {', '.join(ROUTES)}", param="endpoint",
                                  code="invalid_value")
        try:  # the body is checked now, not when the job runs
            validate(parse(ChatCompletionRequest if route == "chat" else CompletionRequest, submitted.body)
                     .to_request(), service.settings)
        except InvalidArgument as err:
            raise InvalidArgument(err.message, param=f"body.{err.param}" if err.param else "body",
                                  code=err.code) from None
        job = await asyncio.to_thread(queue.submit, tenant=principal.tenant, route=route, body=submitted.body)
        return JSONResponse(job.public(), status_code=202, headers={JOB_HEADER: job.id})

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        job = await asyncio.to_thread(queue.get, job_id, tenant=principal.tenant)
        return JSONResponse(job.public())
