"""OpenAI's Responses API over the gateway's one request path: ``POST /v1/responses`` (whole or streamed as its
typed events, continued from ``previous_response_id``), ``GET`` (or resume a streamed one) and ``DELETE
/v1/responses/{id}``. A streamed response is resumable (goodput_gateway.resume): its stream id is the response's
id, and its events' numbers are their ``sequence_number``s. The conversation and shapes are
:mod:`goodput_gateway.responses`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from itertools import count
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from goodput_core.context import new_request_id
from goodput_core.errors import GoodputError
from goodput_core.priority import parse_priority

from goodput_gateway.api.deps import Caller, Responses, Service, Streams, read_json
from goodput_gateway.api.respond import Shape, respond
from goodput_gateway.api.streams import resume_response
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.generation import Call, Generation, Opened
from goodput_gateway.requests import GenerationRequest, Sampling
from goodput_gateway.responses import (
    ResponsesRequest,
    ResponseStore,
    conversation,
    error_event,
    event,
    message_item,
    response_json,
    turns,
)
from goodput_gateway.resume import LAST_EVENT_ID
from goodput_gateway.schemas import parse
from goodput_gateway.storage import StorageQuota
from goodput_gateway.wire import deadline_header

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/responses", name="responses")
async def create(request: Request, caller: Caller, service: Service, store: Responses, streams: Streams) -> Response:
    if streams.enabled and request.headers.get(LAST_EVENT_ID):  # an SSE client reconnecting: the rest, not anew
        return await resume_response(caller, streams, request, error=error_event)
    arrived, request_id = time.monotonic(), new_request_id()
    body = parse(ResponsesRequest, await read_json(request, service))
    if body.store is not False:  # refused now, not after its tokens are spent
        await store.admit(caller.tenant, caller.storage)
    history: list[dict[str, str]] = []
    if body.previous_response_id:
        history = (await store.get(caller.tenant, body.previous_response_id,
                                   param="previous_response_id"))["conversation"]
    priority = body.priority or request.headers.get("x-goodput-priority")
    req = GenerationRequest(
        model=body.model or "", messages=conversation(body, history=history), kind="chat", stream=bool(body.stream),
        sampling=Sampling(max_tokens=body.max_output_tokens or 0, temperature=body.temperature, top_p=body.top_p),
        priority=parse_priority(priority) if priority else 0, session_id=body.user or "",
        cache_key=body.prompt_cache_key or "", safety_identifier=body.safety_identifier or "",
        knowledge_base=(body.knowledge_base or request.headers.get("x-goodput-knowledge-base", "")).strip())

    async def parsed() -> GenerationRequest:
        return req

    call = Call(parse=parsed, principal=caller, request_id=request_id, arrived=arrived,
                timeout_s=deadline_header(request.headers), cache_control=request.headers.get("cache-control", ""))
    answer = _Answer(body, store, caller.tenant, quota=caller.storage, so_far=turns(body, history=history),
                     rid=f"resp_{request_id.removeprefix('req-')}")  # it names its request, as chatcmpl-… does
    return await respond(request, call, Shape(answer.whole, answer.events, lambda _: answer.rid, error_event),
                         route="responses", service=service, streams=streams)


class _Answer:
    """One response as the Responses API writes it: whole, or as its typed events; stored for a continuation."""

    def __init__(self, body: ResponsesRequest, store: ResponseStore, tenant: str, *, quota: StorageQuota,
                 so_far: list[dict[str, str]], rid: str) -> None:
        self.body, self.store, self.tenant, self.so_far, self.rid = body, store, tenant, so_far, rid
        self.quota = quota
        self.item_id, self.created = f"msg_{uuid.uuid4().hex}", int(time.time())

    async def finished(self, opened: Opened, text: str, end: StreamEnd) -> dict[str, Any]:
        response = response_json(self.rid, self.body, opened.model, self.created, status="completed",
                                 output=[message_item(self.item_id, text, "completed")], end=end)
        if self.body.store is not False:
            await self.store.put(self.tenant, response, [*self.so_far, {"role": "assistant", "content": text}],
                                 quota=self.quota)
        return response

    async def whole(self, generation: Generation) -> dict[str, Any]:
        text, end = await generation.collect()
        return await self.finished(generation.opened, text, end)

    async def events(self, generation: Generation, span: trace.Span) -> AsyncIterator[bytes]:
        numbers, item_id, opened = count(), self.item_id, generation.opened
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}  # the one text part of the one message

        def ev(kind: str, **fields: Any) -> bytes:
            return event(kind, next(numbers), **fields)

        start = response_json(self.rid, self.body, opened.model, self.created, status="in_progress", output=[],
                              end=None)
        parts: list[str] = []
        try:
            yield ev("response.created", response=start)
            yield ev("response.in_progress", response=start)
            yield ev("response.output_item.added", output_index=0, item=message_item(item_id, "", "in_progress"))
            yield ev("response.content_part.added", **at, part={"type": "output_text", "text": "", "annotations": []})
            async for delta in generation:
                if isinstance(delta, TextDelta):
                    if delta.text:
                        parts.append(delta.text)
                        yield ev("response.output_text.delta", **at, delta=delta.text, logprobs=[])
                    continue
                text = "".join(parts)
                yield ev("response.output_text.done", **at, text=text, logprobs=[])
                yield ev("response.content_part.done", **at,
                         part={"type": "output_text", "text": text, "annotations": []})
                yield ev("response.output_item.done", output_index=0, item=message_item(item_id, text, "completed"))
                response = await self.finished(opened, text, delta)
                yield ev("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                         response=response)
        except GoodputError as err:  # headers are sent: the failure travels as events
            error = {"code": err.code or err.grpc_code.name.lower(), "message": err.message}
            yield ev("error", code=error["code"], message=err.message, param=err.param)
            yield ev("response.failed", response={**start, "status": "failed", "error": error})
        finally:
            await generation.aclose()


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, caller: Caller, store: Responses, streams: Streams,
                   stream: str | None = None, starting_after: str | None = None) -> Response:
    if stream == "true":  # OpenAI's resume of a streamed response: its events after `starting_after`
        return await resume_response(caller, streams, request, stream_id=response_id, after=starting_after,
                                     error=error_event)
    return JSONResponse((await store.get(caller.tenant, response_id))["response"])


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, caller: Caller, store: Responses) -> JSONResponse:
    await store.delete(caller.tenant, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
