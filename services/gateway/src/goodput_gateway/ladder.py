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

**Who is the cause.** Each class has its own ladder, and so does each tenant in it: one tenant's traffic must not
degrade another's answers. At each move the ladder splits the class's finished requests by tenant. A tenant is
*the cause* when its own miss share is above ``raise_at`` while the rest of the class (without it) is at or below
``raise_at``: its own ladder takes the step (starting from where the class stands), and its requests count no more
for the class. The class's ladder moves on what is left, so it climbs only when the misses are spread over the
class (most tenants missing: fleet-wide overload) or cannot be told apart from it (a tenant alone in the
interval, requests of no tenant). A tenant's ladder comes back down, as the class's does, when its own share falls
below ``lower_at``; while misses are the class's, it holds. A request takes the higher of its class's and its
tenant's steps (and shed share). Memory: one entry per tenant on a ladder of its own (tenants come from the keys
file) and one count per tenant heard from in the current interval; a tenant back at the bottom is dropped, and so
is one not heard from for ``_IDLE_INTERVALS`` intervals (it is judged afresh when it comes back).

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

Tenant ``a`` misses while ``b`` meets its SLO: ``a`` climbs its own ladder, ``b`` and the class stay where they are:
    >>> for t in range(20, 22):
    ...     now[0] = t + 0.5
    ...     for _ in range(5):
    ...         ladder.observe(1, missed=True, tenant="a"); ladder.observe(1, missed=False, tenant="b")
    >>> ladder.active(1, "a"), ladder.active(1, "b"), ladder.level(1)
    (('skip_rerank', 'fewer_chunks'), (), 0)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_gateway.profile import LadderStep, LatencyProfile
from goodput_gateway.tenants import OTHER

__all__ = ["Ladder", "LadderMetrics"]

_PRIORITIES = {1: "P0", 2: "P1", 3: "P2"}
_SHED_STEP = 0.1
_SHED_MAX = 0.9
# A tenant not heard from for this many intervals (a minute at the default 2 s) is forgotten: whatever made it miss
# has had time to pass, and if it has not, its first interval back shows it again.
_IDLE_INTERVALS = 30


class LadderMetrics:
    """``labels``: a tenant's label value (bounded: :class:`~goodput_gateway.tenants.TenantLabels`); tenants that
    share one (``other``) show the highest of their levels."""

    def __init__(self, registry: CollectorRegistry | None,
                 labels: Callable[[str], str] = lambda tenant: OTHER) -> None:
        self.labels = labels
        self.taken = Counter("goodput_gateway_degradations_total", "Degradation-ladder steps applied to requests.",
                             ["step", "priority"], registry=registry)
        self.level = Gauge("goodput_gateway_ladder_level", "Steps of the degradation ladder in force per class "
                           "(0 = none).", ["priority"], registry=registry)
        self.shed_share = Gauge("goodput_gateway_ladder_shed_share", "Share of a class's requests the ladder's "
                                "shed step refuses.", ["priority"], registry=registry)
        self.tenant_level = Gauge("goodput_gateway_ladder_tenant_level", "Steps of a tenant's own degradation "
                                  "ladder (its requests missed their SLO while the rest of the class met theirs); "
                                  "the highest of the tenants sharing a label.", ["priority", "tenant"],
                                  registry=registry)
        self.tenant_shed_share = Gauge("goodput_gateway_ladder_tenant_shed_share", "Share of a tenant's requests "
                                       "its own ladder's shed step refuses (the highest of the tenants sharing a "
                                       "label).", ["priority", "tenant"], registry=registry)
        self.tenants = Gauge("goodput_gateway_ladder_tenants", "Tenants on a degradation ladder of their own.",
                             ["priority"], registry=registry)


@dataclass
class _Rung:
    """Where one ladder stands: a class's or a tenant's."""

    level: int = 0
    shed: float = 0.0


@dataclass
class _Tenant(_Rung):
    heard: float = 0.0  # when its requests were last judged


@dataclass
class _Class(_Rung):
    seen: int = 0
    missed: int = 0
    since: float = 0.0
    window: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [seen, missed] since `since`
    tenants: dict[str, _Tenant] = field(default_factory=dict)  # tenants on a ladder of their own
    labelled: set[str] = field(default_factory=set)  # tenant label values its metrics have shown


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

    def _own(self, priority: int, tenant: str) -> _Rung:
        """The tenant's own ladder (the bottom when it has none, or has been idle too long to keep it)."""
        state = self._of(priority)
        own = state.tenants.get(tenant)
        if own is None:
            return _Rung()
        if self.clock() - own.heard > _IDLE_INTERVALS * self.interval_s:
            del state.tenants[tenant]
            return _Rung()
        return own

    def level(self, priority: int, tenant: str | None = None) -> int:
        """The class's ladder, or with ``tenant`` that tenant's own."""
        return self._own(priority, tenant).level if tenant is not None else self._of(priority).level

    def shed_share(self, priority: int, tenant: str | None = None) -> float:
        return self._own(priority, tenant).shed if tenant is not None else self._of(priority).shed

    def active(self, priority: int, tenant: str = "") -> tuple[LadderStep, ...]:
        """The steps in force for a request of the class and tenant now: the higher of their two ladders (none when
        the ladder is off)."""
        if not self.enabled:
            return ()
        return self.steps(priority)[:max(self._of(priority).level, self._own(priority, tenant).level)]

    def sheds(self, priority: int, tenant: str = "") -> bool:
        """Whether this request is one the shed step refuses."""
        share = max(self._of(priority).shed, self._own(priority, tenant).shed)
        return self.enabled and "shed" in self.active(priority, tenant) and self.rand() < share

    def retry_after_s(self) -> float:
        return max(self.interval_s, 1.0)

    def observe(self, priority: int, *, missed: bool, tenant: str = "") -> None:
        """A finished request of the class (and tenant): whether it missed its SLO or ran a stage over budget."""
        if not self.enabled:
            return
        state = self._of(priority)
        state.seen += 1
        state.missed += int(missed)
        if tenant:
            counts = state.window.setdefault(tenant, [0, 0])
            counts[0] += 1
            counts[1] += int(missed)
        now = self.clock()
        if now - state.since < self.interval_s or state.seen < self.min_samples:
            return
        self._judge(priority, state, now)
        state.seen = state.missed = 0
        state.window.clear()
        state.since = now
        if self.metrics is not None:
            self._export(priority, state, self.metrics)

    def _judge(self, priority: int, state: _Class, now: float) -> None:
        """One move: each tenant that is the cause climbs its own ladder, then the class moves on the rest."""
        ladder = self.steps(priority)
        seen, missed = state.seen, state.missed
        for tenant, (own_seen, own_missed) in state.window.items():
            rest_seen, rest_missed = state.seen - own_seen, state.missed - own_missed
            share = own_missed / own_seen
            cause = share > self.raise_at and bool(rest_seen) and rest_missed / rest_seen <= self.raise_at
            own = state.tenants.get(tenant)
            if cause:
                seen, missed = seen - own_seen, missed - own_missed
                own = own or state.tenants.setdefault(tenant, _Tenant(level=state.level, shed=state.shed))
            if own is None:
                continue
            own.heard = now
            if cause or share < self.lower_at:  # while the misses are the class's, a tenant's own ladder holds
                self._move(own, share, ladder)
            if not own.level and not own.shed:
                del state.tenants[tenant]
        self._move(state, missed / seen if seen else 0.0, ladder)

    def _move(self, rung: _Rung, share: float, ladder: tuple[LadderStep, ...]) -> None:
        if share > self.raise_at:
            if rung.level < len(ladder):
                rung.level += 1
            if rung.level == len(ladder) and ladder[-1:] == ("shed",):
                rung.shed = round(min(rung.shed + _SHED_STEP, _SHED_MAX), 2)
        elif share < self.lower_at:
            if rung.shed > 0:
                rung.shed = round(max(rung.shed - _SHED_STEP, 0.0), 2)
            elif rung.level > 0:
                rung.level -= 1

    def _export(self, priority: int, state: _Class, metrics: LadderMetrics) -> None:
        name = _PRIORITIES.get(priority, "P1")
        metrics.level.labels(name).set(state.level)
        metrics.shed_share.labels(name).set(state.shed)
        metrics.tenants.labels(name).set(len(state.tenants))
        shown: dict[str, _Rung] = {}
        for tenant, own in state.tenants.items():
            top = shown.setdefault(metrics.labels(tenant), _Rung())
            top.level, top.shed = max(top.level, own.level), max(top.shed, own.shed)
        for label in state.labelled | shown.keys():  # a label no tenant holds any more goes back to 0
            top = shown.get(label, _Rung())
            metrics.tenant_level.labels(name, label).set(top.level)
            metrics.tenant_shed_share.labels(name, label).set(top.shed)
        state.labelled |= shown.keys()

    def taken(self, step: str, priority: int) -> None:
        if self.metrics is not None:
            self.metrics.taken.labels(step, _PRIORITIES.get(priority, "P1")).inc()
