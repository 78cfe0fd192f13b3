"""Every built-in scorer gives every candidate a score in [0, 1], whatever the fleet looks like, so the profile's
weights mean what they say (a scorer of weight w moves a worker's total by at most w). The scorers are taken from
BUILTIN_PLUGINS, so a new one is held to the same bound without touching this test."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2

from goodput_contracts.speed import SpeedEstimate

from goodput_scheduler.clock import ManualClock
from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import BUILTIN_PLUGINS, CycleState, Observer, PlacementRequest, PluginHandle, Scorer
from goodput_scheduler.predict import DEFAULT_SPEED_PRIOR, WorkerSpeed
from goodput_scheduler.registry import Worker

P0, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P2
SCORERS = sorted(name for name, spec in BUILTIN_PLUGINS.items() if spec.kind == "scorer")
PROMPT = "You are the assistant of a bank; answer only questions about accounts and cards. " * 8


def worker(i: int, *, batch: int = 8, waiting: int = 0, kv: float = 0.0, leases: int = 0, prompt_tokens: int = 0,
           p0_prompt_tokens: int = 0, slower: float = 1.0) -> Worker:
    load = inference_pb2.WorkerLoad(max_num_seqs=batch, waiting=waiting, kv_cache_usage=kv, ready=True)
    w = Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True, load=load)
    for _ in range(leases):
        w.occupancy.hold(P2, prompt_tokens=prompt_tokens)
    if p0_prompt_tokens:
        w.occupancy.hold(P0, prompt_tokens=p0_prompt_tokens)
    w.speed = WorkerSpeed(DEFAULT_SPEED_PRIOR.scaled(slower))
    return w


def idle(n: int) -> list[Worker]:
    return [worker(i) for i in range(n)]


def heavily_loaded(n: int) -> list[Worker]:
    # past their caps (as without has_capacity), long engine queues, full KV caches
    return [worker(i, batch=4, waiting=10_000 * i, kv=1.0, leases=40 + i) for i in range(n)]


def long_prefill_queues(n: int) -> list[Worker]:
    return [worker(i, leases=3, prompt_tokens=200_000 * (i + 1), p0_prompt_tokens=50_000) for i in range(n)]


def mixed(n: int) -> list[Worker]:
    rng = random.Random(n)
    return [worker(i, batch=rng.choice([1, 16, 128]), waiting=rng.randrange(0, 500), kv=rng.random(),
                   leases=rng.randrange(0, 200), prompt_tokens=rng.randrange(0, 50_000),
                   p0_prompt_tokens=rng.choice([0, 300, 30_000]), slower=rng.choice([0.2, 1.0, 40.0]))
            for i in range(n)]


def unreported(n: int) -> list[Worker]:
    # workers that have not reported yet (batch size 0) and hold leases
    return [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True)
            for i in range(n)]


FLEETS: dict[str, Callable[[int], list[Worker]]] = {
    "idle": idle, "heavily_loaded": heavily_loaded, "long_prefill_queues": long_prefill_queues, "mixed": mixed,
    "unreported": unreported}
REQUESTS = {
    "plain": PlacementRequest("r", "acme", P2, "", 100, 10),
    "no_max_tokens": PlacementRequest("r", "acme", P0, "", 0, 0),
    "huge": PlacementRequest("r", "acme", P2, "", 1_000_000, 100_000),
    "prefix_and_session": PlacementRequest("r", "acme", P0, "", 500, 50, prefix_hint=PROMPT, session_id="chat-1"),
    "short_prefix": PlacementRequest("r", "acme", P0, "", 10, 10, prefix_hint="hi"),
}


def build(name: str) -> Scorer:
    spec = BUILTIN_PLUGINS[name]
    handle = PluginHandle(settings=SchedulerSettings(), rng=random.Random(0), clock=ManualClock())
    scorer = spec.build(spec.parse_parameters({}), handle)
    assert scorer.name == name and callable(scorer.score)
    return scorer


def assert_bounded(scores: list[float], n: int) -> None:
    assert len(scores) == n
    for s in scores:
        assert isinstance(s, float | int) and not math.isnan(s) and 0.0 <= s <= 1.0, scores


def test_every_builtin_scorer_is_covered() -> None:
    assert {"least_loaded", "least_prefill", "predicted_finish", "prefix_affinity", "session_affinity"} <= set(SCORERS)


@pytest.mark.parametrize("name", SCORERS)
@pytest.mark.parametrize("fleet", sorted(FLEETS))
@pytest.mark.parametrize("size", [1, 3, 64])
@pytest.mark.parametrize("request_kind", sorted(REQUESTS))
def test_scores_stay_within_zero_and_one(name: str, fleet: str, size: int, request_kind: str) -> None:
    scorer, workers, request = build(name), FLEETS[fleet](size), REQUESTS[request_kind]
    # first with nothing learned (an empty prefix index, no session seen)
    assert_bounded(scorer.score(CycleState(request, workers), workers), size)
    if isinstance(scorer, Observer):  # then with what affinity learned from earlier placements here
        for i, w in enumerate(workers[: min(size, 3)]):
            seen = PlacementRequest(f"seen-{i}", "acme", P0, "", 500, 50, prefix_hint=PROMPT[: 128 * (i + 1)],
                                    session_id="chat-1")
            scorer.observe(CycleState(seen, workers), w)
    assert_bounded(scorer.score(CycleState(request, workers), workers), size)
    # and over a subset of the candidates (a filter dropped some): the bound holds for any candidate set
    subset = workers[::2]
    assert_bounded(scorer.score(CycleState(request, workers), subset), len(subset))


@pytest.mark.parametrize("name", SCORERS)
def test_an_idle_worker_scores_at_least_as_well_as_a_busy_one(name: str) -> None:
    """1 = best: a worker holding nothing never scores below one that is loaded and prefilling."""
    scorer = build(name)
    free, busy = worker(0), worker(1, waiting=50, kv=0.9, leases=6, prompt_tokens=4000, p0_prompt_tokens=2000)
    scores = scorer.score(CycleState(REQUESTS["plain"], [free, busy]), [free, busy])
    assert scores[0] >= scores[1]


def test_load_scorers_keep_their_ranking_and_give_an_idle_worker_one() -> None:
    loaded = [worker(i, leases=i, waiting=3 * i, kv=0.1 * i, prompt_tokens=700 * i) for i in range(6)]
    for name in ("least_loaded", "least_prefill", "predicted_finish"):
        scores = build(name).score(CycleState(REQUESTS["plain"], loaded), loaded)
        assert scores[0] == 1.0 and scores == sorted(scores, reverse=True), (name, scores)
        assert len(set(scores)) == len(scores), (name, scores)  # distinct costs stay distinct


def test_a_slower_learned_speed_scores_lower_in_predicted_finish() -> None:
    fast, slow = worker(0), worker(1)
    slow.speed = WorkerSpeed(SpeedEstimate(prefill_s_per_token=0.001, tpot_base_s=0.05, tpot_per_seq_s=0.001))
    scores = build("predicted_finish").score(CycleState(REQUESTS["plain"], [fast, slow]), [fast, slow])
    assert scores[0] == 1.0 and 0.0 <= scores[1] < 1.0
