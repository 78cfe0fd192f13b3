"""Per-tenant and per-key quotas against a real Redis: two ``Quotas`` on one Redis are two gateway replicas, so
every limit here is checked across replicas, not per process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from goodput_testing import RedisServer, dead_port

from goodput_cli.main import app
from goodput_gateway.auth import Principal, Quota
from goodput_gateway.config import GatewaySettings
from goodput_gateway.quota_counters import RedisCounters
from goodput_gateway.quotas import Admission, BudgetUnknown, QuotaExhausted, Quotas, RateLimited, month_of

pytestmark = pytest.mark.asyncio

Factory = Callable[..., Quotas]


@pytest.fixture
async def replicas(redis_url: str, redis_prefix: str) -> AsyncIterator[Factory]:
    """Makes gateway replicas' quota counters on one Redis (closed after the test)."""
    made: list[Quotas] = []

    def make(url: str | None = None, **quotas: object) -> Quotas:
        settings = GatewaySettings(quotas={"prefix": f"{redis_prefix}:quota", **quotas})
        quotas = Quotas(settings, redis_url=redis_url if url is None else url, registry=CollectorRegistry())
        made.append(quotas)
        return quotas

    yield make
    for quotas in made:
        await quotas.close()


NONE = Quota()


def principal(tenant: str = "acme", *, key_id: str = "acme-key", tenant_quota: Quota = NONE,
              key_quota: Quota = NONE) -> Principal:
    return Principal(tenant=tenant, max_priority=1, default_priority=1, key_id=key_id, tenant_quota=tenant_quota,
                     key_quota=key_quota)


async def admit(quotas: Quotas, who: Principal, prompt_tokens: int = 10) -> Admission | RateLimited:
    try:
        return await quotas.admit(who, tokens=prompt_tokens, timeout_s=30)
    except RateLimited as err:
        return err


async def test_requests_per_minute_hold_exactly_across_two_replicas(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(rpm=5))
    results = [await admit((a, b)[i % 2], who) for i in range(15)]  # 3N, alternating between the replicas
    admitted = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 5
    err = refused[0]
    assert err.code == "rate_limit_exceeded" and err.http_status == 429
    # a sliding window: the sixth fits once a fifth of the last minute's five have aged into the next minute
    assert err.retry_after_s is not None and 0 < err.retry_after_s <= 60 * 1.2
    assert err.headers["x-ratelimit-limit-requests"] == "5"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "tenant 'acme'" in err.message
    # admitted responses show what is left
    assert [r.headers["x-ratelimit-remaining-requests"] for r in admitted] == ["4", "3", "2", "1", "0"]
    # another tenant is untouched
    assert isinstance(await admit(a, principal("globex", key_id="g", tenant_quota=Quota(rpm=5))), Admission)


async def test_a_key_limit_applies_beside_its_tenant_limit(replicas: Factory) -> None:
    q = replicas()
    narrow = principal(key_id="ci", tenant_quota=Quota(rpm=100), key_quota=Quota(rpm=2))
    other_key = principal(key_id="web", tenant_quota=Quota(rpm=100))
    assert [isinstance(await admit(q, narrow), Admission) for _ in range(3)] == [True, True, False]
    assert isinstance(await admit(q, other_key), Admission)  # the tenant still has room
    err = await admit(q, narrow)
    assert isinstance(err, RateLimited) and "API key 'ci'" in err.message


async def test_tokens_per_minute_count_real_usage_not_the_estimate(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(tpm=1000))
    first = await admit(a, who, prompt_tokens=100)
    assert isinstance(first, Admission)
    assert first.headers["x-ratelimit-remaining-tokens"] == "900"  # the prompt's estimate, counted at admission
    first.settle(prompt_tokens=80, completion_tokens=700, inference=True)  # what the worker really used
    await a.settle_all()
    second = await admit(b, who, prompt_tokens=100)  # the other replica sees the corrected count
    assert isinstance(second, Admission)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - 780 - 100)
    second.settle(prompt_tokens=100, completion_tokens=0, inference=False)  # a cache hit: no inference counted
    await b.settle_all()
    third = await admit(a, who, prompt_tokens=300)
    assert isinstance(third, RateLimited)  # 780 + 300 > 1000
    assert third.headers["x-ratelimit-limit-tokens"] == "1000"
    assert third.headers["x-ratelimit-remaining-tokens"] == "220"
    assert isinstance(await admit(a, who, prompt_tokens=200), Admission)  # the refused 300 were given back


async def test_a_prompt_larger_than_the_whole_minute_is_refused_by_name(replicas: Factory) -> None:
    err = await admit(replicas(), principal(tenant_quota=Quota(tpm=50)), prompt_tokens=51)
    assert isinstance(err, RateLimited) and "may use 51 tokens" in err.message
    assert err.code == "request_too_large" and err.http_status == 429  # no retry helps it (a job fails at once)


async def test_concurrent_requests_are_bounded_across_replicas_and_given_back(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(max_concurrent=2, rpm=100))
    one, two = await admit(a, who), await admit(b, who)
    assert isinstance(one, Admission) and isinstance(two, Admission)
    third = await admit(a, who)
    assert isinstance(third, RateLimited) and "2 requests in flight" in third.message
    # the refusal shows the request window as it stands, and did not count in it
    assert third.headers["x-ratelimit-limit-requests"] == "100"
    assert third.headers["x-ratelimit-remaining-requests"] == "98"
    one.settle(prompt_tokens=10, completion_tokens=5, inference=True)
    await a.settle_all()
    assert isinstance(await admit(b, who), Admission)


async def test_a_spent_monthly_budget_refuses_with_insufficient_quota(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(monthly_tokens=500, monthly_soft=0.5))
    first = await admit(a, who)
    assert isinstance(first, Admission)
    first.settle(prompt_tokens=100, completion_tokens=300, inference=True)
    await a.settle_all()
    assert a.metrics.budget_used.labels("other")._value.get() == pytest.approx(0.8)  # noqa: SLF001
    second = await admit(b, who)
    assert isinstance(second, Admission)  # 400 of 500: still under
    second.settle(prompt_tokens=50, completion_tokens=60, inference=True)
    await b.settle_all()
    err = await admit(a, who)
    assert isinstance(err, QuotaExhausted)
    assert err.code == "insufficient_quota" and err.http_status == 429
    assert err.retry_after_s is not None and err.retry_after_s > 0  # until the month ends
    assert "monthly budget of 500 tokens" in err.message


async def test_an_unreachable_redis_fails_open_with_a_local_bound_and_counts_it(replicas: Factory) -> None:
    q = replicas(f"redis://127.0.0.1:{dead_port()}/0", fail_open_share=0.5, timeout_s=0.2)
    who = principal(tenant_quota=Quota(rpm=4, monthly_tokens=1000))
    results = [await admit(q, who) for _ in range(4)]
    assert [isinstance(r, Admission) for r in results] == [True, True, False, False]  # half of 4, locally
    assert q.metrics.fail_open.labels("admit")._value.get() == 1  # noqa: SLF001 - Redis tried once, then not
    # the third was refused by the local counters, the fourth turned away until the third's retry time
    assert q.metrics.fail_open.labels("local_bound")._value.get() == 3  # noqa: SLF001


async def test_without_redis_the_counters_are_this_process(replicas: Factory) -> None:
    q = replicas("")
    assert not q.shared
    who = principal(tenant_quota=Quota(rpm=1, max_concurrent=1))
    first = await admit(q, who)
    assert isinstance(first, Admission) and isinstance(await admit(q, who), RateLimited)


async def test_unlimited_principals_skip_redis_entirely(replicas: Factory) -> None:
    q = replicas(f"redis://127.0.0.1:{dead_port()}/0")
    admitted = await asyncio.wait_for(admit(q, principal()), timeout=1)
    assert isinstance(admitted, Admission) and admitted.headers == {}


async def test_a_quantised_limit_spreads_a_minute_over_its_quanta(replicas: Factory) -> None:
    a, b = replicas(quantum_s=10), replicas(quantum_s=10)
    who = principal(tenant_quota=Quota(rpm=60))  # 60 a minute = 10 per 10 s
    results = [await admit((a, b)[i % 2], who) for i in range(30)]
    assert sum(isinstance(r, Admission) for r in results) == 10  # a burst gets one quantum's worth, not 60
    refused = next(r for r in results if isinstance(r, RateLimited))
    assert "10 per 10 s" in refused.message and 0 < (refused.retry_after_s or 0) <= 10 * 1.1
    assert refused.headers["x-ratelimit-limit-requests"] == "60"  # the headers speak of the minute
    assert refused.headers["x-ratelimit-remaining-requests"] == "50"


async def test_a_budget_refusal_shows_the_rate_windows(replicas: Factory) -> None:
    q = replicas()
    who = principal(tenant_quota=Quota(monthly_tokens=10, rpm=30))
    first = await admit(q, who)
    assert isinstance(first, Admission)
    first.settle(prompt_tokens=5, completion_tokens=5, inference=True)
    await q.settle_all()
    err = await admit(q, who)
    assert isinstance(err, QuotaExhausted)
    assert err.headers["x-ratelimit-limit-requests"] == "30" and err.headers["x-ratelimit-remaining-requests"] == "29"


async def test_knowledge_calls_share_the_tenants_request_limit() -> None:
    """Embeddings, search and indexing are admitted under the same quotas as generations (no knowledge services
    run here: the admitted call fails behind the quota, and still counts as a request)."""
    import json

    import httpx

    from goodput_gateway.__main__ import build

    keys = json.dumps({"tenants": {"acme": {"rpm": 2}}, "keys": [{"key": "k", "tenant": "acme"}]})
    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=keys, scheduler_addr="127.0.0.1:1")
    runner = build(settings, CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner.http_app)  # the same app uvicorn serves
    async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                 headers={"Authorization": "Bearer k"}) as client:
        first = await client.post("/v1/embeddings", json={"input": "hello"})
        second = await client.post("/v1/knowledge-bases/kb/search", json={"query": "hello"})
        third = await client.post("/v1/embeddings", json={"input": "hello"})
    assert first.status_code != 429 and second.status_code != 429
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    assert third.headers["x-ratelimit-limit-requests"] == "2"


async def test_usage_with_its_store_down_is_a_503_not_a_500() -> None:
    import json

    import httpx

    from goodput_gateway.__main__ import build

    keys = json.dumps({"keys": [{"key": "k", "tenant": "acme"}]})
    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=keys, scheduler_addr="127.0.0.1:1",
                               quota_redis_url=f"redis://127.0.0.1:{dead_port()}/0")
    runner = build(settings, CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner.http_app)  # the same app uvicorn serves
    async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                 headers={"Authorization": "Bearer k"}) as client:
        resp = await client.get("/v1/usage")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "store_unavailable"


async def test_a_budget_is_passed_by_at_most_one_reservation_however_many_requests_race(
        replicas: Factory, redis_url: str, redis_prefix: str) -> None:
    """24 requests of up to 320 tokens at once through two replicas against a budget of 2000: those admitted
    reserved their whole size, so all but the last fit under the budget, and every one uses all it reserved."""
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(monthly_tokens=2000))
    results = await asyncio.gather(*(admit((a, b)[i % 2], who, prompt_tokens=320) for i in range(24)))
    admitted = [r for r in results if isinstance(r, Admission)]
    assert len(admitted) == 7  # 6 x 320 = 1920 < 2000 admits a seventh; 2240 refuses the rest
    assert all(isinstance(r, QuotaExhausted) for r in results if not isinstance(r, Admission))
    for r in admitted:
        r.settle(prompt_tokens=20, completion_tokens=300, inference=True)
    await a.settle_all()
    await b.settle_all()
    async with aioredis.Redis.from_url(redis_url) as store:
        metered = int(await store.get(f"{redis_prefix}:quota:month:tenant:acme:{month_of()[0]}"))
    assert metered == 7 * 320 <= 2000 + 320


async def test_the_unused_part_of_a_reservation_is_given_back(replicas: Factory) -> None:
    a, b = replicas(), replicas()
    who = principal(tenant_quota=Quota(monthly_tokens=1000, tpm=1000))
    first = await admit(a, who, prompt_tokens=900)  # prompt + max_tokens: the tokens window counts it all
    assert isinstance(first, Admission) and first.headers["x-ratelimit-remaining-tokens"] == "100"
    assert isinstance(await admit(b, who, prompt_tokens=200), RateLimited)  # 900 + 200 > 1000 a minute
    first.settle(prompt_tokens=50, completion_tokens=50, inference=True)  # the answer stopped early
    await a.settle_all()
    second = await admit(a, who, prompt_tokens=200)  # (b, which refused, turns the tenant away for a second)
    assert isinstance(second, Admission), second
    assert second.headers["x-ratelimit-remaining-tokens"] == "700"  # 100 used, 200 reserved


async def test_a_refused_scope_is_turned_away_locally_until_its_retry_time(replicas: Factory) -> None:
    q = replicas()
    who = principal(tenant_quota=Quota(rpm=1))
    assert isinstance(await admit(q, who), Admission)
    first = await admit(q, who)
    assert isinstance(first, RateLimited)
    q.remote = RedisCounters(aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0"), "x")  # Redis gone
    again = await admit(q, who)
    assert isinstance(again, RateLimited) and again.code == "rate_limit_exceeded"
    assert 0 < (again.retry_after_s or 0) <= (first.retry_after_s or 0)
    assert q.metrics.fail_open.labels("admit")._value.get() == 0  # noqa: SLF001 - Redis was never asked


async def test_a_budget_redis_said_was_spent_stays_spent_while_redis_is_down(
        replicas: Factory, redis_prefix: str) -> None:
    q = replicas(timeout_s=0.3, retry_s=30)
    who = principal(tenant_quota=Quota(monthly_tokens=100, rpm=1000))
    first = await admit(q, who, prompt_tokens=150)
    assert isinstance(first, Admission)
    first.settle(prompt_tokens=150, completion_tokens=0, inference=True)
    await q.settle_all()
    q._turned_away.clear()  # noqa: SLF001 - only the fail-open path is under test here
    spent = await admit(q, who)
    assert isinstance(spent, QuotaExhausted)  # Redis says so, and the replica remembers it
    q._turned_away.clear()  # noqa: SLF001
    q.remote = RedisCounters(aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0"), f"{redis_prefix}:quota")
    down = await admit(q, who)
    assert isinstance(down, QuotaExhausted)  # failed open for the rates, not for the budget
    assert q.metrics.fail_open.labels("admit")._value.get() == 1  # noqa: SLF001


async def test_a_redis_filled_by_the_stores_it_shares_still_counts_the_quotas(redis_prefix: str) -> None:
    """One Redis for every role (the chart's default), filled by stored data to its maxmemory with noeviction: the
    counters' scripts may still write (allow-oom), so limits and budgets hold from Redis, not from the local bound."""
    with RedisServer() as shared:
        async with aioredis.Redis.from_url(shared.url) as admin:
            await admin.config_set("maxmemory-policy", "noeviction")
            for i in range(16):  # a tenant's files, then the limit set below what they take
                await admin.set(f"{redis_prefix}:files:{i}", b"x" * (64 << 10))
            await admin.config_set("maxmemory", int((await admin.info("memory"))["used_memory"]) - (256 << 10))
            with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
                await admin.incrby(f"{redis_prefix}:quota:probe", 1)
        q = Quotas(GatewaySettings(quotas={"prefix": f"{redis_prefix}:quota"}), redis_url=shared.url,
                   registry=CollectorRegistry())
        try:
            who = principal(tenant_quota=Quota(rpm=2, monthly_tokens=1000))
            results = [await admit(q, who) for _ in range(3)]
            assert [type(r) for r in results] == [Admission, Admission, RateLimited]
            assert not q.metrics.fail_open.labels("admit")._value.get()  # noqa: SLF001
            first = results[0]
            assert isinstance(first, Admission)
            first.settle(prompt_tokens=5, completion_tokens=5, inference=True)
            await q.settle_all()
            assert not q.metrics.fail_open.labels("settle")._value.get()  # noqa: SLF001
        finally:
            await q.close()


async def test_concurrent_first_admissions_on_a_new_store_agree_on_one_epoch(
        replicas: Factory, redis_url: str, redis_prefix: str) -> None:
    # Every request of a replica that starts sees the epoch change at once; none may take another's adoption for
    # a loss.
    budgeted = principal(tenant_quota=Quota(monthly_tokens=100_000))
    a, b = replicas(), replicas()
    results = await asyncio.gather(*(admit(a, budgeted) for _ in range(20)), return_exceptions=True)
    # and a replica that starts on the store: its first requests all find an epoch it does not know yet
    results += await asyncio.gather(*(admit(b, budgeted) for _ in range(20)), return_exceptions=True)
    assert all(isinstance(r, Admission) for r in results), results
    epoch = redis.Redis.from_url(redis_url).get(f"{redis_prefix}:quota:epoch")
    assert epoch.startswith(b"g:") and a.remote.epoch == b.remote.epoch == epoch.decode()
    assert a.metrics.store_lost._value.get() == b.metrics.store_lost._value.get() == 0


async def test_a_store_that_lost_its_counts_refuses_budgets_as_unknown_until_an_operator_accepts(
        replicas: Factory, redis_url: str, redis_prefix: str) -> None:
    a = replicas()
    budgeted = principal(tenant_quota=Quota(monthly_tokens=1000))
    rated = principal("globex", key_id="g", tenant_quota=Quota(rpm=100))  # no budget
    spent = await admit(a, budgeted, prompt_tokens=1000)
    assert isinstance(spent, Admission)
    spent.settle(prompt_tokens=1000, completion_tokens=0, inference=True)  # the whole budget
    await a.settle_all()
    assert isinstance(await admit(a, budgeted, prompt_tokens=200), QuotaExhausted)
    sync = redis.Redis.from_url(redis_url)
    epoch_key = f"{redis_prefix}:quota:epoch"
    assert sync.get(epoch_key).startswith(b"g:")  # the first admission found the store new
    # The store loses everything (a restart without persistence, a FLUSHALL); a replica starts on the empty store
    # and, seeing no epoch, takes it for a new one: the one loss a replica cannot see alone.
    sync.delete(*sync.keys(f"{redis_prefix}:quota:*"))
    late = replicas()
    assert isinstance(await admit(late, budgeted, prompt_tokens=200), Admission)
    await asyncio.sleep(1.1)  # the refused budget is turned away locally for a second; then the store is asked
    # The replica that knew the old epoch sees it replaced and marks the store lost, for every replica.
    for replica in (a, late, replicas()):
        with pytest.raises(BudgetUnknown) as refused:
            await replica.admit(budgeted, tokens=10, timeout_s=30)
        assert refused.value.code == "budget_unknown" and refused.value.http_status == 503
        assert "tenant 'acme'" in refused.value.message
        assert isinstance(await admit(replica, rated), Admission)  # limits without a budget still hold
        assert replica.metrics.store_lost._value.get() == 1
    assert sync.get(epoch_key).startswith(b"lost:")
    # The operator accepts the counts as they stand: budgets are checked again, everywhere.
    result = CliRunner().invoke(app, ["quotas", "accept-loss", "--redis-url", redis_url, "--prefix",
                                      f"{redis_prefix}:quota"])
    assert result.exit_code == 0, result.output
    for replica in (a, late):
        assert isinstance(await admit(replica, budgeted, prompt_tokens=200), Admission)
        assert replica.metrics.store_lost._value.get() == 0
    # and a later loss is seen again
    sync.delete(epoch_key)
    with pytest.raises(BudgetUnknown):
        await a.admit(budgeted, tokens=10, timeout_s=30)
