"""Waiting for a condition another process or task brings about, instead of sleeping a guessed time.

Use these only where nothing can notify the test (another process, a store): a test of in-process code waits on
an event the code sets, or moves an injected clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout: float = 20.0, interval: float = 0.05,
               message: str = "condition not reached") -> T:
    """Calls ``predicate`` until it returns something truthy and returns that; fails the test (``AssertionError``)
    after ``timeout`` seconds, a guard against hangs, not a performance check.

    Example:
        >>> answers = iter([None, [], "ready"])
        >>> wait_until(lambda: next(answers), interval=0)
        'ready'
        >>> wait_until(lambda: False, timeout=0.01, message="the worker never came up")
        Traceback (most recent call last):
        ...
        AssertionError: the worker never came up (within 0.01 s)
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (within {timeout:g} s)")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], *, timeout: float = 20.0,
                           interval: float = 0.05, message: str = "condition not reached") -> T:
    """:func:`wait_until` for async tests: ``predicate`` may be a plain function or a coroutine function, and the
    event loop keeps running in between (the servers the test started in-process go on serving).

    Example:
        >>> async def job_done() -> str | None:
        ...     return "succeeded"
        >>> asyncio.run(async_wait_until(job_done))
        'succeeded'
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (within {timeout:g} s)")
        await asyncio.sleep(interval)
