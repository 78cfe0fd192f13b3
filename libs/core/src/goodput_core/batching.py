"""Group commit for a gRPC stream's messages: what queued up while the previous message was being written goes out
as one.

A grpc.aio stream takes one message at a time and does not start the next write before the previous one completed
(its completion comes back through grpc's poller thread and the event loop). Messages written one by one therefore
queue behind each other under load, each waiting a full write; taken in batches, a busy stream's messages wait for
at most one write, and an idle one's go out alone, at once (no timer, no added latency).

Example (in a coroutine)::

    while True:
        batch = await take_batch(queue, limit=256, is_end=lambda item: item is None)
        ended = batch[-1] is None
        if ended:
            batch.pop()
        if batch:
            await call.write(Batch(items=batch))
        if ended:
            break
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

__all__ = ["take_batch"]

T = TypeVar("T")


async def take_batch(queue: asyncio.Queue[T], *, limit: int,
                     is_end: Callable[[T], bool] = lambda item: False) -> list[T]:
    """Waits for ``queue``'s next item, then takes what else is already there, up to ``limit`` items, and up to and
    including an item that ends the stream (``is_end``: it is then the last one; what follows it stays queued).

    >>> q: asyncio.Queue[int] = asyncio.Queue()
    >>> for i in (1, 2, 0, 3):
    ...     q.put_nowait(i)
    >>> asyncio.run(take_batch(q, limit=10, is_end=lambda i: i == 0)), q.qsize()
    ([1, 2, 0], 1)
    """
    batch = [await queue.get()]
    while len(batch) < limit and not is_end(batch[-1]):
        try:
            batch.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            break
    return batch
