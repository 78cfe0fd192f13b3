"""The feedback store against a real Redis: answers reach Redis together, a flush at a time, and every replica
takes a verdict once."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from goodput_gateway.config import GatewaySettings
from goodput_gateway.feedback import FeedbackStore, _Answer
from goodput_gateway.profile import LatencyProfile
from goodput_gateway.timing import TimingMetrics


def _store(redis: aioredis.Redis, prefix: str, **feedback: float) -> FeedbackStore:
    settings = GatewaySettings(feedback={"prefix": prefix, **feedback}, quotas={"prefix": prefix})
    return FeedbackStore(settings, redis=redis, metrics=TimingMetrics(None, LatencyProfile()))


@pytest.fixture
async def redis(redis_url: str) -> aioredis.Redis:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_answers_reach_redis_together_and_another_replica_takes_each_once(redis: aioredis.Redis,
                                                                               redis_prefix: str) -> None:
    mine, other = _store(redis, redis_prefix), _store(redis, redis_prefix)
    for i in range(50):
        mine.keep(_Answer(request_id=f"r{i}", tenant="acme", model="m", priority=1, tokens=10 + i))
    assert await redis.get(f"{redis_prefix}:acme:r0") is None  # not one write per answer: with the next flush
    assert (await mine.record("acme", "r3", "used"))["goodput_tokens_withdrawn"] == 0  # this replica knows at once
    await mine.settle()
    stored = json.loads(await redis.get(f"{redis_prefix}:acme:r7"))
    assert stored == {"request_id": "r7", "tenant": "acme", "model": "m", "priority": 1, "tokens": 17}
    assert 0 < await redis.ttl(f"{redis_prefix}:acme:r7") <= 86_400
    # another replica: judged there once, and a tenant sees only its own answers
    assert (await other.record("acme", "r7", "discarded"))["goodput_tokens_withdrawn"] == 17
    assert (await other.record("acme", "r7", "discarded"))["goodput_tokens_withdrawn"] == 0
    with pytest.raises(Exception, match="no answer"):
        await other.record("globex", "r7", "discarded")


async def test_a_verdict_before_the_flush_is_what_the_other_replicas_see(redis: aioredis.Redis,
                                                                        redis_prefix: str) -> None:
    mine, other = _store(redis, redis_prefix, flush_s=0.2), _store(redis, redis_prefix)
    mine.keep(_Answer(request_id="r1", tenant="acme", model="m", priority=1, tokens=30))
    assert (await mine.record("acme", "r1", "regenerated"))["goodput_tokens_withdrawn"] == 30
    await mine.settle()
    assert (await other.record("acme", "r1", "discarded"))["goodput_tokens_withdrawn"] == 0  # taken already


async def test_answers_kept_while_a_flush_writes_go_with_the_next(redis: aioredis.Redis, redis_prefix: str) -> None:
    store = _store(redis, redis_prefix, flush_s=0.01)
    store.keep(_Answer(request_id="a", tenant="t", model="m", priority=1, tokens=1))
    await asyncio.sleep(0.011)  # the first flush is on its way
    store.keep(_Answer(request_id="b", tenant="t", model="m", priority=1, tokens=2))
    await store.settle()
    assert await redis.exists(f"{redis_prefix}:t:a", f"{redis_prefix}:t:b") == 2


@pytest.mark.parametrize("answer_id", ["chatcmpl-5e0c2a", "cmpl-5e0c2a", "resp_5e0c2a", "req-5e0c2a"])
async def test_an_answer_is_named_by_the_id_the_sdk_returns(redis: aioredis.Redis, redis_prefix: str,
                                                           answer_id: str) -> None:
    mine, other = _store(redis, redis_prefix), _store(redis, redis_prefix)
    mine.keep(_Answer(request_id="req-5e0c2a", tenant="acme", model="m", priority=1, tokens=9))
    await mine.settle()
    for store in (other, mine):  # from Redis on another replica, then taken here
        with pytest.raises(Exception, match="no answer"):
            await store.record("globex", answer_id, "discarded")  # never another tenant's
    result = await other.record("acme", answer_id, "discarded")
    assert result["request_id"] == answer_id and result["goodput_tokens_withdrawn"] == 9
    with pytest.raises(Exception, match="no answer"):
        await other.record("acme", "chatcmpl-unknown", "used")
