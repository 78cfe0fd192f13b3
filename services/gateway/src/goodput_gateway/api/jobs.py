"""The jobs' REST routes: ``POST /v1/jobs`` (batch work, run later at P2) and ``GET /v1/jobs/{id}`` (the caller's
tenant's jobs only; once completed, with the same OpenAI-shaped body the synchronous call would have returned)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from goodput_core.errors import InvalidArgument

from goodput_gateway.api.deps import Caller, Jobs, JsonBody, Service
from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest
from goodput_gateway.jobs.records import JOB_HEADER, ROUTES
from goodput_gateway.requests import validate
from goodput_gateway.schemas import JobRequest, parse

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/jobs")
async def create_job(caller: Caller, body: JsonBody, service: Service, jobs: Jobs) -> JSONResponse:
    submitted = parse(JobRequest, body)
    route = ROUTES.get(submitted.endpoint)
    if route is None:
        raise InvalidArgument(f"endpoint must be one of {', '.join(ROUTES)}", param="endpoint", code="invalid_value")
    try:  # the body is checked now, not when the job runs
        validate(parse(ChatCompletionRequest if route == "chat" else CompletionRequest, submitted.body)
                 .to_request(), service.settings)
    except InvalidArgument as err:
        raise InvalidArgument(err.message, param=f"body.{err.param}" if err.param else "body", code=err.code) from None
    job = await asyncio.to_thread(jobs.submit, tenant=caller.tenant, route=route, body=submitted.body,
                                  quota=caller.storage, key=caller.key_id, weight=caller.weight)
    return JSONResponse(job.public(), status_code=202, headers={JOB_HEADER: job.id})


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, caller: Caller, jobs: Jobs) -> JSONResponse:
    job = await asyncio.to_thread(jobs.get, job_id, tenant=caller.tenant)
    return JSONResponse(job.public())
