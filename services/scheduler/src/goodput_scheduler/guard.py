"""The latency guard: how many P1/P2 leases one worker may hold so that P0's TTFT stays near its unloaded value,
and how many workers to keep free of P1/P2 prefill while P0 traffic is present.

Example:
    >>> from goodput_scheduler.clock import ManualClock
    >>> from goodput_scheduler.config import SchedulerSettings
    >>> clock = ManualClock(start=1000.0)
    >>> guard = LatencyGuard(SchedulerSettings(max_inflight_per_worker=20, guard={"min_samples": 4}), clock=clock)
    >>> guard.current()                 # P1's share of the cap
    18.0
    >>> for ttft in (0.10, 0.10, 0.10, 0.10):
    ...     guard.observe(ttft)         # unloaded P0: the baseline
    >>> guard.maybe_adjust(clock.now() + 1)
    False
    >>> for ttft in (0.40, 0.40, 0.40, 0.40):
    ...     guard.observe(ttft)         # P0 slowed down by lower-class work: halve the limit
    >>> guard.maybe_adjust(clock.now() + 2), guard.current()
    (False, 9)
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

from goodput_scheduler.clock import Clock, SystemClock
from goodput_scheduler.registry import DEFAULT_LEASE_CAP

if TYPE_CHECKING:
    from goodput_scheduler.config import SchedulerSettings

__all__ = ["P0_RATE_WINDOW_S", "P0_READY_PER_TTFT", "LatencyGuard"]

P0_RATE_WINDOW_S = 10.0  # the P0 arrival rate behind p0_reserve(): recent enough to follow a surge
# Decode-only workers grow with P0 traffic: as many as P0 requests expected within 3 unloaded P0 TTFTs (was the
# setting P0_READY_PER_TTFT). Settled by the overload benchmark: P0 bursts sharing one reserved worker left P0 p99 at
# 2.75x unloaded, two reserved 1.27x; with this rule P0 p99 at 3x load is 1.28x (loadtests/reports/overload.md).
P0_READY_PER_TTFT = 3.0


class LatencyGuard:
    """Keeps P0's TTFT near its unloaded value by adapting how many P1/P2 leases one worker may hold (AIMD).

    Lower-class work on a worker slows P0 there: its prompts' prefill chunks share the engine's steps, and its
    sequences make every decode step longer. Each ``interval_s`` the guard compares the ``percentile`` of the P0
    TTFTs the gateway reported (at the first token) with the target (``p0_ttft_target_s``, or ``p0_ttft_slo_ratio``
    x the unloaded P0 TTFT it learned: the lowest per-interval median of the last five minutes); all of these are
    the ``GUARD`` settings group (:class:`~goodput_scheduler.config.GuardSettings`). Above it, the P1/P2 limit
    shrinks by ``decrease``; otherwise it grows by one, up to the class shares' cap. Work the guard holds back
    queues, the queue raises the saturation signal, and P2 (then P1) is shed: batch work yields to interactive work
    in steps an operator can see (``goodput_scheduler_guard_limit``).
    """

    def __init__(self, settings: SchedulerSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings.guard  # the GUARD group
        self.clock = clock or SystemClock()
        self.enabled = self.settings.enabled and settings.queue_policy == "priority"
        cap = settings.max_inflight_per_worker or DEFAULT_LEASE_CAP  # a worker's own cap bounds it further
        self.max_limit = float(max(int(cap * max(settings.p1_max_share, settings.p2_max_share)), 1))
        self.limit = self.max_limit
        self.baseline: float | None = None
        self._samples: list[float] = []
        self._medians: collections.deque[tuple[float, float]] = collections.deque(maxlen=600)
        self._last = self.clock.now()
        self._last_p0 = -math.inf
        self._p0_arrivals: collections.deque[float] = collections.deque(maxlen=10_000)

    def current(self) -> float:
        return self.limit if self.enabled else math.inf

    def note_p0(self, now: float) -> None:
        """A P0 request arrived (interactive traffic is present: keep a worker ready for it)."""
        self._last_p0 = now
        self._p0_arrivals.append(now)
        while now - self._p0_arrivals[0] > P0_RATE_WINDOW_S:
            self._p0_arrivals.popleft()

    def p0_rate(self, now: float) -> float:
        """P0 arrivals per second over the last ``P0_RATE_WINDOW_S`` (reads only: a metrics scrape calls it too)."""
        stale = 0  # arrivals are in order and pruned at each arrival: only the head can be out of the window
        for t in self._p0_arrivals:
            if now - t <= P0_RATE_WINDOW_S:
                break
            stale += 1
        return (len(self._p0_arrivals) - stale) / P0_RATE_WINDOW_S

    def p0_reserve(self) -> int:
        """Workers to keep free of P1/P2 prefill now: 0 without recent P0 traffic, else ``p0_ready_workers``, or
        more when P0 requests arrive faster than one decode-only worker can start them one step each (P0 requests
        expected within :data:`P0_READY_PER_TTFT` unloaded P0 TTFTs). The gate never reserves every worker."""
        s = self.settings
        if s.p0_ready_workers <= 0 or not self.p0_recent():
            return 0
        expected = 0
        if self.baseline is not None:
            expected = math.ceil(self.p0_rate(self.clock.now()) * self.baseline * P0_READY_PER_TTFT)
        return max(s.p0_ready_workers, expected)

    def p0_recent(self) -> bool:
        return self.enabled and self.clock.now() - self._last_p0 < self.settings.p0_recent_s

    def observe(self, ttft_s: float) -> None:
        if self.enabled and ttft_s > 0:
            self._samples.append(ttft_s)

    def target(self) -> float | None:
        if self.settings.p0_ttft_target_s > 0:
            return self.settings.p0_ttft_target_s
        return None if self.baseline is None else self.baseline * self.settings.p0_ttft_slo_ratio

    def maybe_adjust(self, now: float) -> bool:
        """Returns True when the limit grew (queued work may now fit). A decision waits for ``min_samples`` P0
        TTFTs (at most ten intervals), so sparse P0 traffic still gets a verdict."""
        s = self.settings
        elapsed = now - self._last
        if not self.enabled or elapsed < s.interval_s:
            return False
        if 0 < len(self._samples) < s.min_samples and elapsed < 10 * s.interval_s:
            return False  # keep collecting
        samples, self._samples, self._last = sorted(self._samples), [], now
        before = self.limit
        if len(samples) >= 3:
            self._medians.append((now, samples[len(samples) // 2]))
            while self._medians and now - self._medians[0][0] > 300:
                self._medians.popleft()
            self.baseline = min(m for _, m in self._medians)
        target = self.target()
        if samples and target is not None:
            observed = samples[min(int(len(samples) * s.percentile), len(samples) - 1)]
            if observed > target:
                self.limit = max(1.0, math.floor(self.limit * s.decrease))
                return False
        self.limit = min(self.max_limit, self.limit + 1.0)
        return self.limit > before
