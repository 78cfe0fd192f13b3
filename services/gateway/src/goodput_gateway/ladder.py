"""The degradation ladder: per class, the platform gives up quality before it gives up answers, and answers before
it gives up its SLO. Its steps, in the order the latency profile lists them (:mod:`goodput_gateway.profile`):

``skip_rerank``       RAG without the cross-encoder pass (the retrieval leg's slowest part).
``fewer_chunks``      half the chunks and half the context: a cheaper retrieval and a shorter prefill.
``exact_cache_only``  the cache answers exact repeats only; its semantic layer (an embedding) is skipped.
``fallback_model``    the class's fallback model, where the profile names one.
``shed``              a share of the class's requests is refused with 429 + Retry-After, so the rest meet the SLO.

A :class:`Ladder` climbs when a class's recent requests miss their SLO or run a stage over its budget, and comes
back down when they stop: every ``interval_s`` it looks at the requests finished since its last move; a miss share
above ``raise_at`` takes the next step (at ``shed``, sheds 10 % more, up to 90 %); below ``lower_at`` it sheds
10 % less, then steps back. A single request whose time left cannot cover its retrieval budget takes the RAG steps
on its own. A dependency whose circuit breaker is open is the other trigger (the gateway refuses the hop at once).

    >>> from goodput_gateway.profile import LatencyProfile
    >>> now = [0.0]
    >>> ladder = Ladder(LatencyProfile(), clock=lambda: now[0], interval_s=1.0, min_samples=4)
    >>> for _ in range(4):
    ...     ladder.observe(1, missed=True)
    >>> now[0] = 1.5; ladder.observe(1, missed=True)
    >>> ladder.level(1), ladder.active(1)
    (1, ('skip_rerank',))
    >>> for t in range(2, 20):
    ...     now[0] = t + 0.5
    ...     for _ in range(5):
    ...         ladder.observe(1, missed=False)
    >>> ladder.level(1), ladder.shed_share(1)
    (0, 0.0)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_gateway.profile import LadderStep, LatencyProfile

__all__ = ["Ladder", "LadderMetrics"]

_PRIORITIES = {1: "P0", 2: "P1", 3: "P2"}
_SHED_STEP = 0.1
_SHED_MAX = 0.9


class LadderMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.taken = Counter("goodput_gateway_degradations_total", "Degradation-ladder steps applied to requests.",
                             ["step", "priority"], registry=registry)
        self.level = Gauge("goodput_gateway_ladder_level", "Steps of the degradation ladder in force per class "
                           "(0 = none).", ["priority"], registry=registry)
        self.shed_share = Gauge("goodput_gateway_ladder_shed_share", "Share of a class's requests the ladder's "
                                "shed step refuses.", ["priority"], registry=registry)


@dataclass
class _Class:
    level: int = 0
    shed: float = 0.0
    seen: int = 0
    missed: int = 0
    since: float = 0.0


@dataclass
class Ladder:
    profile: LatencyProfile
    clock: Callable[[], float] = time.monotonic
    metrics: LadderMetrics | None = None
    enabled: bool = True
    interval_s: float = 2.0
    min_samples: int = 10
    raise_at: float = 0.1
    lower_at: float = 0.02
    rand: Callable[[], float] = random.random
    # Whether a step can change anything for a class here (no fallback model configured, no semantic cache, no
    # rerank asked for: the step is passed over rather than spending an interval on it).
    applies: Callable[[int, str], bool] = lambda priority, step: True
    _classes: dict[int, _Class] = field(default_factory=dict)

    def steps(self, priority: int) -> tuple[LadderStep, ...]:
        """The class's ladder as it applies here, in order."""
        return tuple(s for s in self.profile.of(priority).ladder if self.applies(priority, s))

    def _of(self, priority: int) -> _Class:
        state = self._classes.get(priority)
        if state is None:
            state = self._classes[priority] = _Class(since=self.clock())
        return state

    def level(self, priority: int) -> int:
        return self._of(priority).level

    def shed_share(self, priority: int) -> float:
        return self._of(priority).shed

    def active(self, priority: int) -> tuple[LadderStep, ...]:
        """The steps in force for a class now (none when the ladder is off)."""
        if not self.enabled:
            return ()
        return self.steps(priority)[:self._of(priority).level]

    def sheds(self, priority: int) -> bool:
        """Whether this request is one the shed step refuses."""
        state = self._of(priority)
        return self.enabled and "shed" in self.active(priority) and self.rand() < state.shed

    def retry_after_s(self) -> float:
        return max(self.interval_s, 1.0)

    def observe(self, priority: int, *, missed: bool) -> None:
        """A finished request of the class: whether it missed its SLO or ran a stage over budget."""
        if not self.enabled:
            return
        state = self._of(priority)
        state.seen += 1
        state.missed += int(missed)
        now = self.clock()
        if now - state.since < self.interval_s or state.seen < self.min_samples:
            return
        share = state.missed / state.seen
        ladder = self.steps(priority)
        if share > self.raise_at:
            if state.level < len(ladder):
                state.level += 1
            if state.level == len(ladder) and ladder[-1:] == ("shed",):
                state.shed = min(state.shed + _SHED_STEP, _SHED_MAX)
        elif share < self.lower_at:
            if state.shed > 0:
                state.shed = max(state.shed - _SHED_STEP, 0.0)
            elif state.level > 0:
                state.level -= 1
        state.seen = state.missed = 0
        state.since = now
        if self.metrics is not None:
            name = _PRIORITIES.get(priority, "P1")
            self.metrics.level.labels(name).set(state.level)
            self.metrics.shed_share.labels(name).set(state.shed)

    def taken(self, step: str, priority: int) -> None:
        if self.metrics is not None:
            self.metrics.taken.labels(step, _PRIORITIES.get(priority, "P1")).inc()
