"""The scheduler's clock, passed in: queue deadlines, drain rates, the latency guard's intervals and the dispatcher's
tick all read it, so tests drive time instead of sleeping.

:class:`SystemClock` is ``time.monotonic`` and ``asyncio.sleep``; :class:`ManualClock` only moves when told to,
waking the sleepers that fall due, in order.

Example:
    >>> import asyncio
    >>> async def demo() -> list[float]:
    ...     clock = ManualClock(start=100.0)
    ...     woke: list[float] = []
    ...     async def sleeper() -> None:
    ...         await clock.sleep(5)
    ...         woke.append(clock.now())
    ...     task = asyncio.create_task(sleeper())
    ...     await clock.advance(4.9)          # not yet due
    ...     await clock.advance(0.1)          # due: the sleeper wakes at 105.0
    ...     await task
    ...     return woke
    >>> asyncio.run(demo())
    [105.0]
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """Monotonic seconds and a sleep on the same time line."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only through :meth:`advance` (tests, doctests, simulations).

    ``sleep`` parks the caller until the clock reaches its wake-up time; ``advance`` steps to each due wake-up in
    turn, lets the woken tasks run until they wait again (so a loop that sleeps again within the step is woken
    again), and ends at the target time.
    """

    def __init__(self, *, start: float = 0.0, settle_rounds: int = 8) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._settle_rounds = settle_rounds

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(seconds, 0.0), next(self._seq), future))
        await future

    async def advance(self, seconds: float) -> None:
        target = self._now + max(seconds, 0.0)
        await self._settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            wake_at, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, wake_at)
            if not future.done():
                future.set_result(None)
                await self._settle()
        self._now = target
        await self._settle()

    async def _settle(self) -> None:
        """Gives woken tasks a few turns of the event loop to run up to their next wait."""
        for _ in range(self._settle_rounds):
            await asyncio.sleep(0)
