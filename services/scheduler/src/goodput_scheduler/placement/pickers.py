"""Pickers: ``max_score`` (random among equals), ``round_robin`` (by worker id, ignoring scores), ``random``.

Example:
    >>> import random
    >>> from goodput_scheduler.registry import Worker
    >>> from goodput_scheduler.placement import CycleState, PlacementRequest
    >>> a, b = (Worker(worker_id=i, address=i, channel=None) for i in ("a", "b"))
    >>> state = CycleState(PlacementRequest("r1", "t", 1, "", 10, 10), [a, b])
    >>> MaxScore(random.Random(0)).pick(state, [(0.5, a), (0.9, b)])[1].worker_id
    'b'
    >>> rr = RoundRobin()
    >>> [rr.pick(state, [(0.5, b), (0.9, a)])[1].worker_id for _ in range(3)]
    ['a', 'b', 'a']
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from goodput_scheduler.placement.plugins import CycleState, ScoredWorker

__all__ = ["MaxScore", "RandomPick", "RoundRobin"]


class MaxScore:
    """The highest score; random among equals, which spreads an idle fleet evenly."""

    name = "max_score"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, state: CycleState, scored: Sequence[ScoredWorker]) -> ScoredWorker:
        best = max(score for score, _ in scored)
        return self.rng.choice([(s, w) for s, w in scored if s >= best - 1e-9])


class RoundRobin:
    """Each worker in turn, by worker id; scores are ignored."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, state: CycleState, scored: Sequence[ScoredWorker]) -> ScoredWorker:
        ordered = sorted(scored, key=lambda sw: sw[1].worker_id)
        return ordered[next(self._counter) % len(ordered)]


class RandomPick:
    """Any of the candidates, uniformly; scores are ignored."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, state: CycleState, scored: Sequence[ScoredWorker]) -> ScoredWorker:
        return self.rng.choice(list(scored))
