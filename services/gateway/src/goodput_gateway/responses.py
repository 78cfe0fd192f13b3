"""OpenAI's Responses API: ``POST /v1/responses`` (text or message input, ``instructions``, streaming as the typed
``response.*`` events, ``store``), ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``, and a conversation
continued with ``previous_response_id`` on **any** gateway replica: a stored response keeps its conversation (input
and output items, not its instructions, as OpenAI does) in Redis under its tenant for ``responses_ttl_s``. Stored
responses count against the tenant's storage quota (:mod:`goodput_gateway.storage`): a request to store one is
refused before it is generated when the tenant has no room left, and a response's place is reserved before it is
written and given back when it is deleted or expires.

A response runs through the same path as a chat completion (quotas, cache, RAG, admission, the worker's stream):
only its wire shape differs. Fields the gateway does not implement (tools, reasoning, ``text.format`` other than
text, ...) are refused by name.

    >>> from goodput_gateway.schemas import parse
    >>> body = parse(ResponsesRequest, {"input": "Hi", "instructions": "Be brief."})
    >>> [(m.role, m.content) for m in conversation(body, history=[])]
    [('system', 'Be brief.'), ('user', 'Hi')]
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from cachetools import TTLCache
from pydantic import Field
from redis.exceptions import RedisError

from goodput_core.errors import GoodputError, NotFound, Unavailable

from goodput_gateway.config import GatewaySettings
from goodput_gateway.encoding import dumps
from goodput_gateway.events import StreamEnd
from goodput_gateway.requests import ROLE_ALIASES, Message
from goodput_gateway.schemas import Body
from goodput_gateway.storage import DEFAULT_STORAGE, AsyncStorageLedger, StorageQuota, storage_prefix

__all__ = ["ResponseStore", "ResponsesRequest", "conversation", "error_event", "event", "message_item", "response_json",
           "turns"]


class ContentPart(Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # on output_text parts a client passes back


class InputMessage(Body):
    """A message item (what a client sends, or an output item it passes back)."""

    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(Body):
    """``POST /v1/responses``."""

    UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "auto", "none"), "parallel_tool_calls": (None, True),
                   "reasoning": (None,), "include": (None, []), "truncation": (None, "disabled"),
                   "background": (None, False), "prompt": (None,), "text": (None, {"format": {"type": "text"}}),
                   "top_logprobs": (None, 0), "service_tier": (None, "auto", "default"), "conversation": (None,),
                   "max_tool_calls": (None,), "stream_options": (None,)}
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    stream: bool | None = False
    store: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    # OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512 (stored with the response)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = None  # placement for prefix reuse, within the tenant (as on chat)
    safety_identifier: str | None = None  # the end user; logs and traces keep only a hash of it
    # Goodput extensions (with the openai SDK: extra_body={...})
    priority: str | None = None
    knowledge_base: str | None = None


def turns(body: ResponsesRequest, *, history: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation a response continues (stored) followed by its input items; its instructions are not part
    of it (a continuation gives its own, as OpenAI's do not carry over)."""
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    return [*history, *({"role": ROLE_ALIASES.get(i.role, i.role), "content": i.text()} for i in items)]


def conversation(body: ResponsesRequest, *, history: list[dict[str, str]]) -> tuple[Message, ...]:
    """The chat messages of a response: its instructions, the stored conversation it continues, then its input."""
    system = [Message(role="system", content=body.instructions)] if body.instructions else []
    return (*system, *(Message(role=t["role"], content=t["content"]) for t in turns(body, history=history)))


class ResponseStore:
    """Stored responses and their conversations: Redis (every replica) or, without one, this process (bounded)."""

    def __init__(self, settings: GatewaySettings, *, redis: aioredis.Redis | None,
                 ledger: AsyncStorageLedger | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.ledger = ledger or AsyncStorageLedger(redis, prefix=storage_prefix(settings))
        self._local: TTLCache[str, str] = TTLCache(maxsize=settings.responses.local_max, ttl=settings.responses.ttl_s)

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.settings.responses.prefix}:{tenant}:{response_id}"

    async def admit(self, tenant: str, quota: StorageQuota) -> None:
        """The tenant's quota refusal, if one more response could not be stored now (before it is generated)."""
        await self.ledger.check(tenant, "responses", quota=quota)

    async def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, str]], *,
                  quota: StorageQuota = DEFAULT_STORAGE) -> None:
        raw = json.dumps({"response": response, "conversation": conversation}, separators=(",", ":"))
        ttl = int(self.settings.responses.ttl_s)
        await self.ledger.reserve(tenant, "responses", response["id"], amount=len(raw), quota=quota,
                                  expires_at=time.time() + ttl)
        if self.redis is None:
            self._local[self._key(tenant, response["id"])] = raw
            return
        try:
            await self.redis.set(self._key(tenant, response["id"]), raw, ex=ttl)
        except (RedisError, OSError) as err:
            await self.ledger.release(tenant, "responses", response["id"])
            raise Unavailable(f"the response store is unavailable ({type(err).__name__}); the answer was not "
                              "stored", code="store_unavailable") from None

    async def get(self, tenant: str, response_id: str, *, param: str = "response_id") -> dict[str, Any]:
        key = self._key(tenant, response_id)
        try:
            raw = self._local.get(key) if self.redis is None else await self.redis.get(key)
        except (RedisError, OSError) as err:
            raise Unavailable(f"the response store is unavailable ({type(err).__name__})",
                              code="store_unavailable") from None
        if raw is None:
            raise NotFound(f"Response with id '{response_id[:128]}' not found.", param=param, code="response_not_found")
        stored: dict[str, Any] = json.loads(raw)
        return stored

    async def delete(self, tenant: str, response_id: str) -> None:
        await self.get(tenant, response_id)
        if self.redis is None:
            self._local.pop(self._key(tenant, response_id), None)
        else:
            await self.redis.delete(self._key(tenant, response_id))
        await self.ledger.release(tenant, "responses", response_id)


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" or text else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def response_json(rid: str, body: ResponsesRequest, model: str, created: int, *, status: str,
              output: list[dict[str, Any]], end: StreamEnd | None) -> dict[str, Any]:
    usage = None
    if end is not None:
        usage = {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
                 "total_tokens": end.prompt_tokens + end.completion_tokens,
                 "input_tokens_details": {"cached_tokens": end.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    incomplete = {"reason": "max_output_tokens"} if end is not None and end.finish_reason == "length" else None
    return {"id": rid, "object": "response", "created_at": created, "status": "incomplete" if incomplete else status,
            "model": model, "output": output, "instructions": body.instructions, "metadata": body.metadata or {},
            "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "store": body.store is not False, "text": {"format": {"type": "text"}},
            "error": None, "incomplete_details": incomplete, "usage": usage, "user": body.user}


def event(kind: str, seq: int, **fields: Any) -> bytes:
    data = dumps({"type": kind, "sequence_number": seq, **fields})  # one per streamed token (orjson)
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def error_event(err: GoodputError) -> bytes:
    """A resumed stream's failure as the Responses API's ``error`` event."""
    data = json.dumps({"type": "error", "code": err.code or err.grpc_code.name.lower(), "message": err.message,
                       "param": err.param}, separators=(",", ":"), ensure_ascii=False)
    return f"event: error\ndata: {data}\n\n".encode()
