"""Overload: how fast queued work drains, one saturation number, which classes are shed, and when to retry.

* :class:`DrainRate` counts releases per second over a sliding window.
* :class:`OverloadDetector` turns queued work (in seconds of that drain rate), KV-cache usage and GPU utilisation
  into a saturation signal; with hysteresis it sheds P2 first, then P1. P0 is never shed by overload.
* :func:`retry_after_s` tells a refused caller when retrying is likely to succeed.

Example:
    >>> from goodput_scheduler.config import SchedulerSettings
    >>> detector = OverloadDetector(SchedulerSettings(max_inflight_per_worker=1, shed_p2_at=1.0, shed_p1_at=2.0,
    ...                                               shed_hysteresis=0.5))
    >>> detector.update(queued=1, drain_rate=0.0, workers=[])   # one slot's worth queued: P2 is shed
    1.0
    >>> detector.shedding == {P1: False, P2: True}
    True
    >>> detector.update(queued=0, drain_rate=0.0, workers=[])   # back under 1.0 - 0.5: P2 is admitted again
    0.0
    >>> detector.shedding[P2]
    False
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

from goodput_scheduler.clock import Clock, SystemClock
from goodput_scheduler.queues import P1, P2

if TYPE_CHECKING:
    from goodput_scheduler.config import SchedulerSettings
    from goodput_scheduler.registry import Worker

__all__ = ["MAX_RETRY_AFTER_S", "DrainRate", "OverloadDetector", "retry_after_s"]

MAX_RETRY_AFTER_S = 600.0


class DrainRate:
    """Requests finished per second over a sliding window: how fast queued work drains.

    >>> from goodput_scheduler.clock import ManualClock
    >>> d = DrainRate(window_s=10, clock=ManualClock())
    >>> d.rate(now=0.0)
    0.0
    >>> for t in (0.5, 1.0, 1.5, 2.0):
    ...     d.add(t)
    >>> d.rate(now=2.0)      # four releases in the two seconds since it started
    2.0
    """

    def __init__(self, *, window_s: float = 30.0, clock: Clock | None = None) -> None:
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque(maxlen=8192)
        self._since = (clock or SystemClock()).now()

    def add(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if not self._times:
            return 0.0
        span = min(self.window_s, max(now - self._since, 1.0))
        return len(self._times) / span


class OverloadDetector:
    """Saturation = max(queued work / what drains in ``saturation.queue_s``, mean KV usage / ``saturation.kv``,
    mean GPU utilisation / ``saturation.gpu``). Classes are shed from ``shed_p2_at`` (P2) and ``shed_p1_at`` (P1)
    and admitted again only below the threshold minus ``shed_hysteresis``, so admission does not flap. KV and GPU
    top out near 1.1, so alone they can shed P2 but never P1: only a growing queue does that."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.saturation = 0.0
        self.shedding: dict[int, bool] = {P1: False, P2: False}

    def update(self, *, queued: int, drain_rate: float, workers: Sequence[Worker]) -> float:
        s = self.settings
        slots = sum(w.lease_cap(s.max_inflight_per_worker) for w in workers)
        drainable = max(drain_rate * s.saturation.queue_s, float(slots), 1.0)
        sat = queued / drainable
        if workers:
            kv = sum(w.load.kv_cache_usage for w in workers) / len(workers)
            sat = max(sat, kv / s.saturation.kv)
            gpus = [w.load.gpu_utilization for w in workers if w.load.gpu_utilization >= 0]
            if gpus:
                sat = max(sat, sum(gpus) / len(gpus) / s.saturation.gpu)
        self.saturation = sat
        for prio, threshold in ((P2, s.shed_p2_at), (P1, s.shed_p1_at)):
            if sat >= threshold:
                self.shedding[prio] = True
            elif sat < threshold - s.shed_hysteresis:
                self.shedding[prio] = False
        return sat

    def sheds(self, prio: int) -> bool:
        return self.shedding.get(prio, False)

    def exit_level(self, prio: int) -> float:
        s = self.settings
        return (s.shed_p2_at if prio == P2 else s.shed_p1_at) - s.shed_hysteresis


def retry_after_s(*, ahead: int, rate: float, slots: int, shed_excess: float = 0.0,
                  queue_saturation_s: float = 5.0) -> float:
    """When retrying is likely to succeed: the ``ahead`` requests (those queued before a retry, and the retry)
    drained at the observed ``rate``; for a class shed by overload, at least the time for saturation to fall by
    ``shed_excess`` (how far it is above the class's re-admission level). Without an observed rate, one second per
    batch of ``slots``. Clamped to [0.5, 600] s (1 s at least without a rate).

    >>> retry_after_s(ahead=3, rate=10.0, slots=4)
    0.5
    >>> retry_after_s(ahead=30, rate=10.0, slots=4)
    3.0
    >>> retry_after_s(ahead=3, rate=0.0, slots=1)      # nothing finished lately
    3.0
    """
    if rate <= 0:
        return float(min(max(ahead / max(slots, 1), 1.0), MAX_RETRY_AFTER_S))
    wait = ahead / rate
    if shed_excess > 0:
        wait = max(wait, shed_excess * max(rate * queue_saturation_s, 1.0) / rate)
    return float(min(max(wait, 0.5), MAX_RETRY_AFTER_S))
