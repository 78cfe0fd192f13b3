"""Progress, not just liveness: a worker whose engine has stopped producing tokens (hung, frozen, deadlocked) while
it still answers health checks must stop receiving work.

The servicer tells :class:`Progress` when a generation starts and ends and when any of them produces output from
the engine (a token, the end; not ``Started``, which the worker answers before the engine sees the request: new
requests still arriving at a hung engine must not pass for its progress). While generations are running and none
has made progress for ``stall_after_s``, the worker is *stalled*: the watchdog turns its health NOT_SERVING (the
scheduler ejects it at its next check and places nothing there; in a cluster the readiness probe takes it out of its
Service, so the EndpointSlice watch drains it), logs it and sets ``goodput_worker_stalled``; ``GetLoad`` reports the
seconds without progress (``WorkerLoad.stalled_s``). When a token comes again it turns SERVING. Idle is not
stalled.

    >>> t = [0.0]
    >>> p = Progress(stall_after_s=10.0, now=lambda: t[0])
    >>> p.begin(); t[0] = 5.0; p.advance(); t[0] = 14.0
    >>> p.stalled_s(), p.stalled()
    (0.0, False)
    >>> t[0] = 16.0
    >>> p.stalled_s(), p.stalled()
    (11.0, True)
    >>> p.end(); p.stalled()          # nothing running: idle, not stalled
    False
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("goodput.inference.progress")

__all__ = ["Progress"]


class Progress:
    def __init__(self, *, stall_after_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.stall_after_s = stall_after_s
        self._now = now
        self.active = 0
        self._last = now()

    def begin(self) -> None:
        if self.active == 0:  # idle time before it is not a stall
            self._last = self._now()
        self.active += 1

    def advance(self) -> None:
        self._last = self._now()

    def end(self) -> None:
        self.active = max(self.active - 1, 0)

    def stalled_s(self) -> float:
        """Seconds since the last output while generations run beyond the threshold's start (0 when idle)."""
        if self.active == 0:
            return 0.0
        quiet = self._now() - self._last
        return quiet if quiet > self.stall_after_s else 0.0

    def stalled(self) -> bool:
        return self.stall_after_s > 0 and self.stalled_s() > 0

    async def watch(self, on_change: Callable[[bool], Awaitable[None]], *, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: when the stalled state changes, logs it and calls ``on_change(stalled)``."""
        was = False
        while True:
            await asyncio.sleep(interval_s)
            now = self.stalled()
            if now == was:
                continue
            was = now
            if now:
                log.error("engine stalled: no output while generating; not serving until it makes progress",
                          extra={"stalled_s": round(self.stalled_s(), 1), "active": self.active})
            else:
                log.warning("engine making progress again: serving")
            await on_change(now)
