"""The Responses API's store: a tenant's responses in Redis, or in this process without one; a store that is
down is a clear 503, never a 500."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from goodput_core.errors import NotFound, Unavailable
from goodput_testing import dead_port

from goodput_gateway.config import GatewaySettings
from goodput_gateway.responses import ResponsesRequest, ResponseStore, conversation, turns
from goodput_gateway.schemas import parse


@pytest.mark.asyncio
@pytest.mark.parametrize("url", ["redis", ""])
async def test_a_stored_response_is_its_tenants_alone(url: str, redis_url: str, redis_prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url) if url else None
    store = ResponseStore(GatewaySettings(responses={"prefix": redis_prefix}, quotas={"prefix": redis_prefix}),
                          redis=client)
    await store.put("acme", {"id": "resp_1", "object": "response"}, [{"role": "user", "content": "hi"}])
    assert (await store.get("acme", "resp_1"))["conversation"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(NotFound):
        await store.get("globex", "resp_1")
    await store.delete("acme", "resp_1")
    with pytest.raises(NotFound):
        await store.get("acme", "resp_1")
    if client is not None:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_store_that_is_down_is_unavailable_not_a_crash() -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0", socket_connect_timeout=0.5)
    store = ResponseStore(GatewaySettings(), redis=client)
    with pytest.raises(Unavailable):
        await store.put("acme", {"id": "resp_1"}, [])
    with pytest.raises(Unavailable):
        await store.get("acme", "resp_1")
    await client.aclose()


def test_a_continuation_gets_the_conversation_not_the_earlier_instructions() -> None:
    body = parse(ResponsesRequest, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "And?"}]}],
                                    "instructions": "Be brief.", "previous_response_id": "resp_1"})
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert [m.role for m in conversation(body, history=history)] == ["system", "user", "assistant", "user"]
    assert turns(body, history=history)[-1] == {"role": "user", "content": "And?"}
    assert all(t["role"] != "system" for t in turns(body, history=history))
