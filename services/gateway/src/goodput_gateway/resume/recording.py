"""One stream's events as it is produced (:class:`Recording`: the newest within the bounds, who follows them here, what
the shared store has yet to get), and the resume metrics."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_gateway.resume.frames import End, Frame

__all__ = ["Recording", "ResumeMetrics"]


class ResumeMetrics:
    def __init__(self, registry: CollectorRegistry | None, recordings: Callable[[], list[Recording]]) -> None:
        self.resumes = Counter("goodput_gateway_stream_resumes_total", "Stream resumes asked for, by API (sse, grpc) "
                               "and outcome: resumed, not_found (unknown, another tenant's or expired), evicted (the "
                               "events after the caller's last one were dropped by the bounds), abandoned, invalid, "
                               "disabled, error (the store unavailable).", ["api", "outcome"], registry=registry)
        self.detached = Counter("goodput_gateway_stream_detached_total", "Streams whose client went away before "
                                "their end, by what became of the generation: finished (it ran to its end, for a "
                                "resume), abandoned (cut: nobody followed it for RESUME__WINDOW_S), failed.",
                                ["outcome"], registry=registry)
        self.buffered = Gauge("goodput_gateway_stream_buffer_bytes", "Bytes of stream events held in this process "
                              "for resumes (running streams; finished ones too without Redis).", registry=registry)
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


class Recording:
    """One stream's events as produced, the newest within the bounds, and who follows them in this process."""

    def __init__(self, key: str, stream_id: str, *, max_events: int, max_bytes: int, shared: bool, now: float,
                 tenant: str = "") -> None:
        self.key = key
        self.stream_id = stream_id
        self.tenant = tenant  # whose storage quota its place in the shared store counts against
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.frames: deque[bytes] = deque()
        self.first = 0  # the number of frames[0]
        self.next = 0  # the number of the next event
        self.size = 0  # bytes held
        self.overflowed = False
        self.end: End | None = None
        self.ended_at = 0.0
        self.readers = 0  # followers in this process (the client's response first)
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

    def add(self, data: bytes) -> bool:
        """Records the next event; True when it made the stream pass a bound (for the first time)."""
        self.frames.append(data)
        self.size += len(data)
        if self.shared:
            self.pending.append((self.next, data))
        self.next += 1
        passed = False
        while self.frames and (len(self.frames) > self._max_events or self.size > self._max_bytes):
            self.size -= len(self.frames.popleft())
            self.first += 1
            passed = not self.overflowed
            self.overflowed = True
        if self.pending and self.pending[0][0] < self.first:
            self.pending = [p for p in self.pending if p[0] >= self.first]
        self.notify()
        return passed

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
