"""Scheduling-level waste: worker-seconds in which a healthy worker had room for another lease while a request it
could serve waited in a queue.

``goodput_scheduler_idle_while_queued_seconds_total{priority}`` adds up, over time, the workers for which all of this
holds, and ``goodput_scheduler_queued_with_idle_workers`` is 1 while at least one does:

* the worker is healthy (and still registered);
* it has room: fewer leases than its cap (``Worker.lease_cap``: ``max_inflight_per_worker``, or the batch size
  its engine reports, as the ``has_capacity`` filter counts them) and, once it holds a lease, a KV cache below
  ``kv_full``: the room placement gives a P0 request;
* a request it could serve waits: one for a model it serves, or naming none, or the worker has not said yet (the
  ``serves_model`` filter's rule).

``priority`` is the most urgent class among those waiting requests, so a worker-second is counted once. A request
held back from the worker on purpose counts too: the class shares of the cap keep room for P0 (P1 is granted up to
``p1_max_share`` of it, P2 up to ``p2_max_share``), the latency guard bounds the P1/P2 leases of a worker, the prefill
gate holds batch prompts back while a P0 prompt is prefilled or the batch prefill budget is spent, and strict
priority keeps a class behind a more urgent one that cannot be placed. Their P1/P2 worker-seconds are the price of
protecting P0, which this counter shows. None of those rules holds P0 back from a worker with room, so P0
worker-seconds are plain waste: a P0 request behind another that no free worker can serve (head-of-line), or the
``fifo`` baseline's one queue.

Nothing polls: the lease manager calls :meth:`IdleWhileQueued.update` after every change of the queues, the leases
or the workers (admit, grant, release, first token, expiry, a health or load check), which adds the time since the
previous change, on the injected clock, with the state that held through it; a scrape reads :meth:`seconds`, which
adds the time since the last change with the state now.

Example:
    >>> from goodput_scheduler.queues import P1, P2
    >>> from goodput_scheduler.registry import Worker
    >>> t = [0.0]
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True) for i in range(3)]
    >>> idle = IdleWhileQueued(now=lambda: t[0], workers=lambda: workers, max_inflight=1, kv_full=0.97)
    >>> _ = workers[0].occupancy.hold(P1, prompt_tokens=10)     # w0 is full; w1 and w2 have room
    >>> workers[2].healthy = False                              # w2 is ejected
    >>> idle.queued(P2, model=""); idle.queued(P1, model=""); idle.update()
    >>> idle.idle_workers(), idle.active                        # w1, counted once, for P1 (the more urgent)
    ({'P1': 1}, True)
    >>> t[0] = 2.0
    >>> idle.seconds()                                          # a scrape: up to now
    {'P0': 0.0, 'P1': 2.0, 'P2': 0.0}
    >>> t[0] = 5.0
    >>> idle.left(P1, model=""); idle.left(P2, model=""); idle.update()      # both granted at 5.0
    >>> t[0] = 9.0
    >>> idle.seconds(), idle.active
    ({'P0': 0.0, 'P1': 5.0, 'P2': 0.0}, False)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from goodput_core.priority import priority_name

from goodput_scheduler.queues import CLASSES
from goodput_scheduler.registry import Worker

__all__ = ["IdleWhileQueued"]


class IdleWhileQueued:
    """Integrates, on ``now``, the number of healthy workers with room while a request they could serve waits (see the
    module's docstring for what counts). The lease manager tells it each request that joins a queue
    (:meth:`queued`) or leaves one (:meth:`left`), and calls :meth:`update` after every change; :meth:`seconds` is
    the counter's value."""

    def __init__(self, *, now: Callable[[], float], workers: Callable[[], Sequence[Worker]], max_inflight: int,
                 kv_full: float = 1.0) -> None:
        self._now = now
        self._workers = workers
        self.max_inflight = max_inflight
        self.kv_full = kv_full
        self._waiting: dict[int, collections.Counter[str]] = {}  # class -> model -> requests waiting
        self._idle: dict[int, int] = {}  # class -> workers idle while it was the most urgent they could serve
        self._since = now()
        self._totals: dict[int, float] = dict.fromkeys(CLASSES, 0.0)  # worker-seconds up to _since, by class

    # ---- what waits ------------------------------------------------------------------------------------------

    def queued(self, priority: int, *, model: str) -> None:
        """A request of this class for ``model`` ("" = any) joined a queue."""
        self._waiting.setdefault(priority, collections.Counter())[model] += 1

    def left(self, priority: int, *, model: str) -> None:
        """A request that :meth:`queued` counted left its queue (granted, dropped, cancelled or pushed out)."""
        models = self._waiting.get(priority)
        if not models or models[model] <= 0:
            return
        models[model] -= 1
        if not models[model]:
            del models[model]
        if not models:
            del self._waiting[priority]

    # ---- the integral ----------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Some healthy worker has room while a request it could serve waits (as of the last :meth:`update`)."""
        return bool(self._idle)

    def idle_workers(self) -> dict[str, int]:
        """Those workers now, by the most urgent class each could serve."""
        return {priority_name(p): n for p, n in sorted(self._idle.items())}

    def seconds(self) -> dict[str, float]:
        """Worker-seconds idle while work waited, by class, up to now (the state since the last update held)."""
        elapsed = max(self._now() - self._since, 0.0)
        totals = dict(self._totals)
        for priority, workers in self._idle.items():
            totals[priority] = totals.get(priority, 0.0) + elapsed * workers
        return {priority_name(p): s for p, s in sorted(totals.items())}

    def update(self) -> None:
        """Adds the time since the previous update with the state that held through it, then reads the state now."""
        now = self._now()
        elapsed = now - self._since
        if elapsed > 0:
            for priority, workers in self._idle.items():
                self._totals[priority] = self._totals.get(priority, 0.0) + elapsed * workers
            self._since = now
        self._idle = self._measure()

    def _measure(self) -> dict[int, int]:
        idle: dict[int, int] = {}
        if not self._waiting:
            return idle
        classes = sorted(self._waiting.items())  # most urgent first (P0 < P1 < P2)
        for w in self._workers():
            if not (w.placeable and self.has_room(w)):
                continue
            for priority, models in classes:
                if _serves(w, models):
                    idle[priority] = idle.get(priority, 0) + 1
                    break
        return idle

    def has_room(self, w: Worker) -> bool:
        """Fewer leases than the per-worker cap, and a KV cache below ``kv_full`` once it holds one (the
        ``has_capacity`` filter's room for P0, whose share is the whole cap)."""
        return w.inflight < w.lease_cap(self.max_inflight) and (w.inflight == 0 or w.load.kv_cache_usage < self.kv_full)


def _serves(w: Worker, models: collections.Counter[str]) -> bool:
    """``w`` could serve one of the requests waiting for ``models`` (the ``serves_model`` filter's rule)."""
    return "" in models or w.model is None or w.model.served_model_name in models
