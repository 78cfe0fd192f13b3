"""What the gateway's REST routes share, as FastAPI dependencies: the service, the caller authenticated once per
request (before any of its body is read), the JSON body read under its limits after that, and the stores the routes
keep their state in (on ``app.state``, set by :func:`goodput_gateway.api.create_app`).

Example (a route)::

    @router.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, caller: Caller, jobs: Jobs) -> JSONResponse:
        ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from goodput_gateway.auth import Principal
from goodput_gateway.jobs import JobQueue
from goodput_gateway.jobs.batches import BatchStore
from goodput_gateway.limits import load_json, read_limited
from goodput_gateway.responses import ResponseStore
from goodput_gateway.resume import StreamBuffer
from goodput_gateway.service import GatewayService

__all__ = ["Batches", "Caller", "JsonBody", "Jobs", "Responses", "Service", "Streams", "read_json"]


def _state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency giving what :func:`goodput_gateway.api.create_app` put on ``app.state`` as ``name``."""
    async def get(request: Request) -> Any:
        return getattr(request.app.state, name)
    return get


Service = Annotated[GatewayService, Depends(_state("service"))]


async def _caller(request: Request, service: Service) -> Principal:
    return service.authenticate(request.headers.get("authorization"))


Caller = Annotated[Principal, Depends(_caller)]


async def read_json(request: Request, service: GatewayService) -> Any:
    """The body as JSON, read in pieces: 413 as soon as it passes max_body_bytes (a declared Content-Length above it
    is refused before any of it is read), then 400 unless it is JSON a request can be made of (:func:`load_json`).
    Called only once the caller is authenticated (:data:`JsonBody`)."""
    raw = await read_limited(request.stream(), limit=service.settings.limits.body_bytes,
                             declared=request.headers.get("content-length"))
    return load_json(raw, max_depth=service.settings.limits.json_depth)


async def _json_body(request: Request, service: Service, _: Caller) -> Any:
    return await read_json(request, service)


JsonBody = Annotated[Any, Depends(_json_body)]
Streams = Annotated[StreamBuffer, Depends(_state("streams"))]
Responses = Annotated[ResponseStore, Depends(_state("responses"))]
Jobs = Annotated[JobQueue, Depends(_state("jobs"))]
Batches = Annotated[BatchStore, Depends(_state("batches"))]
