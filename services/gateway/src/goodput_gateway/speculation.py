"""Speculative start (``SPECULATIVE_START``, opt-in): a request's worker call starts while its lease is being
granted, on the worker the scheduler granted last for the same model, class and session, where that worker had
slots to spare; the grant confirms the guess or cancels the early call (:meth:`Speculation.drop`), and a (model,
class) whose guesses are lately wrong is guessed for only now and then."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache

from goodput_gateway.config import GatewaySettings
from goodput_gateway.metrics import GatewayMetrics

__all__ = ["HEAD_START_S", "MAX_INFLIGHT", "MIN_FREE_SLOTS", "Early", "Speculation"]

# Guesses only where the lease will very likely be granted at once, not queued: a worker with this many lease slots
# left at its latest grant (the scheduler says so in every grant).
MIN_FREE_SLOTS = 4
# ... and only while the gateway has at most this many requests in flight (the new one included): a bound on the
# work wrong guesses can cost at once.
MAX_INFLIGHT = 256

# Speculative start: a grant older than this is no guess for the next one (the fleet may have changed); at most this
# many guesses kept (one per model and class, and per session with SESSION affinity); a (model, class) is guessed
# for while its recent hit rate (an exponential average, weight _HIT_WEIGHT) is at least _HIT_FLOOR, and below it
# one eligible request in _PROBE_EVERY still is (so a guess that turned good again is found again).
_HINT_TTL_S = 30.0
_HINTS_MAX = 10_000
_HIT_WEIGHT = 0.2
_HIT_FLOOR = 0.7
_PROBE_EVERY = 10
# An early worker call is given this long (at most) to be accepted by its worker before the lease is asked for.
HEAD_START_S = 0.005


@dataclass
class Early:
    """A worker call started before its grant, on ``address``; its task gives (call, start, span)."""

    address: str
    task: asyncio.Task[Any]
    queued: bool = False  # the scheduler queued the lease: the early call was cancelled then (never run unadmitted)

    def on_queued(self) -> None:
        self.queued = True
        self.task.cancel()


class Speculation:
    """The guesses: (model, class, session) -> the last grant's (worker id, address), each worker's free slots at
    its latest grant, and the hit rate and probe count per (model, class)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self._hints: TTLCache[tuple[str, int, str], tuple[str, str]] = TTLCache(maxsize=_HINTS_MAX, ttl=_HINT_TTL_S)
        self._hit_rate: dict[tuple[str, int], float] = {}
        # worker address -> the lease slots it had left at its latest grant (any request's): a speculative start goes
        # only where the scheduler will very likely grant the lease at once
        self._free_slots: TTLCache[str, int] = TTLCache(maxsize=_HINTS_MAX, ttl=_HINT_TTL_S)
        self._probes: dict[tuple[str, int], int] = {}

    def granted(self, model: str, priority: int, affinity: str, *, worker_id: str, address: str,
                free_slots: int) -> None:
        self._hints[(model, priority, affinity)] = (worker_id, address)
        self._free_slots[address] = free_slots

    def guess(self, model: str, priority: int, affinity: str, *, inflight: int) -> tuple[str, str] | None:
        """The (worker id, address) to start early on, when the last grant of (model, class, session) is recent, its
        worker had slots to spare at its latest grant, the gateway's in-flight requests are within bounds and such
        guesses have lately been right; None otherwise."""
        if not self.settings.speculative_start or inflight > MAX_INFLIGHT:
            return None
        hint = self._hints.get((model, priority, affinity))
        if hint is None or self._free_slots.get(hint[1], 0) < MIN_FREE_SLOTS:
            return None
        key = (model, priority)
        if self._hit_rate.get(key, 1.0) < _HIT_FLOOR:  # lately wrong (an idle fleet of equals, spread at random)
            self._probes[key] = self._probes.get(key, 0) + 1
            if self._probes[key] % _PROBE_EVERY:
                return None
        return hint

    def judge(self, model: str, priority: int, *, hit: bool) -> None:
        """A guess's outcome in its (model, class)'s hit rate: granted elsewhere, queued or refused is a miss."""
        key = (model, priority)
        self._hit_rate[key] = (1 - _HIT_WEIGHT) * self._hit_rate.get(key, 1.0) + _HIT_WEIGHT * hit

    async def drop(self, early: Early, why: str) -> None:
        """Cancels an early worker call that the grant did not confirm: the worker aborts it."""
        self.metrics.speculative_starts.labels(why).inc()
        if not early.task.done():
            early.task.cancel()  # the worker start cancels its call and ends its span on the way out
        try:
            call, _, span = await early.task
        except (asyncio.CancelledError, Exception):  # whatever the early call met, nobody waits for it
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # this request itself is being cancelled
                raise
            return
        call.cancel()
        span.set_attribute("goodput.speculative", why)
        span.end()
