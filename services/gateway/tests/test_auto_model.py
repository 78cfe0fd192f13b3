"""``model: "auto"``: the cheapest pool predicted to meet the request's class SLO, from the workers' learned speeds
(ListWorkers), their load and the queue waits this gateway measured. The predictor and the choice are tested on
fleets described directly; the gateway's wiring (the request routed, counted, refused clearly) on a gateway whose
worker list is set and whose scheduler is absent (its admission then fails: the routing before it is under test).
The whole path against a real scheduler and workers is tests/integration/test_auto_model.py."""

from __future__ import annotations

import json

import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2
from goodput.scheduler.v1 import scheduler_pb2
from prometheus_client import CollectorRegistry

from goodput_contracts.speed import SpeedEstimate

from goodput_gateway.autoroute import PoolView, QueueWaits, WorkerView, choose, pools_from
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.service import GatewayService

from .helpers import GatewayFactory, assert_openai_error

P0, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P2
A100_7B = SpeedEstimate(prefill_s_per_token=0.00012, tpot_base_s=0.012, tpot_per_seq_s=0.0003)
L4_1B = SpeedEstimate(prefill_s_per_token=0.00006, tpot_base_s=0.008, tpot_per_seq_s=0.0004)


def status(model: str, pool: str, *, cost: float, speed: SpeedEstimate, inflight: int = 0, cap: int = 64,
           classes: tuple[int, ...] = (), window: int = 8192, healthy: bool = True) -> scheduler_pb2.WorkerStatus:
    return scheduler_pb2.WorkerStatus(
        worker_id=f"{pool}-{inflight}", healthy=healthy, inflight=inflight, lease_cap=cap,
        model=inference_pb2.ModelInfo(served_model_name=model, pool=pool, pool_classes=classes,  # type: ignore[arg-type]
                                      cost_per_hour=cost, max_model_len=window),
        speed=scheduler_pb2.SpeedEstimate(prefill_s_per_token=speed.prefill_s_per_token,
                                          tpot_base_s=speed.tpot_base_s, tpot_per_seq_s=speed.tpot_per_seq_s))


FLEET = [status("big", "a100", cost=4.0, speed=A100_7B), status("small", "l4", cost=0.8, speed=L4_1B, window=2048)]


def pick(fleet: list[scheduler_pb2.WorkerStatus], *, priority: int = P2, prompt: int = 300, output: int = 200,
         ttft: float = 1.0, tpot: float = 0.05, models: tuple[str, ...] = (), wait: float = 0.0) -> tuple[str, str]:
    choice = choose(pools_from(fleet, priority=priority, models=models), prompt_tokens=prompt, output_tokens=output,
                    ttft_slo_s=ttft, tpot_slo_s=tpot, queue_wait=lambda model: wait if model == "small" else 0.0)
    assert choice is not None
    return choice.model, choice.reason


def test_the_cheapest_pool_that_meets_the_slo_is_chosen() -> None:
    assert pick(FLEET) == ("small", "cheapest_meeting_slo")
    # a prompt the small model's window cannot hold goes to the big one
    assert pick(FLEET, prompt=3000) == ("big", "cheapest_meeting_slo")
    # AUTO_MODELS limits the candidates
    assert pick(FLEET, models=("big",)) == ("big", "cheapest_meeting_slo")


def test_a_pool_predicted_to_miss_the_slo_is_passed_over_for_a_dearer_one_that_meets_it() -> None:
    # the small pool is saturated: every slot taken, so the request would wait for a lease to end
    busy = [FLEET[0], status("small", "l4", cost=0.8, speed=L4_1B, inflight=8, cap=8, window=2048)]
    assert pick(busy, output=2000, ttft=0.5, prompt=100) == ("big", "cheapest_meeting_slo")
    # its queue has been slow lately (waits this gateway measured)
    assert pick(FLEET, ttft=1.0, wait=3.0) == ("big", "cheapest_meeting_slo")
    # a slower GPU, as the scheduler learned it: the small pool's TPOT misses a tight SLO
    slow = [FLEET[0], status("small", "l4", cost=0.8, speed=L4_1B.scaled(4), window=2048)]
    assert pick(slow, tpot=0.03) == ("big", "cheapest_meeting_slo")
    # nothing meets it: the fastest prediction, said so
    assert pick(FLEET, tpot=0.001) == ("small", "none_meets_slo")


def test_only_pools_serving_the_class_count_and_unhealthy_workers_none() -> None:
    fleet = [status("m", "interactive", cost=2.0, speed=A100_7B, classes=(P0,)),
             status("m", "batch", cost=1.0, speed=A100_7B, classes=(P2,)),
             status("other", "x", cost=0.1, speed=A100_7B, healthy=False)]
    assert [p.pool for p in pools_from(fleet, priority=P0)] == ["interactive"]
    assert [p.pool for p in pools_from(fleet, priority=P2)] == ["batch"]
    # a model none of whose pools serves the class keeps them all (the scheduler falls back the same way)
    assert [p.pool for p in pools_from(fleet, priority=types_pb2.PRIORITY_P1)] == ["batch", "interactive"]


def test_an_unpriced_pool_ranks_after_priced_ones_and_unknown_windows_do_not_exclude() -> None:
    unpriced = PoolView(model="u", pool="p", cost_per_hour=0.0, max_model_len=0,
                        workers=(WorkerView(inflight=0, lease_cap=8, pending_prefill=0, speed=L4_1B),))
    priced = PoolView(model="v", pool="p", cost_per_hour=100.0, max_model_len=0,
                      workers=(WorkerView(inflight=0, lease_cap=8, pending_prefill=0, speed=A100_7B),))
    choice = choose([unpriced, priced], prompt_tokens=10**6, output_tokens=10, ttft_slo_s=1e9, tpot_slo_s=1.0)
    assert choice is not None and choice.model == "v"


def test_measured_queue_waits_fade_with_silence() -> None:
    t = [0.0]
    waits = QueueWaits(now=lambda: t[0], memory_s=10.0)
    for _ in range(5):
        waits.observe("m", P2, 4.0)
    assert waits.get("m", P2) == pytest.approx(4.0)
    assert waits.get("m", P0) == 0.0  # per class
    t[0] = 50.0
    assert waits.get("m", P2) < 0.05


KEYS = json.dumps({"keys": [{"key": "k", "tenant": "a", "max_priority": "P0"}]})


@pytest.fixture
async def gateway(gateway: GatewayFactory) -> tuple[httpx.AsyncClient, GatewayService, CollectorRegistry]:
    gw = await gateway(api_keys=KEYS, workers=FLEET,
                       models=[ModelEntry(id="big", max_model_len=8192, model_version="v", workers=1),
                               ModelEntry(id="small", max_model_len=2048, model_version="v", workers=1)])
    return gw.client, gw.service, gw.registry


async def _ask(client: httpx.AsyncClient, content: str, **extra: object) -> httpx.Response:
    return await client.post("/v1/chat/completions", headers={"Authorization": "Bearer k"},
                             json={"model": "auto", "messages": [{"role": "user", "content": content}],
                                   "max_tokens": 16, **extra})


async def test_the_gateway_routes_auto_before_admission_and_counts_the_choice(gateway) -> None:  # type: ignore[no-untyped-def]
    client, _, registry = gateway
    # routed to "small", then refused by the absent scheduler (503): the route came first
    assert_openai_error(await _ask(client, "hi"), 503)
    choices = "goodput_gateway_auto_choices_total"
    assert registry.get_sample_value(choices, {"model": "small", "pool": "l4", "reason": "cheapest_meeting_slo"}) == 1
    # a prompt only the big model's window holds
    assert_openai_error(await _ask(client, "word " * 2500), 503)
    assert registry.get_sample_value(choices, {"model": "big", "pool": "a100", "reason": "cheapest_meeting_slo"}) == 1
    # a prompt and output no model's window holds: a clear 400, not a guess
    resp = await _ask(client, "word " * 2500, max_tokens=6000)
    assert_openai_error(resp, 400, "messages")
    assert resp.json()["error"]["code"] == "context_length_exceeded"


async def test_auto_with_no_worker_serving_a_candidate_is_unavailable(gateway) -> None:  # type: ignore[no-untyped-def]
    client, service, _ = gateway
    service.pipeline.catalogue.pin(await service.pipeline.catalogue.models(),
                                   [status("big", "a100", cost=4.0, speed=A100_7B, healthy=False)])
    resp = await _ask(client, "hi")
    assert_openai_error(resp, 503)
    assert "auto" in resp.json()["error"]["message"]
