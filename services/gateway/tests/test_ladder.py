"""The degradation ladder, deadlines and program-level feedback at the gateway (no backend: the scheduler address
is a closed port, so a request that got past the gateway's own decisions fails with 503)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.feedback import _Answer
from goodput_gateway.generation import Opened
from goodput_gateway.generation_schemas import ChatCompletionRequest
from goodput_gateway.ladder import Ladder, LadderMetrics
from goodput_gateway.profile import LatencyProfile
from goodput_gateway.schemas import parse
from goodput_gateway.service import GatewayService
from goodput_gateway.tenants import TenantLabels
from goodput_gateway.timing import Timeline

from .helpers import AUTH, KEYS, FakeClock, GatewayFactory, assert_openai_error, chat, post


@pytest.fixture
async def gateway(gateway: GatewayFactory) -> tuple[httpx.AsyncClient, GatewayService, CollectorRegistry]:
    keys = json.loads(KEYS)["keys"] + [{"key": "k-c", "tenant": "c", "max_priority": "P0"}]  # a second P0 tenant
    gw = await gateway(models=[ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1)],
                       api_keys=json.dumps({"keys": keys}))
    return gw.client, gw.service, gw.registry


def _ladder(**kw: object) -> tuple[Ladder, FakeClock]:
    now = FakeClock()
    ladder = Ladder(LatencyProfile(), clock=now, interval_s=1.0, min_samples=5, rand=lambda: 0.05,
                    metrics=LadderMetrics(None), **kw)  # type: ignore[arg-type]
    ladder.level(1)  # the class's first interval starts now
    return ladder, now


def _interval(ladder: Ladder, now: FakeClock, *, missed: bool, n: int = 5) -> None:
    now.advance(1.0)
    for _ in range(n):
        ladder.observe(1, missed=missed)


def test_the_ladder_climbs_in_the_profiles_order_then_sheds_then_comes_back() -> None:
    ladder, now = _ladder()
    seen = []
    for _ in range(5):
        _interval(ladder, now, missed=True)
        seen.append(ladder.active(1))
    assert seen[-1] == ("skip_rerank", "fewer_chunks", "exact_cache_only", "fallback_model", "shed")
    assert [len(s) for s in seen] == [1, 2, 3, 4, 5] and ladder.shed_share(1) == pytest.approx(0.1)
    assert ladder.sheds(1)  # rand() = 0.05 < 0.1
    _interval(ladder, now, missed=True)
    assert ladder.shed_share(1) == pytest.approx(0.2)
    for _ in range(2):
        _interval(ladder, now, missed=False)
    assert ladder.shed_share(1) == 0.0 and ladder.level(1) == 5 and not ladder.sheds(1)
    for _ in range(5):
        _interval(ladder, now, missed=False)
    assert ladder.active(1) == ()
    assert ladder.active(2) == () and ladder.level(2) == 0  # one class's trouble moves no other class


def test_a_few_requests_do_not_move_it_and_a_disabled_ladder_never_does() -> None:
    ladder, now = _ladder()
    _interval(ladder, now, missed=True, n=4)  # under min_samples
    assert ladder.level(1) == 0
    off, now = _ladder(enabled=False)
    for _ in range(6):
        _interval(off, now, missed=True)
    assert off.active(1) == () and not off.sheds(1)


async def test_a_shedding_class_is_refused_before_anything_is_spent(gateway) -> None:  # type: ignore[no-untyped-def]
    client, service, registry = gateway
    ladder, clock = service.ladder, FakeClock()
    ladder.clock, ladder.rand = clock, lambda: 0.0
    for _ in range(20):  # interval after interval, P0's answers miss their SLO: the ladder climbs to shedding 90 %
        clock.advance(ladder.interval_s)
        for _ in range(ladder.min_samples):
            ladder.observe(1, missed=True)
    assert ladder.active(1)[-1] == "shed" and ladder.shed_share(1) == pytest.approx(0.9)
    resp = await post(client, chat(priority="P0"))
    error = assert_openai_error(resp, 429)
    assert error["code"] == "degraded_shed" and float(resp.headers["retry-after"]) >= 1
    assert registry.get_sample_value("goodput_gateway_degradations_total", {"step": "shed", "priority": "P0"}) == 1
    service.ladder.rand = lambda: 0.99  # the share not shed goes on (to the absent scheduler)
    assert_openai_error(await post(client, chat(priority="P0")), 503)


async def test_deadline_headers_are_honoured_and_checked(gateway) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = gateway
    for bad in ("0", "-5", "soon", "1e12"):
        assert_openai_error(await post(client, chat(), headers={**AUTH, "X-Goodput-Deadline-Ms": bad}), 400,
                            "x-goodput-deadline-ms")
    assert_openai_error(await post(client, chat(), headers={**AUTH, "Request-Timeout-Ms": "5000"}), 503)


async def test_feedback_withdraws_a_discarded_answers_goodput_once(gateway) -> None:  # type: ignore[no-untyped-def]
    client, service, registry = gateway
    service.feedback.keep(_Answer(request_id="req-1", tenant="a", model="m", priority=1, tokens=30))
    other = {"Authorization": "Bearer k-p2"}  # tenant b: tenant a's answer is not its to judge
    assert (await client.post("/v1/feedback", json={"request_id": "req-1", "verdict": "discarded"},
                              headers=other)).status_code == 404
    resp = await client.post("/v1/feedback", json={"request_id": "req-1", "verdict": "regenerated"}, headers=AUTH)
    assert resp.status_code == 200 and resp.json()["goodput_tokens_withdrawn"] == 30
    again = await client.post("/v1/feedback", json={"request_id": "req-1", "verdict": "discarded"}, headers=AUTH)
    assert again.json()["goodput_tokens_withdrawn"] == 0
    labels = {"priority": "P0", "tenant": service.timing_metrics.tenant_label("a"), "model": "m"}
    assert registry.get_sample_value("goodput_gateway_goodput_discarded_tokens_total", labels) == 30
    bad = await client.post("/v1/feedback", json={"request_id": "req-1", "verdict": "meh"}, headers=AUTH)
    assert_openai_error(bad, 400, "verdict")
    assert_openai_error(await client.post("/v1/feedback", json={"request_id": "nope", "verdict": "used"},
                                          headers=AUTH), 404, "request_id")


def test_steps_that_change_nothing_here_are_passed_over() -> None:
    """No rerank asked for, no semantic cache, no fallback model: the ladder goes from fewer chunks to shedding
    in two moves instead of spending intervals on steps that would relieve nothing."""
    ladder, now = _ladder(applies=lambda priority, step: step in ("fewer_chunks", "shed"))
    _interval(ladder, now, missed=True)
    assert ladder.active(1) == ("fewer_chunks",)
    _interval(ladder, now, missed=True)
    assert ladder.active(1) == ("fewer_chunks", "shed") and ladder.shed_share(1) > 0


def _tenants(ladder: Ladder, now: FakeClock, **missed: bool) -> None:
    """One interval of 5 P0 answers per tenant, each tenant missing its SLO or not, and the ladder's move on them
    (made on the first answer after the interval: here one of no tenant, which met its SLO)."""
    for _ in range(5):
        for tenant, miss in missed.items():
            ladder.observe(1, missed=miss, tenant=tenant)
    now.advance(1.0)
    ladder.observe(1, missed=False)


def test_a_tenant_whose_own_requests_miss_climbs_its_own_ladder_and_no_one_elses() -> None:
    ladder, now = _ladder()
    for _ in range(7):  # a misses, b and c meet their SLO: a is the cause
        _tenants(ladder, now, a=True, b=False, c=False)
    assert ladder.active(1, "a")[-1] == "shed" and ladder.shed_share(1, "a") > 0 and ladder.sheds(1, "a")
    for tenant in ("b", "c", ""):  # the full quality path: no step, no shed, no fallback model
        assert ladder.active(1, tenant) == () and not ladder.sheds(1, tenant)
    assert ladder.level(1) == 0 and ladder.level(1, "b") == 0
    for _ in range(12):  # a meets its SLO again: it comes back down, and is forgotten at the bottom
        _tenants(ladder, now, a=False, b=False, c=False)
    assert ladder.active(1, "a") == () and not ladder._of(1).tenants


def test_misses_spread_over_the_class_move_the_class_ladder() -> None:
    ladder, now = _ladder()
    for _ in range(2):  # everyone misses: fleet-wide, the class climbs and every tenant takes its steps
        _tenants(ladder, now, a=True, b=True, c=True)
    assert ladder.level(1) == 2 and ladder.active(1, "b") == ("skip_rerank", "fewer_chunks")
    assert ladder.level(1, "a") == 0 and not ladder._of(1).tenants
    ladder, now = _ladder()
    for _ in range(2):  # two of three tenants: the rest without either one still misses, so it is the class's
        _tenants(ladder, now, a=True, b=True, c=False)
    assert ladder.level(1) == 2 and ladder.level(1, "a") == ladder.level(1, "b") == 0


def test_a_tenant_on_its_own_ladder_holds_while_the_class_misses_and_is_forgotten_when_idle() -> None:
    ladder, now = _ladder()
    for _ in range(2):
        _tenants(ladder, now, a=True, b=False)
    assert ladder.level(1, "a") == 2 and ladder.level(1) == 0
    _tenants(ladder, now, a=True, b=True)  # now b misses too: the class climbs, a's own ladder holds
    assert ladder.level(1) == 1 and ladder.level(1, "a") == 2
    now.advance(31 * ladder.interval_s)  # a is not heard from for longer than the idle bound
    assert ladder.level(1, "a") == 0 and "a" not in ladder._of(1).tenants


def test_tenant_ladders_are_exported_under_bounded_labels() -> None:
    registry = CollectorRegistry()
    now = FakeClock()
    ladder = Ladder(LatencyProfile(), clock=now, interval_s=1.0, min_samples=5,
                    metrics=LadderMetrics(registry, TenantLabels("a")))
    ladder.level(1)
    for _ in range(3):
        _tenants(ladder, now, a=True, x=False, y=False, z=False)
    _tenants(ladder, now, a=False, x=False, y=True, z=False)
    value = registry.get_sample_value
    assert value("goodput_gateway_ladder_tenant_level", {"priority": "P0", "tenant": "a"}) == 2  # 3, then back 1
    assert value("goodput_gateway_ladder_tenant_level", {"priority": "P0", "tenant": "other"}) == 1  # y, unnamed
    assert value("goodput_gateway_ladder_tenants", {"priority": "P0"}) == 2
    assert value("goodput_gateway_ladder_level", {"priority": "P0"}) == 0


async def test_a_tenant_shed_for_its_misses_leaves_the_others_alone(gateway) -> None:  # type: ignore[no-untyped-def]
    client, service, _ = gateway
    ladder, clock = service.ladder, FakeClock()
    ladder.clock, ladder.rand = clock, lambda: 0.0
    for _ in range(20):  # a's answers miss their SLO, c's meet theirs
        clock.advance(ladder.interval_s)
        for _ in range(ladder.min_samples):
            ladder.observe(1, missed=True, tenant="a")
            ladder.observe(1, missed=False, tenant="c")
    assert ladder.shed_share(1, "a") == pytest.approx(0.9) and ladder.level(1) == 0
    error = assert_openai_error(await post(client, chat(priority="P0")), 429)  # tenant a
    assert error["code"] == "degraded_shed" and "your P0 requests" in str(error["message"])
    # c's request is not shed: it goes on (to the absent scheduler)
    assert_openai_error(await post(client, chat(priority="P0"), {"Authorization": "Bearer k-c"}), 503)


async def test_answers_feed_the_ladder_under_their_tenant(gateway) -> None:  # type: ignore[no-untyped-def]
    """The accounting's judgement of each finished answer reaches the ladder with the answer's tenant."""
    _, service, _ = gateway
    ladder, clock = service.ladder, FakeClock()
    ladder.clock = clock
    request = parse(ChatCompletionRequest, chat()).to_request()
    cls = service.settings.latency_profile.of(1)

    def answered(tenant: str, ttft_s: float) -> None:
        timeline = Timeline(arrived=0.0, now=lambda: 0.0)
        timeline.first_token(at=ttft_s)
        timeline.mark("post_processing", at=ttft_s)
        service.accounting.answered(Opened(request_id="req", tenant=tenant, priority=1, model="m", worker_id="w",
                                           request=request, sources=[], cache=None, timeline=timeline,
                                           profile=cls), timeline)

    for _ in range(3):
        for _ in range(ladder.min_samples):
            answered("a", cls.slo.ttft_s * 3)  # a's answers are late
            answered("c", 0.01)
        clock.advance(ladder.interval_s)
    answered("c", 0.01)
    assert ladder.level(1, "a") > 0 and ladder.level(1) == 0 and ladder.active(1, "c") == ()
