"""The placement pipeline: one cycle per request runs the filters in order, the weighted scorers over the survivors,
then the picker; every step's latency goes to ``goodput_scheduler_placement_step_seconds{step}`` and every decision
carries its reason (the scorer that most set the chosen worker apart, or the filter that left it the only
candidate).

Example:
    >>> from goodput_scheduler.registry import Worker
    >>> from goodput_scheduler.placement import Healthy, LeastLoaded, PlacementRequest
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=i > 0) for i in range(3)]
    >>> _ = workers[1].occupancy.hold(1, prompt_tokens=10)
    >>> pipeline = PlacementPipeline(filters=[Healthy()], scorers=[(1.0, LeastLoaded())])
    >>> decision = pipeline.place(PlacementRequest("r1", "t", 1, "", 10, 10), workers)
    >>> decision.worker.worker_id, decision.reason
    ('w2', 'least_loaded')
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Histogram

from goodput_scheduler.placement.pickers import MaxScore
from goodput_scheduler.placement.plugins import (
    CycleState,
    Decision,
    Filter,
    Observer,
    Picker,
    PlacementRequest,
    Scorer,
)
from goodput_scheduler.registry import Worker

__all__ = ["STEP_BUCKETS", "PlacementPipeline"]

STEP_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class PlacementPipeline:
    def __init__(self, *, filters: Sequence[Filter], scorers: Sequence[tuple[float, Scorer]],
                 picker: Picker | None = None, registry: CollectorRegistry | None = None,
                 rng: random.Random | None = None) -> None:
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker or MaxScore(rng or random.Random())
        # the stateful steps, found once (an isinstance against a runtime Protocol costs microseconds per grant)
        self._observers = [step for step in [*self.filters, *(scorer for _, scorer in self.scorers)]
                           if isinstance(step, Observer)]
        self._step_seconds = Histogram(
            "goodput_scheduler_placement_step_seconds", "Time spent in each placement step.",
            ["step"], buckets=STEP_BUCKETS, registry=registry) if registry else None

    def _timed(self, step: str, start: float) -> None:
        if self._step_seconds is not None:
            self._step_seconds.labels(step).observe(time.perf_counter() - start)

    def candidates(self, state: CycleState) -> tuple[list[Worker], str]:
        """The workers that pass every filter, and the name of the last filter that turned one away."""
        out = list(state.fleet)
        narrowed_by = ""
        for f in self.filters:
            start = time.perf_counter()
            kept = f.filter(state, out)
            if len(kept) < len(out):
                narrowed_by = f.name
            out = kept
            self._timed(f"filter:{f.name}", start)
            if not out:
                break
        return out, narrowed_by

    def place(self, req: PlacementRequest, workers: Sequence[Worker]) -> Decision | None:
        """The best worker for the request, or None when no worker passes the filters. The decision's reason is
        the scorer that most set the worker apart, or the filter that left it the only candidate."""
        state = CycleState(req, workers)
        candidates, narrowed_by = self.candidates(state)
        if not candidates:
            return None
        if len(candidates) == 1 and narrowed_by:
            return Decision(worker=candidates[0], reason=narrowed_by, score=0.0, state=state)
        per_scorer: list[list[float]] = []
        for weight, scorer in self.scorers:
            start = time.perf_counter()
            per_scorer.append([weight * s for s in scorer.score(state, candidates)])
            self._timed(f"score:{scorer.name}", start)
        totals = [sum(col) for col in zip(*per_scorer, strict=True)] if per_scorer else [0.0] * len(candidates)
        start = time.perf_counter()
        score, chosen = self.picker.pick(state, list(zip(totals, candidates, strict=True)))
        self._timed(f"pick:{self.picker.name}", start)
        return Decision(worker=chosen, reason=self._reason(per_scorer, candidates.index(chosen)), score=score,
                        state=state)

    def _reason(self, per_scorer: list[list[float]], chosen: int) -> str:
        """The scorer that most set the chosen worker apart from the mean of the candidates."""
        if self.picker.name in ("round_robin", "random"):
            return self.picker.name
        best, reason = 1e-9, ""
        for (_, scorer), col in zip(self.scorers, per_scorer, strict=True):
            margin = col[chosen] - sum(col) / len(col)
            if margin > best:
                best, reason = margin, scorer.name
        return reason or (self.scorers[0][1].name if self.scorers else "first_fit")

    def commit(self, req: PlacementRequest, decision: Decision) -> None:
        """Tells stateful steps (affinity) where the request went."""
        state = decision.state if decision.state is not None else CycleState(req, [decision.worker])
        for step in self._observers:
            step.observe(state, decision.worker)
