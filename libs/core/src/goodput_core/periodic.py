"""A step that runs every few seconds on the event loop, off the request path, until stopped; one failed step is
logged and the next one runs as planned.

    >>> import asyncio
    >>> async def demo() -> int:
    ...     ticks = []
    ...     async def step() -> None:
    ...         ticks.append(1)
    ...     job = Periodic(step, interval_s=0.01, name="demo")
    ...     job.start()
    ...     while len(ticks) < 3:
    ...         await asyncio.sleep(0.01)
    ...     await job.stop()
    ...     return len(ticks) >= 3 and not job.running
    >>> asyncio.run(demo())
    True
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["Periodic"]

log = logging.getLogger("goodput.periodic")


class Periodic:
    """Awaits ``step()`` every ``interval_s`` (after each one ends) from :meth:`start` until :meth:`stop`."""

    def __init__(self, step: Callable[[], Awaitable[object]], *, interval_s: float, name: str) -> None:
        self.step = step
        self.interval_s = interval_s
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - one failed step must not end the loop
                log.exception("periodic step failed", extra={"job": self.name})

    def start(self) -> None:
        """Starts the loop on the running event loop (again after :meth:`stop`; a no-op while it runs)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancels the loop and waits for it to end (a step in progress is cancelled)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
