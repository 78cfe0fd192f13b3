"""Metered usage against a real Redis: every flush is counted once, also when Redis applied it but its reply was
lost and the replica sends it again; what failed to be written is not lost; the flush ids do not pile up."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import TimeoutError as RedisTimeout

from goodput_gateway.config import GatewaySettings
from goodput_gateway.metering import Meter, Usage

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


def meter(client: aioredis.Redis, prefix: str) -> Meter:
    return Meter(GatewaySettings(metering={"usage_prefix": f"{prefix}:usage"}), redis=client,
                 registry=CollectorRegistry())


def month() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m")


class LostReply:
    """The flush script as Redis runs it, whose reply then never arrives (the client's socket timed out after Redis
    applied it): what a replica sees of a slow or partitioned Redis."""

    def __init__(self, script: Any, times: int) -> None:
        self.script, self.times = script, times

    async def __call__(self, **kwargs: Any) -> Any:
        result = await self.script(**kwargs)
        if self.times:
            self.times -= 1
            raise RedisTimeout("Timeout reading from socket")
        return result


async def test_a_flush_whose_reply_was_lost_is_counted_once(client: aioredis.Redis, redis_prefix: str) -> None:
    m = meter(client, redis_prefix)
    real = m._script
    m._script = LostReply(real, times=2)  # type: ignore[assignment]
    m.record("acme", "smollm2", Usage(requests=1, prompt_tokens=120, completion_tokens=40, gpu_seconds=0.5))
    assert not await m.flush()  # applied, but the replica cannot know: it keeps the counts
    m.record("acme", "smollm2", Usage(requests=1, prompt_tokens=10, completion_tokens=5))  # meanwhile
    assert not await m.flush()  # the same flush again, applied again by nobody; its reply lost too
    assert await m.flush()  # its reply came: then what came meanwhile, under a flush of its own
    used = (await m.usage("acme", month()))["smollm2"]
    assert (used["requests"], used["prompt_tokens"], used["completion_tokens"]) == (2, 130, 45)
    assert used["gpu_seconds"] == pytest.approx(0.5)
    assert await m.tenants(month()) == ["acme"]
    assert m.metrics.flush_errors._value.get() == 2


async def test_usage_that_could_not_be_written_is_written_later(client: aioredis.Redis, redis_prefix: str) -> None:
    m = meter(client, redis_prefix)
    real = m._script

    async def down(**kwargs: Any) -> Any:
        raise ConnectionError("Redis is down")

    m._script = down  # type: ignore[assignment]
    m.record("acme", "smollm2", Usage(requests=3, completion_tokens=30))
    assert not await m.flush()
    m._script = real
    await m.stop()  # a clean stop writes what is pending
    assert (await m.usage("acme", month()))["smollm2"]["completion_tokens"] == 30


async def test_flush_ids_do_not_pile_up(client: aioredis.Redis, redis_prefix: str) -> None:
    # Each flush's id is deleted by the replica's next one: at most one per replica is kept (a day, if it died).
    m = meter(client, redis_prefix)
    for i in range(20):
        m.record(f"t{i % 3}", "smollm2", Usage(requests=1))
        assert await m.flush()
    ids = [key async for key in client.scan_iter(f"{redis_prefix}:usage:flush:*")]
    assert len(ids) == 1 and 0 < await client.ttl(ids[0]) <= 86_400
    assert sum([(await m.usage(f"t{i}", month()))["smollm2"]["requests"] for i in range(3)]) == 20
