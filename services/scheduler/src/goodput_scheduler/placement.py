"""Placement as a pipeline of small steps: filters drop workers that cannot take the request, scorers rate the rest
(higher is better, weighted), a picker chooses. New policies (prefix or session affinity) are new steps, not
changes to the scheduler.

Example:
    >>> pipeline = PlacementPipeline(filters=[healthy, serves_model, has_capacity(64)],
    ...                              scorers=[(1.0, least_loaded(kv_weight=1.0, queue_weight=1.0))])
    >>> decision = pipeline.place(request, registry.all())
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from goodput_core.metrics import LATENCY_BUCKETS

from goodput_scheduler.registry import Worker


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    tenant: str
    priority: int
    model: str
    prompt_tokens: int
    max_tokens: int
    prefix_hint: str = ""
    session_id: str = ""


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str
    score: float


Filter = Callable[[PlacementRequest, Worker], bool]
Scorer = Callable[[PlacementRequest, Worker], float]


def healthy(_: PlacementRequest, w: Worker) -> bool:
    return w.healthy and not w.removed


def serves_model(req: PlacementRequest, w: Worker) -> bool:
    return not req.model or w.model is None or w.model.served_model_name == req.model


def has_capacity(max_inflight: int) -> Filter:
    def _filter(_: PlacementRequest, w: Worker) -> bool:
        return w.inflight < max_inflight
    _filter.__name__ = "has_capacity"
    return _filter


def least_loaded(*, kv_weight: float, queue_weight: float) -> Scorer:
    """Fewer leases held (relative to the engine's batch size), a shorter engine queue and a freer KV cache
    score higher. Leases held are counted by the scheduler itself, so they are never stale."""

    def _score(_: PlacementRequest, w: Worker) -> float:
        cap = w.capacity
        return -(w.inflight / cap + queue_weight * w.load.waiting / cap + kv_weight * w.load.kv_cache_usage)
    _score.__name__ = "least_loaded"
    return _score


class PlacementPipeline:
    def __init__(self, *, filters: Sequence[Filter], scorers: Sequence[tuple[float, Scorer]],
                 registry: CollectorRegistry | None = None, rng: random.Random | None = None) -> None:
        self.filters = list(filters)
        self.scorers = list(scorers)
        self._rng = rng or random.Random()
        self._step_seconds = Histogram("goodput_scheduler_placement_step_seconds", "Time per placement step.",
                                       ["step"], buckets=LATENCY_BUCKETS, registry=registry) if registry else None

    def _timed(self, step: str, start: float) -> None:
        if self._step_seconds is not None:
            self._step_seconds.labels(step).observe(time.perf_counter() - start)

    def candidates(self, req: PlacementRequest, workers: Sequence[Worker]) -> list[Worker]:
        start = time.perf_counter()
        out = [w for w in workers if all(f(req, w) for f in self.filters)]
        self._timed("filter", start)
        return out

    def place(self, req: PlacementRequest, workers: Sequence[Worker]) -> Decision | None:
        """The best worker for the request, or None when no worker passes the filters."""
        candidates = self.candidates(req, workers)
        if not candidates:
            return None
        start = time.perf_counter()
        scored = [(sum(weight * scorer(req, w) for weight, scorer in self.scorers), w) for w in candidates]
        self._timed("score", start)
        start = time.perf_counter()
        best = max(score for score, _ in scored)
        ties = [w for score, w in scored if score >= best - 1e-9]
        chosen = self._rng.choice(ties)  # random among equals spreads an idle fleet evenly
        self._timed("pick", start)
        reason = self.scorers[0][1].__name__ if self.scorers else "first_fit"
        return Decision(worker=chosen, reason=reason, score=best)
