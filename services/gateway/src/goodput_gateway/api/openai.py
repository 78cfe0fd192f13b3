"""OpenAI's own routes: ``/v1/chat/completions`` and ``/v1/completions`` (whole, or streamed as server-sent chunks),
``/v1/models``; with Goodput's ``/v1/feedback`` (what became of an answer) and ``/v1/usage`` (the tenant's metered
usage, :mod:`goodput_gateway.metering`).

Goodput extensions: the ``priority`` body field or ``X-Goodput-Priority`` header ("P0", "P1", "P2"); RAG with the
``knowledge_base`` body field or ``X-Goodput-Knowledge-Base`` header (the answer then carries ``sources`` beside
``choices``, or on the first chunk of a stream). Every generation response carries OpenAI's ``x-ratelimit-*``
headers for the caller's limits (:mod:`goodput_gateway.quotas`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from goodput_core.context import new_request_id
from goodput_core.errors import NotFound, PermissionDenied, Unavailable

from goodput_gateway.api.deps import Caller, JsonBody, Service, Streams, read_json
from goodput_gateway.api.respond import Shape, respond
from goodput_gateway.api.streams import resume_response
from goodput_gateway.feedback import FeedbackRequest
from goodput_gateway.generation import Call, Generation
from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest
from goodput_gateway.metering import parse_period
from goodput_gateway.rag import KB_HEADER
from goodput_gateway.requests import GenerationRequest
from goodput_gateway.resume import LAST_EVENT_ID
from goodput_gateway.schemas import parse
from goodput_gateway.service import GatewayService
from goodput_gateway.wire import completion_body, deadline_header, stream_events

__all__ = ["router"]

PRIORITY_HEADER = "x-goodput-priority"
router = APIRouter()


@router.post("/v1/chat/completions", name="chat")
async def chat_completions(request: Request, caller: Caller, service: Service, streams: Streams) -> Response:
    return await _generate(request, caller, service, streams, "chat", ChatCompletionRequest)


@router.post("/v1/completions", name="completions")
async def completions(request: Request, caller: Caller, service: Service, streams: Streams) -> Response:
    return await _generate(request, caller, service, streams, "completions", CompletionRequest)


async def _generate(request: Request, caller: Caller, service: GatewayService, streams: Streams, route: str,
                    schema: type[ChatCompletionRequest | CompletionRequest]) -> Response:
    if streams.enabled and request.headers.get(LAST_EVENT_ID):  # an SSE client reconnecting: the rest, not anew
        return await resume_response(caller, streams, request)
    arrived, request_id = time.monotonic(), new_request_id()

    async def parse_body() -> GenerationRequest:
        body = parse(schema, await read_json(request, service))
        return body.to_request(header_priority=request.headers.get(PRIORITY_HEADER),
                               header_kb=request.headers.get(KB_HEADER))

    async def whole(generation: Generation) -> dict[str, Any]:
        text, end = await generation.collect()
        return completion_body(generation.opened, text, end, route=route, logprobs=generation.logprobs,
                               answers=generation.answers, prompt_logprobs=generation.prompt_logprobs)

    call = Call(parse=parse_body, principal=caller, request_id=request_id, arrived=arrived,
                timeout_s=deadline_header(request.headers), cache_control=request.headers.get("cache-control", ""))
    shape = Shape(whole, lambda generation, span: stream_events(generation, route, span), lambda o: o.request_id)
    return await respond(request, call, shape, route=route, service=service, streams=streams)


async def _served_models(service: GatewayService) -> list[dict[str, Any]]:
    """The generation models of healthy workers, then the embedding model (when an embedder answers)."""
    data: list[dict[str, Any]] = [
        {"id": m.id, "object": "model", "created": 0, "owned_by": "goodput", "max_model_len": m.max_model_len,
         **({"aliases": list(m.aliases)} if m.aliases else {})}
        for m in await service.pipeline.catalogue.models()]
    embedding = await service.knowledge.embedding_model() if service.knowledge is not None else None
    if embedding is not None:
        data.append({"id": embedding[0], "object": "model", "created": 0, "owned_by": "goodput",
                     "dimensions": embedding[1]})
    return data


@router.get("/v1/models")
async def list_models(_: Caller, service: Service) -> JSONResponse:
    return JSONResponse({"object": "list", "data": await _served_models(service)})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, _: Caller, service: Service) -> JSONResponse:
    for model in await _served_models(service):
        if model["id"] == model_id or model_id in model.get("aliases", ()):
            return JSONResponse(model)
    raise NotFound(f"The model '{model_id[:128]}' does not exist", param="model", code="model_not_found")


@router.post("/v1/feedback")
async def feedback(caller: Caller, raw: JsonBody, service: Service) -> JSONResponse:
    """What became of an answer (used, discarded, regenerated): a discarded one is no goodput after all."""
    body = parse(FeedbackRequest, raw)
    if service.feedback is None:
        raise Unavailable("feedback is not taken by this gateway", code="feedback_disabled")
    return JSONResponse(await service.feedback.record(caller.tenant, body.request_id, body.verdict))


@router.get("/v1/usage")
async def usage(caller: Caller, service: Service, period: str | None = None, tenant: str | None = None) -> JSONResponse:
    """The caller's tenant's usage in a month (default: this one) or a day, by model; an operator key may name any
    tenant, or ``*`` for all of them."""
    when = parse_period(period)
    if tenant and tenant != caller.tenant and not caller.operator:
        raise PermissionDenied("only an operator key may read another tenant's usage", param="tenant")
    meter = service.meter
    names = await meter.tenants(when) if tenant == "*" else [tenant or caller.tenant]
    data = [{"tenant": name, "model": model, **counts}
            for name in names for model, counts in (await meter.usage(name, when)).items()]
    body: dict[str, Any] = {"object": "list", "period": when, "data": data}
    if not tenant or tenant == caller.tenant:
        body["tenant"] = caller.tenant
        body["limits"] = asdict(caller.tenant_quota)
    return JSONResponse(body)
