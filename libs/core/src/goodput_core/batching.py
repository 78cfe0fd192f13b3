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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from goodput_core.errors import GoodputError, InvalidArgument

__all__ = ["batched", "event_batches", "feed", "take_batch", "unbatched"]

T = TypeVar("T")
B = TypeVar("B")
M = TypeVar("M")


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


async def batched(queue: asyncio.Queue[Any], *, limit: int, end: object,
                  wrap: Callable[[list[Any]], M]) -> AsyncGenerator[M, None]:
    """A stream's outgoing messages (a client's request iterator): what queued up behind the previous write, as one
    message ``wrap(items)``, until ``end`` is taken from ``queue`` (what came before it still goes out)."""
    while True:
        batch = await take_batch(queue, limit=limit, is_end=lambda item: item is end)
        closing = batch[-1] is end
        if closing:
            batch.pop()
        if batch:
            yield wrap(batch)
        if closing:
            return


async def event_batches(events: asyncio.Queue[Any], *, limit: int,
                        wrap: Callable[[list[Any]], M]) -> AsyncGenerator[M, None]:
    """A server's outgoing messages on a batched stream: the events that queued up behind the previous write, as one
    message ``wrap(events)``, until ``None`` (the caller closed its side: the stream ends OK) or an exception (the
    stream ends with it, after the events before it)."""
    while True:
        batch = await take_batch(events, limit=limit, is_end=_ends_stream)
        last = batch[-1]
        if _ends_stream(last):
            batch.pop()
        if batch:
            yield wrap(batch)
        if isinstance(last, Exception):
            raise last
        if last is None:
            return


async def unbatched(batches: AsyncIterator[B], *, items: Callable[[B], Sequence[T]], limit: int,
                    method: str) -> AsyncGenerator[T, None]:
    """A batched stream's incoming messages, one by one, in order; a batch of more than ``limit`` ends the stream
    (InvalidArgument, naming ``method`` and the MUX_MAX_BATCH setting that bounds it)."""
    async for batch in batches:
        got = items(batch)
        if len(got) > limit:
            raise InvalidArgument(f"a {method} message carries at most {limit} messages (MUX_MAX_BATCH); this one "
                                  f"carried {len(got)}", param="requests")
        for item in got:
            yield item


async def feed(requests: AsyncIterator[T], handle: Callable[[T], None], *, close: Callable[[], None],
               events: asyncio.Queue[Any]) -> None:
    """A server's reader of a batched stream: hands each incoming message to ``handle`` until the caller closes its
    side, then calls ``close()`` (give back what the stream holds) and ends ``events`` (see :func:`event_batches`)
    with ``None``, or with the error that refused the stream's own messages (a batch too large)."""
    end: Exception | None = None
    try:
        async for msg in requests:
            handle(msg)
    except GoodputError as err:
        end = err
    finally:
        close()
        events.put_nowait(end)


def _ends_stream(event: object) -> bool:
    return event is None or isinstance(event, Exception)
