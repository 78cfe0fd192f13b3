"""A tenant's monthly budget holds against a burst, through two gateway replicas: admission reserves what each
request may use (its prompt and ``max_tokens`` for each of its ``n`` answers) in the shared counters, so the month
is passed by at most one request's reservation however many arrive at once.

Real processes: an inference worker on the simulated engine and the scheduler; two gateways in this process on one
Redis (their quota counters and usage)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from goodput_testing import SimBackend, async_wait_until, free_port, sim_backend

from goodput_gateway.__main__ import build
from goodput_gateway.config import GatewaySettings
from goodput_gateway.quotas import month_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BUDGET, MAX_TOKENS = 2000, 300
KEYS = json.dumps({"tenants": {"acme": {"monthly_tokens": BUDGET}, "globex": {"tpm": 1000}},
                   "keys": [{"key": "k-acme", "tenant": "acme", "max_priority": "P0"},
                            {"key": "k-globex", "tenant": "globex", "max_priority": "P0"}]})


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimBackend]:
    with sim_backend(tmp_path_factory.mktemp("budget-logs")) as running:
        yield running


@pytest.fixture
async def replicas(backend: SimBackend, redis_url: str, redis_prefix: str) -> AsyncIterator[list[str]]:
    """Two gateway replicas on one Redis; their base URLs."""
    runners, urls = [], []
    for _ in range(2):
        settings = GatewaySettings(**{  # type: ignore[arg-type]
            "api_keys": KEYS, "scheduler_addr": backend.scheduler_addr, "http_port": free_port(),
            "grpc_port": free_port(), "models_cache_s": 0.0, "drain_grace_s": 0.5, "quota_redis_url": redis_url,
            # a generous Redis timeout: 24 requests' first admissions at once on a busy machine must not be taken
            # for an unreachable Redis (the local bound of fail-open is not what this test is about)
            "quotas": {"prefix": f"{redis_prefix}:quota", "timeout_s": 5.0},
            "metering": {"usage_prefix": f"{redis_prefix}:usage"}})
        runner = build(settings, CollectorRegistry(), None)
        await runner.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{settings.http_port}")
    try:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer k-acme"}) as http:
            for url in urls:
                async def serving(url: str = url) -> bool:
                    return bool((await http.get(f"{url}/v1/models")).json().get("data"))
                await async_wait_until(serving, timeout=60, interval=0.2, message=f"no model ({backend.logs})")
        yield urls
    finally:
        for runner in runners:
            await runner.stop()


async def test_24_concurrent_requests_pass_a_budget_by_at_most_one_reservation(
        replicas: list[str], redis_url: str, redis_prefix: str) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # every admitted answer uses all it reserved: the worst case for the budget
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer k-acme"}) as http:
        answers = await asyncio.gather(*(http.post(f"{replicas[i % 2]}/v1/chat/completions", json=body)
                                         for i in range(24)))
    served = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    used = sum(r.json()["usage"]["total_tokens"] for r in served)
    prompt = max(r.json()["usage"]["prompt_tokens"] for r in served)
    assert served and used <= BUDGET + prompt + MAX_TOKENS, (len(served), used)

    async def settled() -> bool:  # the month's counter: what was used, no reservation left in it
        async with aioredis.Redis.from_url(redis_url) as r:
            return int(await r.get(f"{redis_prefix}:quota:month:tenant:acme:{month_of()[0]}") or 0) == used
    assert await async_wait_until(settled, timeout=10, interval=0.1)


async def test_n_answers_reserve_n_times_max_tokens_in_the_tokens_per_minute(replicas: list[str]) -> None:
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer k-globex"}) as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}
        too_many = await http.post(f"{replicas[0]}/v1/chat/completions", json={**body, "n": 8})
        assert too_many.status_code == 429, too_many.text
        assert "may use" in too_many.json()["error"]["message"]  # 8 x 200 > 1000 a minute, refused by name
        # 4 x 200 fit the minute; the simulated engine then refuses n > 1, and the reservation is given back
        four = await http.post(f"{replicas[1]}/v1/chat/completions", json={**body, "n": 4})
        assert four.status_code == 400 and four.json()["error"]["param"] == "n", four.text

        async def given_back() -> bool:
            resp = await http.post(f"{replicas[0]}/v1/chat/completions", json={**body, "max_tokens": 900})
            return resp.status_code == 200
        assert await async_wait_until(given_back, timeout=5, interval=0.2)
