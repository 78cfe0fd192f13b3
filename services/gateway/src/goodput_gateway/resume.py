"""Stream resume: a streamed answer survives its client's dropped connection (issue 21; BP-PERF-03).

With ``RESUME_WINDOW_S`` above 0, every event of a streamed generation is numbered and recorded as it is produced,
and a client that lost the stream reconnects, on any gateway replica, and gets the rest of the same answer, without
a second generation:

- REST (chat, completions, Responses): every SSE event carries ``id: <stream id>:<seq>`` (``seq`` from 0; the stream
  id is the request's, also in the ``X-Goodput-Stream-Id`` header; a Responses stream's is the response's id).
  ``GET /v1/streams/{stream id}`` with ``Last-Event-ID: <stream id>:<seq>`` (or ``?after=<seq>``; neither = from
  the start), or the same ``POST`` again with that ``Last-Event-ID`` (what an SSE client sends when it reconnects),
  answers the events after ``seq``, following the generation live while it runs, to its ``[DONE]``.
- gRPC: ``StreamStart.resume_token`` and every message's ``seq``; ``ResumeStream(resume_token, from_seq)``.

Only the stream's tenant may resume it: another tenant's id is unknown to it (404, not 403). Unknown or expired is
404 ``stream_not_found``; a stream whose events after the client's last one were dropped by the bounds, or that was
abandoned, is 410 (gRPC OUT_OF_RANGE) ``stream_events_dropped`` / ``stream_abandoned``.

How it runs. The generation no longer runs inside the client's response: a *producer* task drives the API's event
stream (the SSE bytes, or the serialized gRPC messages) to its end and records each event in a :class:`_Recording`;
the client's response follows that recording in this process, so no store sits on the token path. A client that
goes away detaches: the generation goes on so that a reconnect finds the rest, and it is cut (worker call cancelled,
lease released, as without resume) once nobody has followed it for the window: an abandoned answer costs at most the
window's decoding. It runs once, so it is admitted, settled and metered once; a resume runs nothing.

The shared store. One flusher per process writes what was recorded since its last turn, for every stream in one
pipeline, every ``RESUME_FLUSH_S`` (a stream's first event at once), never on the token path. Each stream is a Redis
stream (``XADD`` with the event's number as its entry id, ``0-<seq + 1>``; ``XTRIM MINID`` for the bounds;
``PEXPIRE`` the window after its end): a reader on another replica catches up and follows live with one blocking
``XREAD`` from the id it has, and a gap in the ids (events dropped by the bounds) shows. A heartbeat key marks the
producer alive (a reader of a stream whose replica died gets an error, not a wait), a reader key marks a follower
elsewhere (so the producer does not cut the generation under it). Without Redis the recordings stay in this process,
finished ones for the window (bounded by ``RESUME_LOCAL_MAX_BYTES``): resumes must reach the same replica.

Bounds: ``RESUME_MAX_EVENTS`` and ``RESUME_MAX_BYTES`` per stream (the oldest events are dropped past them), kept
``RESUME_WINDOW_S`` after the stream ended.

Example (in a coroutine; ``source`` yields an API's wire events, ``generation`` is what it streams)::

    buffer = StreamBuffer(settings, redis=None)
    async for frame in buffer.stream(source, api="sse", tenant="acme", stream_id="req-1",
                                     closer=generation.aclose):
        ...                                 # the client's events; it may go away, the generation goes on
    frames = await buffer.resume(api="sse", tenant="acme", stream_id="req-1", after=41)
    async for frame in frames:              # events 42, 43, ... to the end
        ...

>>> parse_last_event_id("req-1f2e:41")
('req-1f2e', 41)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError, ResponseError

from goodput_core.errors import (
    GoodputError,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
    Unimplemented,
    from_status,
)

from goodput_gateway.config import GatewaySettings

__all__ = ["LAST_EVENT_ID", "MAX_SEQ", "STREAM_HEADER", "Frame", "StreamBuffer", "StreamGone", "check_stream_id",
           "parse_last_event_id", "sse_error", "sse_events"]

log = logging.getLogger("goodput.gateway.resume")

LAST_EVENT_ID = "last-event-id"
STREAM_HEADER = "X-Goodput-Stream-Id"
_STREAM_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_SEQ = 10**12
# A stream id not (yet) in Redis is looked for this long (at least four flushes) before it is answered 404: the replica
# producing it writes its first events at its next flush.
_UNKNOWN_AFTER_S = 0.25
# close() waits this long (at most) for the producers and the flusher it cancelled
_CLOSE_WAIT_S = 5.0
# outcomes of a resume by the error code that refused it (goodput_gateway_stream_resumes_total)
_OUTCOMES = {"resume_disabled": "disabled", "stream_not_found": "not_found", "stream_events_dropped": "evicted",
             "stream_abandoned": "abandoned", "store_unavailable": "error"}


class StreamGone(GoodputError):
    """A stream that exists but cannot be resumed where asked: the events after the caller's last one were dropped
    (it passed RESUME_MAX_EVENTS or RESUME_MAX_BYTES), or it was abandoned. REST 410, gRPC OUT_OF_RANGE."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 410
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class Frame:
    """One recorded event: its number in the stream (0 = the first) and its bytes on the wire (without its id)."""

    seq: int
    data: bytes


@dataclass(frozen=True)
class _End:
    """How a stream ended: ``done``, ``error`` (with the error it ended with) or ``abandoned``."""

    status: str
    error: dict[str, Any] | None = None  # {"status": gRPC code name, "message", "code", "param", "retry_after_s"}

    @classmethod
    def of(cls, err: GoodputError) -> _End:
        return cls("error", {"status": err.grpc_code.name, "message": err.message, "code": err.code,
                             "param": err.param, "retry_after_s": err.retry_after_s})

    def encode(self) -> bytes:
        return json.dumps({"status": self.status, "error": self.error}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> _End:
        doc = json.loads(raw)
        return cls(str(doc.get("status", "done")), doc.get("error"))

    def raise_error(self, stream_id: str) -> None:
        if self.status == "abandoned":
            raise _abandoned(stream_id)
        if self.error:
            e = self.error
            status = grpc.StatusCode[e["status"]] if e.get("status") in grpc.StatusCode.__members__ \
                else grpc.StatusCode.INTERNAL
            raise from_status(status, str(e.get("message", "")), code=e.get("code"), param=e.get("param"),
                              retry_after_s=e.get("retry_after_s"))


def _not_found(stream_id: str) -> NotFound:
    return NotFound(f"No resumable stream '{stream_id[:128]}': unknown, or its resume window has passed.",
                    param="stream_id", code="stream_not_found")


def _dropped(stream_id: str, after: int, first: int) -> StreamGone:
    return StreamGone(f"The events of stream '{stream_id}' after {after} are no longer kept (the oldest kept is "
                      f"{first}: the stream passed the gateway's RESUME_MAX_EVENTS or RESUME_MAX_BYTES); retry the "
                      "request.", param="Last-Event-ID", code="stream_events_dropped")


def _abandoned(stream_id: str) -> StreamGone:
    return StreamGone(f"Stream '{stream_id}' was abandoned: nobody followed it within the resume window, so its "
                      "generation was stopped; retry the request.", param="stream_id", code="stream_abandoned")


def _seq(entry_id: bytes | str) -> int:
    """The event number of a Redis stream entry id ``0-<seq + 1>``."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.rpartition("-")[2]) - 1


def check_stream_id(stream_id: str, *, param: str = "stream_id") -> str:
    if not _STREAM_ID.match(stream_id):
        raise InvalidArgument("a stream id is 1-128 of A-Z a-z 0-9 _ -", param=param, code="invalid_value")
    return stream_id


def parse_last_event_id(value: str, *, stream_id: str | None = None) -> tuple[str, int]:
    """``<stream id>:<seq>`` as the stream id and the number of the last event received; ``stream_id``, when given
    (the URL's), must be the one it names."""
    sid, sep, seq = value.strip().rpartition(":")
    if not sep or not _STREAM_ID.match(sid) or not seq.isdigit() or int(seq) > MAX_SEQ:
        raise InvalidArgument("Last-Event-ID must be an event id this gateway sent: <stream id>:<number>",
                              param="Last-Event-ID", code="invalid_value")
    if stream_id is not None and sid != stream_id:
        raise InvalidArgument("Last-Event-ID names another stream than the URL", param="Last-Event-ID",
                              code="invalid_value")
    return sid, int(seq)


class ResumeMetrics:
    def __init__(self, registry: CollectorRegistry | None, buffer: StreamBuffer) -> None:
        self.resumes = Counter("goodput_gateway_stream_resumes_total", "Stream resumes asked for, by API (sse, grpc) "
                               "and outcome: resumed, not_found (unknown, another tenant's or expired), evicted (the "
                               "events after the caller's last one were dropped by the bounds), abandoned, invalid, "
                               "disabled, error (the store unavailable).", ["api", "outcome"], registry=registry)
        self.detached = Counter("goodput_gateway_stream_detached_total", "Streams whose client went away before "
                                "their end, by what became of the generation: finished (it ran to its end, for a "
                                "resume), abandoned (cut: nobody followed it for RESUME_WINDOW_S), failed.",
                                ["outcome"], registry=registry)
        self.buffered = Gauge("goodput_gateway_stream_buffer_bytes", "Bytes of stream events held in this process "
                              "for resumes (running streams; finished ones too without Redis).", registry=registry)
        self.buffered.set_function(lambda: sum(r.size for r in buffer.recordings()))
        self.streams = Gauge("goodput_gateway_stream_buffer_streams", "Streams recorded in this process (running; "
                             "finished ones too without Redis).", registry=registry)
        self.streams.set_function(lambda: len(buffer.recordings()))
        self.stored = Counter("goodput_gateway_stream_stored_bytes_total", "Bytes of stream events written to the "
                              "shared store (Redis).", registry=registry)
        self.overflows = Counter("goodput_gateway_stream_overflows_total", "Streams that passed RESUME_MAX_EVENTS or "
                                 "RESUME_MAX_BYTES (their oldest events were dropped).", registry=registry)
        self.errors = Counter("goodput_gateway_stream_store_errors_total", "Failed writes and reads of the shared "
                              "stream store, by operation.", ["op"], registry=registry)


class _Recording:
    """One stream's events as produced, the newest within the bounds, and who follows them in this process."""

    def __init__(self, key: str, stream_id: str, *, max_events: int, max_bytes: int, shared: bool,
                 now: float) -> None:
        self.key = key
        self.stream_id = stream_id
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.frames: deque[bytes] = deque()
        self.first = 0  # the number of frames[0]
        self.next = 0  # the number of the next event
        self.size = 0  # bytes held
        self.overflowed = False
        self.end: _End | None = None
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
        return [Frame(s, d) for s, d in zip(itertools.count(seq),
                                            itertools.islice(self.frames, seq - self.first, None))]

    def notify(self) -> None:
        if self._waiting:
            self._waiting = False
            self._wake.set()
            self._wake = asyncio.Event()

    async def changed(self) -> None:
        self._waiting = True
        await self._wake.wait()


class StreamBuffer:
    """The recorded streams of this gateway: produced here, followed by their clients, resumed from here or from
    Redis (``redis``, shared by every replica; None = this process only). See the module's documentation."""

    def __init__(self, settings: GatewaySettings, *, redis: aioredis.Redis | None,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 heartbeat_s: float = 1.0, live_ttl_s: float = 10.0, block_s: float = 0.5) -> None:
        self.settings = settings
        self.redis = redis
        self.window_s = settings.resume_window_s
        self.heartbeat_s = heartbeat_s  # the producer's heartbeat, a follower's mark, the abandonment check
        self.live_ttl_s = live_ttl_s  # a producer not heard of for this long is gone (its replica died)
        self.block_s = block_s  # a reader's blocking XREAD
        self._clock = clock
        self._recordings: dict[str, _Recording] = {}  # running here; and finished ones without Redis (or unwritten)
        self._finished: OrderedDict[str, _Recording] = OrderedDict()  # without Redis: kept for the window
        self._dirty: set[_Recording] = set()
        self._kick = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self.metrics = ResumeMetrics(registry, self)

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def recordings(self) -> list[_Recording]:
        return list(self._recordings.values())

    def _key(self, api: str, tenant: str, stream_id: str) -> str:
        return f"{self.settings.resume_prefix}:{api}:{tenant}:{stream_id}"

    # ---- producing ---------------------------------------------------------------------------------------------

    def stream(self, source: AsyncIterator[bytes], *, api: str, tenant: str, stream_id: str,
               closer: Callable[[], Awaitable[None]]) -> AsyncGenerator[Frame, None]:
        """Runs ``source`` (an API's wire events for one stream) to its end in a task of its own, recording each
        event, and returns the client's follower of it. ``closer`` (the generation's aclose) runs after the source,
        however it ended; the stream's errors reach every follower after its last event."""
        key = self._key(api, tenant, stream_id)
        rec = _Recording(key, stream_id, max_events=self.settings.resume_max_events,
                         max_bytes=self.settings.resume_max_bytes, shared=self.redis is not None, now=self._clock())
        rec.source, rec.closer = source, closer
        self._recordings[key] = rec  # stream ids are unique (request and response ids)
        self._finished.pop(key, None)
        rec.task = asyncio.get_running_loop().create_task(self._produce(rec), name=f"stream {stream_id}")
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._run(), name="stream flusher")
        return self._follow_local(rec, -1)

    async def _produce(self, rec: _Recording) -> None:
        assert rec.source is not None
        end = _End("done")
        try:
            async for data in rec.source:
                if rec.add(data):
                    self.metrics.overflows.inc()
                if rec.shared:
                    self._dirty.add(rec)
                    self._kick.set()
        except asyncio.CancelledError:
            end = _End("abandoned") if rec.abandoned else _End.of(Unavailable(
                "the gateway stopped while streaming; the answer is incomplete: retry the request",
                code="gateway_stopped"))
            raise
        except GoodputError as err:
            end = _End.of(err)
        except Exception as err:  # noqa: BLE001 - the followers get it as an error, not a stream that never ends
            log.exception("a recorded stream failed", extra={"stream": rec.stream_id})
            end = _End.of(Internal(f"the stream failed ({type(err).__name__})"))
        finally:
            await self._close_source(rec)
            self._finish(rec, end)

    async def _close_source(self, rec: _Recording) -> None:
        try:
            aclose = getattr(rec.source, "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:  # noqa: BLE001
            log.exception("closing a recorded stream failed", extra={"stream": rec.stream_id})
        finally:
            if rec.closer is not None:
                try:
                    await rec.closer()
                except Exception:  # noqa: BLE001
                    log.exception("closing a recorded stream's generation failed", extra={"stream": rec.stream_id})

    def _finish(self, rec: _Recording, end: _End) -> None:
        if rec.end is not None:
            return
        rec.end, rec.ended_at = end, self._clock()
        rec.notify()
        if rec.left:
            self.metrics.detached.labels({"done": "finished", "abandoned": "abandoned"}.get(end.status,
                                                                                          "failed")).inc()
        if rec.shared:
            self._dirty.add(rec)
            self._kick.set()
            return
        self._finished[rec.key] = rec
        budget, held = self.settings.resume_local_max_bytes, sum(r.size for r in self._finished.values())
        while held > budget and self._finished:
            key, oldest = self._finished.popitem(last=False)
            held -= oldest.size
            if self._recordings.get(key) is oldest:
                del self._recordings[key]

    def _abandon(self, rec: _Recording) -> None:
        if rec.end is not None or rec.abandoned:
            return
        rec.abandoned = True
        log.info("stream abandoned: nobody followed it within the resume window", extra={"stream": rec.stream_id})
        if rec.task is not None:
            rec.task.cancel()

    # ---- following ---------------------------------------------------------------------------------------------

    async def _follow_local(self, rec: _Recording, after: int) -> AsyncGenerator[Frame, None]:
        """The events after number ``after``, from this process's recording, as they come, to its end."""
        seq = after + 1
        rec.readers += 1
        rec.idle_since = None
        try:
            while True:
                frames = rec.since(seq)
                if frames is None:
                    raise _dropped(rec.stream_id, seq - 1, rec.first)
                if frames:
                    for frame in frames:
                        yield frame
                    seq = frames[-1].seq + 1
                    continue
                if rec.end is not None:
                    rec.end.raise_error(rec.stream_id)
                    return
                await rec.changed()
        finally:
            rec.readers -= 1
            if rec.readers == 0:
                rec.idle_since = self._clock()
                if rec.end is None:
                    rec.left = True

    async def resume(self, *, api: str, tenant: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        """The events of ``tenant``'s stream after number ``after`` (-1 = from the start), following it live to its
        end. Refusals (off, unknown, dropped, abandoned) are raised here, before any event."""
        outcome = "invalid"
        try:
            if not self.enabled:
                raise Unimplemented("stream resume is off on this gateway (its RESUME_WINDOW_S is 0)",
                                    code="resume_disabled")
            check_stream_id(stream_id)
            if not -1 <= after <= MAX_SEQ:
                raise InvalidArgument("the last event received must be a number from -1", param="after",
                                      code="invalid_value")
            key = self._key(api, tenant, stream_id)
            rec = self._recordings.get(key)
            if rec is not None and rec.end is not None and self._clock() - rec.ended_at >= self.window_s:
                rec = None  # its window passed (the flusher forgets it at its next turn)
            if rec is not None and (rec.end is None or not rec.end_stored or self.redis is None):
                if rec.abandoned or (rec.end is not None and rec.end.status == "abandoned"):
                    raise _abandoned(stream_id)
                if after + 1 < rec.first:
                    raise _dropped(stream_id, after, rec.first)
                frames = self._follow_local(rec, after)
            elif self.redis is not None:
                frames = await self._open_shared(key, stream_id, after)
            else:
                raise _not_found(stream_id)
            outcome = "resumed"
            return frames
        except GoodputError as err:
            outcome = _OUTCOMES.get(err.code or "", outcome)
            raise
        finally:
            self.metrics.resumes.labels(api, outcome).inc()

    async def _open_shared(self, key: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        assert self.redis is not None
        # a stream that began a moment ago on another replica may not be written yet (every resume_flush_s): it is
        # looked for again for a little while before it is called unknown
        give_up = time.monotonic() + max(4 * self.settings.resume_flush_s, _UNKNOWN_AFTER_S)
        while True:
            try:
                info = await self.redis.xinfo_stream(key)
                break
            except ResponseError as err:
                if "no such key" not in str(err).lower():
                    raise self._read_error(err) from None
                if time.monotonic() >= give_up:
                    raise _not_found(stream_id) from None
            except (RedisError, OSError) as err:
                raise self._read_error(err) from None
            await asyncio.sleep(self.settings.resume_flush_s)
        last = info.get("last-entry")
        if last and b"e" in last[1] and _End.decode(last[1][b"e"]).status == "abandoned":
            raise _abandoned(stream_id)
        first_entry = info.get("first-entry")
        first = _seq(first_entry[0]) if first_entry else _seq(info["last-generated-id"]) + 1
        if after + 1 < first:
            raise _dropped(stream_id, after, first)
        return self._follow_shared(key, stream_id, after)

    def _read_error(self, err: BaseException) -> Unavailable:
        self.metrics.errors.labels("read").inc()
        log.warning("the stream store failed", extra={"error": repr(err)})
        return Unavailable(f"the stream store is unavailable ({type(err).__name__})", code="store_unavailable")

    async def _follow_shared(self, key: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        """The events after number ``after`` from Redis: caught up, then followed with a blocking XREAD."""
        assert self.redis is not None
        redis = self.redis
        cursor = after + 1  # the entry id (0-<n>) of the last event received; the next wanted has number n
        marked = float("-inf")
        window_ms = max(int(self.window_s * 1000), 1)
        while True:
            try:
                now = self._clock()
                if now - marked >= self.heartbeat_s:  # a follower: the producer does not cut the generation
                    marked = now
                    await redis.set(f"{key}:reader", b"1", px=window_ms)
                found: Any = await redis.xread({key: f"0-{cursor}"}, count=256,
                                               block=max(int(self.block_s * 1000), 1))
                if not found:
                    quiet = await self._quiet(key, stream_id, cursor)
                    if isinstance(quiet, _End):
                        quiet.raise_error(stream_id)
                        return
                    found = quiet
            except (RedisError, OSError) as err:
                raise self._read_error(err) from None
            for _, entries in found:
                for entry_id, fields in entries:
                    seq = _seq(entry_id)
                    if seq != cursor:  # a gap: dropped by the bounds while this reader was behind
                        raise _dropped(stream_id, cursor - 1, seq)
                    if b"e" in fields:
                        _End.decode(fields[b"e"]).raise_error(stream_id)
                        return
                    yield Frame(seq, fields[b"d"])
                    cursor = seq + 1

    async def _quiet(self, key: str, stream_id: str, cursor: int) -> Any:
        """Nothing new for a while: nothing to read while the producer lives; what came meanwhile, or the end (also
        for a reader that claims events past it), once it is gone; an error when it died before the end (its
        replica is gone)."""
        assert self.redis is not None
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(f"{key}:live")
        pipe.exists(key)
        alive, exists = await pipe.execute()
        if alive and exists:
            return []
        if exists:
            found = await self.redis.xread({key: f"0-{cursor}"}, count=256)
            if found:
                return found
            last: Any = await self.redis.xrevrange(key, count=1)
            if last and b"e" in last[0][1]:
                return _End.decode(last[0][1][b"e"])
        raise Unavailable(f"the gateway replica producing stream '{stream_id}' stopped before its end; the answer is "
                          "incomplete: retry the request", code="stream_lost")

    # ---- the flusher -------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Writes recorded events to Redis in batches, beats for the producers, and cuts abandoned generations."""
        next_beat, warned = 0.0, float("-inf")
        while True:
            if not self._dirty:
                try:
                    await asyncio.wait_for(self._kick.wait(), timeout=self.heartbeat_s)
                except TimeoutError:
                    pass
            self._kick.clear()
            now = self._clock()
            beat = now >= next_beat
            if beat:
                next_beat = now + self.heartbeat_s
            failed = False
            try:
                await self._write(beat=beat, now=now)
            except (RedisError, OSError) as err:
                failed = True
                self.metrics.errors.labels("write").inc()
                if now - warned >= 10.0:  # once in a while, not every retry
                    warned = now
                    log.warning("writing stream events to Redis failed; retrying", extra={"error": repr(err)})
            except Exception:  # noqa: BLE001 - the flusher must outlive a bug in one turn
                failed = True
                log.exception("the stream flusher failed a turn")
            # Redis unreachable: no follower elsewhere can read these streams either, so this process judges alone
            self._sweep(now, alone=self.redis is None or failed)
            await asyncio.sleep(self.heartbeat_s if failed else self.settings.resume_flush_s)

    def _idle_too_long(self, rec: _Recording, now: float) -> bool:
        return rec.end is None and rec.readers == 0 and rec.idle_since is not None \
            and now - rec.idle_since >= self.window_s

    async def _write(self, *, beat: bool, now: float) -> None:
        if self.redis is None:
            self._dirty.clear()
            return
        recs = set(self._dirty)
        self._dirty.clear()
        if beat:
            recs.update(r for r in self._recordings.values() if r.end is None)
        if not recs:
            return
        window_ms = max(int(self.window_s * 1000), 1)
        live_ms = int(self.live_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        plans = []
        for rec in recs:
            batch, rec.pending = rec.pending, []
            start, first, ending = len(pipe), rec.first, rec.end is not None and not rec.end_stored
            for seq, data in batch:
                pipe.xadd(rec.key, {"d": data}, id=f"0-{seq + 1}")
            if first > rec.stored_first:
                pipe.xtrim(rec.key, minid=f"0-{first + 1}", approximate=False)
            if ending:
                assert rec.end is not None
                pipe.xadd(rec.key, {"e": rec.end.encode()}, id=f"0-{rec.next + 1}")
                pipe.pexpire(rec.key, window_ms)
                pipe.delete(f"{rec.key}:live")
            elif rec.end is None and (beat or not rec.announced):
                pipe.set(f"{rec.key}:live", b"1", px=live_ms)
                pipe.pexpire(rec.key, window_ms + live_ms)
            check = None
            if beat and self._idle_too_long(rec, now):
                check = len(pipe)
                pipe.exists(f"{rec.key}:reader")
            plans.append((rec, batch, start, len(pipe), first, ending, check))
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException:
            for rec, batch, *_ in plans:
                self._retry(rec, batch)
            raise
        for rec, batch, start, stop, first, ending, check in plans:
            failed = [r for r in results[start:stop] if isinstance(r, Exception)
                      and "equal or smaller" not in str(r)]  # an XADD already applied by a turn that failed late
            if failed:
                self.metrics.errors.labels("write").inc()
                log.warning("writing a stream's events failed", extra={"stream": rec.stream_id,
                                                                       "error": repr(failed[0])})
                self._retry(rec, batch)
                continue
            rec.announced, rec.stored_first = True, max(rec.stored_first, first)
            self.metrics.stored.inc(sum(len(d) for _, d in batch))
            if ending:
                rec.end_stored = True
                if self._recordings.get(rec.key) is rec:
                    del self._recordings[rec.key]
            elif check is not None and not results[check]:
                self._abandon(rec)

    def _retry(self, rec: _Recording, batch: list[tuple[int, bytes]]) -> None:
        rec.pending = [p for p in batch + rec.pending if p[0] >= rec.first]
        self._dirty.add(rec)

    def _sweep(self, now: float, *, alone: bool) -> None:
        """``alone`` (no Redis, or it failed): cuts the generations nobody here follows. Forgets finished streams
        after the window (with Redis: those whose end could not be written)."""
        for key, rec in list(self._recordings.items()):
            if rec.end is None:
                if alone and self._idle_too_long(rec, now):
                    self._abandon(rec)
            elif now - rec.ended_at >= self.window_s:
                del self._recordings[key]
                self._finished.pop(key, None)

    async def close(self) -> None:
        """Stops the streams still producing (their followers get an error) and writes their ends."""
        running = [r for r in self._recordings.values() if r.end is None]
        tasks = [r.task for r in running if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        stuck = await _stopped(tasks)  # bounded: a producer that does not stop must not hold the shutdown
        if stuck:
            log.warning("stream producers did not stop on close", extra={"streams": stuck})
        for rec in running:
            if rec.end is None:
                if rec.task is None or rec.task.done():  # cancelled before it ran: it closed nothing
                    await self._close_source(rec)
                # else it is stuck, its source in use: closing it from here would fail or wait with it
                self._finish(rec, _End.of(Unavailable("the gateway stopped while streaming; the answer is "
                                                      "incomplete: retry the request", code="gateway_stopped")))
        if self._flusher is not None:  # its turn in flight gives its batches back
            self._flusher.cancel()
            await _stopped([self._flusher])
            self._flusher = None
        if self.redis is not None and self._dirty:
            try:
                await asyncio.wait_for(self._write(beat=False, now=self._clock()), timeout=2)
            except (RedisError, OSError, TimeoutError) as err:
                log.warning("writing the last stream events failed", extra={"error": repr(err)})


async def _stopped(tasks: list[asyncio.Task[Any]]) -> int:
    """Waits up to ``_CLOSE_WAIT_S`` for cancelled tasks to end; how many did not. Their errors are their streams'
    (recorded as their ends), not the caller's: they are retrieved here, not logged as lost."""
    if not tasks:
        return 0
    done, stuck = await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
    for task in done:
        _ = task.cancelled() or task.exception()
    return len(stuck)


# ---- REST --------------------------------------------------------------------------------------------------------


def sse_error(err: GoodputError) -> bytes:
    """An error as the last event of an SSE stream (OpenAI's error body)."""
    return b"data: " + json.dumps(err.openai_body(), separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_events(frames: AsyncGenerator[Frame, None], stream_id: str, *,
                     error: Callable[[GoodputError], bytes] = sse_error) -> AsyncIterator[bytes]:
    """Recorded SSE events as sent: each with its ``id: <stream id>:<seq>``; an error the stream ended with (or a
    resume ran into) as a last event of its own, without an id (``error`` renders it; OpenAI's shape by default)."""
    prefix = f"id: {stream_id}:".encode()
    try:
        async for frame in frames:
            yield prefix + str(frame.seq).encode() + b"\n" + frame.data
    except GoodputError as err:
        yield error(err)
    finally:
        await frames.aclose()
