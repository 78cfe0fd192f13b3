"""One stream's events as it is produced (:class:`Recording`: the newest within the bounds, who follows them here, what
the shared store has yet to get), and the resume metrics."""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_gateway.resume.frames import End, Frame

__all__ = ["Budget", "Cursor", "Following", "Recording", "ResumeMetrics"]


class ResumeMetrics:
    def __init__(self, registry: CollectorRegistry | None, recordings: Callable[[], list[Recording]],
                 followers: Callable[[], int] = lambda: 0) -> None:
        self.resumes = Counter("goodput_gateway_stream_resumes_total", "Stream resumes asked for, by API (sse, grpc) "
                               "and outcome: resumed, not_found (unknown, another tenant's or expired), evicted (the "
                               "events after the caller's last one were dropped by the bounds), abandoned, limited "
                               "(RESUME__MAX_FOLLOWERS_PER_STREAM or _PER_TENANT reached: 429), invalid, disabled, "
                               "error (the store unavailable).", ["api", "outcome"], registry=registry)
        self.detached = Counter("goodput_gateway_stream_detached_total", "Streams whose client went away before "
                                "their end, by what became of the generation: finished (it ran to its end, for a "
                                "resume), abandoned (cut: nobody followed it for RESUME__WINDOW_S), failed.",
                                ["outcome"], registry=registry)
        self.buffered = Gauge("goodput_gateway_stream_buffer_bytes", "Bytes of stream events held in this process "
                              "for resumes (running streams; finished ones too without Redis); at most about "
                              "RESUME__MAX_TOTAL_BYTES.", registry=registry)
        self.buffered.set_function(lambda: sum(r.size for r in recordings()))
        self.streams = Gauge("goodput_gateway_stream_buffer_streams", "Streams recorded in this process (running; "
                             "finished ones too without Redis).", registry=registry)
        self.streams.set_function(lambda: len(recordings()))
        self.stored = Counter("goodput_gateway_stream_stored_bytes_total", "Bytes of stream events written to the "
                              "shared store (Redis).", registry=registry)
        self.overflows = Counter("goodput_gateway_stream_overflows_total", "Streams that passed RESUME__MAX_EVENTS or "
                                 "RESUME__MAX_BYTES (their oldest events were dropped).", registry=registry)
        self.errors = Counter("goodput_gateway_stream_store_errors_total", "Failed writes and reads of the shared "
                              "stream store, by operation.", ["op"], registry=registry)
        self.full = Counter("goodput_gateway_stream_buffer_full_total", "Times this process's recordings reached "
                            "RESUME__MAX_TOTAL_BYTES, by what gave way: unrecorded (a new stream was served without "
                            "a recording: not resumable), evicted (a finished stream kept here was forgotten before "
                            "its window), trimmed (a running stream dropped the events its clients had read: "
                            "resuming before them is 410).", ["action"], registry=registry)
        self.followers = Gauge("goodput_gateway_stream_followers", "Resumes following a stream in this process "
                               "(from its recording here or from Redis).", registry=registry)
        self.followers.set_function(followers)
        self.paced = Counter("goodput_gateway_stream_paced_seconds_total", "Seconds generations waited for a slow "
                             "client (flow control: it had RESUME__MAX_EVENTS or RESUME__MAX_BYTES to read).",
                             registry=registry)
        self.stalled = Counter("goodput_gateway_stream_stalled_total", "Clients let go because they read nothing "
                               "for RESUME__STALL_TIMEOUT_S while their generation waited for them.", registry=registry)


class Budget:
    """The bytes of events all the recordings of a process hold, against ``limit`` (RESUME__MAX_TOTAL_BYTES).

    >>> budget = Budget(100); budget.held = 100; budget.full
    True
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @property
    def full(self) -> bool:
        return self.held >= self.limit


@dataclass(eq=False)
class Cursor:
    """One follower of a recording: the number of the next event it wants, when it last moved on (or found nothing
    to read), whether the producer stopped waiting for it, whether it is gone; ``name``: a follower on another
    replica's (as of its last mark in Redis), "" for one in this process."""

    seq: int
    moved_at: float
    cut: bool = False
    gone: bool = False
    name: str = ""


class Recording:
    """One stream's events as produced, the newest within the bounds, and who follows them in this process. Events a
    follower (here, or elsewhere as its mark says) has yet to read are never dropped: the producer waits
    (:meth:`slowest`). A recording that is not ``resumable`` (RESUME__MAX_TOTAL_BYTES was reached when it began) keeps
    nothing its followers have read."""

    def __init__(self, key: str, stream_id: str, *, max_events: int, max_bytes: int, shared: bool, now: float,
                 tenant: str = "", budget: Budget | None = None, resumable: bool = True) -> None:
        self.key = key
        self.stream_id = stream_id
        self.tenant = tenant  # whose storage quota its place in the shared store counts against
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.budget = budget or Budget(1 << 62)
        self.resumable = resumable
        self.frames: deque[bytes] = deque()
        self.starts: deque[int] = deque()  # bytes added before each of frames (what a follower has yet to read)
        self.added = 0  # bytes added, ever
        self.first = 0  # the number of frames[0]
        self.next = 0  # the number of the next event
        self.size = 0  # bytes held
        self.overflowed = False
        self.trimmed = False  # it dropped events because the process reached its bound
        self.released = False  # forgotten: its bytes no longer count in the budget
        self.end: End | None = None
        self.ended_at = 0.0
        self.readers = 0  # followers in this process (the client's response first)
        self.cursors: set[Cursor] = set()  # the followers the producer waits for (here, and elsewhere: _remote)
        self._remote: dict[str, Cursor] = {}  # the followers on other replicas, by name, as of their last marks
        self._let_go: set[str] = set()  # those not waited for any more
        self.idle_since: float | None = now  # no follower here since then (None while one follows)
        self.left = False  # a follower went away before the end
        self.abandoned = False
        self.shared = shared
        self.pending: list[tuple[int, bytes]] = []  # recorded, not yet in the shared store
        self.stored_first = 0  # the shared store holds nothing older
        self.announced = False  # written to the shared store once
        self.end_stored = False
        self.task: asyncio.Task[None] | None = None
        self.source: AsyncIterator[bytes] | None = None
        self.closer: Callable[[], Awaitable[None]] | None = None
        self._wake = asyncio.Event()
        self._waiting = False
        self.moved = asyncio.Event()  # set when a follower here reads on or goes (the producer may go on)

    # ---- its followers here ----

    def attach(self, seq: int, now: float) -> Cursor:
        """A follower here, from event number ``seq``."""
        cursor = Cursor(seq, now)
        self.cursors.add(cursor)
        self.readers += 1
        self.idle_since = None
        return cursor

    def detach(self, cursor: Cursor, now: float) -> None:
        """The follower is gone (once, however it went)."""
        if cursor.gone:
            return
        cursor.gone = True
        self.cursors.discard(cursor)
        self.readers -= 1
        if self.readers == 0:
            self.idle_since = now
            if self.end is None:
                self.left = True
        self.moved.set()

    def read(self, cursor: Cursor, seq: int, now: float) -> None:
        """The follower moved on to event number ``seq`` (or found nothing to read: it is not the one waited for)."""
        cursor.seq, cursor.moved_at = seq, now
        self.moved.set()

    def let_go(self, cursor: Cursor) -> None:
        """The producer waits for this follower no more (it stalled): the events it has yet to read may be dropped."""
        cursor.cut = True
        self.cursors.discard(cursor)
        if cursor.name:
            self._let_go.add(cursor.name)

    def remote(self, marks: dict[str, tuple[int, float]], now: float) -> None:
        """The followers on other replicas, from their marks in Redis (name: the next event it wants, how many seconds
        ago it marked it): the producer waits for them as for the followers here; one already past the bounds is
        not (its events are gone)."""
        self.cursors.difference_update(self._remote.values())
        self._remote = {name: Cursor(seq, now - age, name=name) for name, (seq, age) in marks.items()
                        if name not in self._let_go and seq >= self.first}
        self.cursors.update(self._remote.values())
        self.moved.set()

    def slowest(self, size: int) -> Cursor | None:
        """The follower the next event (``size`` bytes) must wait for: one whose unread events fill the stream's
        bounds already. None when the event may be added (a follower that has read everything never waits it)."""
        if not self.cursors:
            return None
        slow = min(self.cursors, key=lambda c: c.seq)
        if slow.seq >= self.next:
            return None
        unread = self.added - self.starts[max(slow.seq - self.first, 0)]
        if self.next - slow.seq < self._max_events and unread + size <= self._max_bytes:
            return None
        return slow

    # ---- its events ----

    def add(self, data: bytes) -> bool:
        """Records the next event; True when it made the stream pass a bound (for the first time). The oldest events
        go past the bounds, none that a follower here has yet to read."""
        self.frames.append(data)
        self.starts.append(self.added)
        self.added += len(data)
        self.size += len(data)
        if not self.released:
            self.budget.held += len(data)
        if self.shared:
            self.pending.append((self.next, data))
        self.next += 1
        passed = False
        while self._droppable() and (len(self.frames) > self._max_events or self.size > self._max_bytes):
            self._drop()
            passed, self.overflowed = passed or not self.overflowed, True
        while not self.resumable and self._droppable():
            self._drop()
        self.notify()
        return passed

    def trim(self) -> bool:
        """While the process holds its bound of bytes: drops the events every follower has read (and the shared store
        has). True the first time it drops some."""
        trimmed = False
        while self.budget.full and self._droppable() and not (self.pending and self.pending[0][0] <= self.first):
            self._drop()
            trimmed = True
        first, self.trimmed = trimmed and not self.trimmed, self.trimmed or trimmed
        return first

    def release(self) -> None:
        """Forgotten by the process: its bytes count no more (a follower still reading it holds them a while)."""
        if not self.released:
            self.released = True
            self.budget.held -= self.size

    def _droppable(self) -> bool:
        """The oldest event held is one every follower here has read."""
        return bool(self.frames) and all(c.seq > self.first for c in self.cursors)

    def _drop(self) -> None:
        data = self.frames.popleft()
        self.starts.popleft()
        self.size -= len(data)
        if not self.released:
            self.budget.held -= len(data)
        self.first += 1
        if self.pending and self.pending[0][0] < self.first:
            self.pending = [p for p in self.pending if p[0] >= self.first]

    def since(self, seq: int) -> list[Frame] | None:
        """The events from number ``seq`` on; None when some of them were dropped."""
        if seq < self.first:
            return None
        return [Frame(s, d) for s, d in enumerate(itertools.islice(self.frames, seq - self.first, None), seq)]

    def notify(self) -> None:
        if self._waiting:
            self._waiting = False
            self._wake.set()
            self._wake = asyncio.Event()

    async def changed(self) -> None:
        self._waiting = True
        await self._wake.wait()


class Following(AsyncGenerator[Frame, None]):
    """A follower's events (``frames``, an async generator) that lets go of its place (``release``: idempotent) as it
    goes, however it goes: closed (even before its first event, when the generator's own ``finally`` never runs), at
    its end or error, or dropped unclosed."""

    def __init__(self, frames: AsyncGenerator[Frame, None], release: Callable[[], None]) -> None:
        self._frames = frames
        self._release = weakref.finalize(self, release)
        self._release.atexit = False

    async def asend(self, value: None) -> Frame:
        try:
            return await self._frames.asend(value)
        except BaseException:  # its end, its error, its cancel: it follows no more
            self._release()
            raise

    async def athrow(self, typ: Any, val: Any = None, tb: Any = None) -> Frame:
        try:
            return await (self._frames.athrow(typ) if val is None and tb is None
                          else self._frames.athrow(typ, val, tb))
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._frames.aclose()
        finally:
            self._release()
