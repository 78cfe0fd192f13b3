"""The recorded streams of a gateway (:class:`StreamBuffer`); see :mod:`goodput_gateway.resume`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from goodput_core.errors import (
    GoodputError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)

from goodput_gateway.config import GatewaySettings
from goodput_gateway.resume.frames import (
    MAX_SEQ,
    OUTCOMES,
    End,
    Frame,
    abandoned,
    check_stream_id,
    dropped,
    log,
    not_found,
    stalled,
    too_many_followers,
)
from goodput_gateway.resume.recording import Budget, Cursor, Following, Recording, ResumeMetrics
from goodput_gateway.resume.shared import RedisStreams
from goodput_gateway.storage import DEFAULT_STORAGE, AsyncStorageLedger, StorageQuota, storage_prefix

__all__ = ["StreamBuffer"]

# A resume waits this long at most for one of the RESUME__MAX_READER_CONNECTIONS (then 503 store_unavailable).
READER_WAIT_S = 5.0


class StreamBuffer:
    """The recorded streams of this gateway: produced here, followed by their clients, resumed from here or from
    Redis (``redis``, shared by every replica; None = this process only). Resumes read Redis through ``readers``
    (by default a client of its own on ``redis``'s server, its pool capped at RESUME__MAX_READER_CONNECTIONS). See
    :mod:`goodput_gateway.resume`."""

    def __init__(self, settings: GatewaySettings, *, redis: aioredis.Redis | None,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 heartbeat_s: float = 1.0, live_ttl_s: float = 10.0, block_s: float = 0.5,
                 close_wait_s: float = 5.0, ledger: AsyncStorageLedger | None = None,
                 quota_of: Callable[[str], StorageQuota] = lambda tenant: DEFAULT_STORAGE,
                 readers: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.redis = redis  # the shared store's; None = this process only
        # a shared recording's place in its tenant's resume_streams quota (goodput_gateway.storage)
        self.ledger = ledger or (AsyncStorageLedger(redis, prefix=storage_prefix(settings)) if redis else None)
        self.quota_of = quota_of
        self.window_s = settings.resume.window_s
        self.heartbeat_s = heartbeat_s  # the producer's heartbeat, a follower's mark, the abandonment check
        self.live_ttl_s = live_ttl_s  # a producer not heard of for this long is gone (its replica died)
        self.block_s = block_s  # a reader's blocking XREAD
        self.close_wait_s = close_wait_s  # close() waits this long (at most) for the tasks it cancelled
        self.clock = clock
        self.by_key: dict[str, Recording] = {}  # running here; and finished ones without Redis (or unwritten)
        self._finished: OrderedDict[str, Recording] = OrderedDict()  # without Redis: kept for the window
        self.dirty: set[Recording] = set()
        self._kick = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False  # the flusher's last turn (a cancel a Redis call swallowed must not keep it going)
        self.budget = Budget(settings.resume.max_total_bytes)  # the bytes all the recordings here hold
        self._per_stream: Counter[str] = Counter()  # resumes following, by stream key
        self._per_tenant: Counter[str] = Counter()  # and by tenant
        self._full_warned = float("-inf")
        self.metrics = ResumeMetrics(registry, self.recordings, lambda: sum(self._per_tenant.values()))
        self._own_readers = readers is None and redis is not None
        if readers is None and redis is not None:
            readers = _capped(redis, settings.resume.max_reader_connections)
        self.readers = readers  # resumes read Redis with it
        self.shared = RedisStreams(self, redis, readers or redis) if redis is not None else None

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def recordings(self) -> list[Recording]:
        return list(self.by_key.values())

    def key(self, api: str, tenant: str, stream_id: str) -> str:
        """Where a stream is recorded (in Redis, and in this replica's own map)."""
        return f"{self.settings.resume.prefix}:{api}:{tenant}:{stream_id}"

    # ---- producing ---------------------------------------------------------------------------------------------

    def stream(self, source: AsyncIterator[bytes], *, api: str, tenant: str, stream_id: str,
               closer: Callable[[], Awaitable[None]]) -> AsyncGenerator[Frame, None]:
        """Runs ``source`` (an API's wire events for one stream) to its end in a task of its own, recording each
        event, and returns the client's follower of it. ``closer`` (the generation's aclose) runs after the source,
        however it ended; the stream's errors reach every follower after its last event. With RESUME__MAX_TOTAL_BYTES
        reached, the stream is served without a recording: not resumable, cut when its client goes."""
        key = self.key(api, tenant, stream_id)
        resumable = self._has_room()
        if not resumable:
            self.metrics.full.labels("unrecorded").inc()
            if time.monotonic() - self._full_warned >= 10.0:  # once in a while, not for every stream
                self._full_warned = time.monotonic()
                log.warning("stream recordings hold RESUME__MAX_TOTAL_BYTES: new streams are not resumable",
                            extra={"stream": stream_id, "held": self.budget.held})
        rec = Recording(key, stream_id, max_events=self.settings.resume.max_events,
                        max_bytes=self.settings.resume.max_bytes, shared=self.shared is not None and resumable,
                        now=self.clock(), tenant=tenant, budget=self.budget, resumable=resumable)
        rec.source, rec.closer = source, closer
        if key in self.by_key:  # stream ids are unique (request and response ids)
            self.forget(self.by_key[key])
        self.by_key[key] = rec
        rec.task = asyncio.get_running_loop().create_task(self._produce(rec), name=f"stream {stream_id}")
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._run(), name="stream flusher")

        def gone() -> None:  # an unrecorded stream's client leaving cuts it, as with resume off
            if not rec.resumable and rec.readers == 0:
                self.abandon(rec, why="its client left, and it was not recorded")
        return self._follower(rec, 0, gone)

    def _has_room(self) -> bool:
        """Room for one more recording below RESUME__MAX_TOTAL_BYTES, once finished streams kept here were forgotten
        (the oldest first) as far as needed."""
        while self.budget.full and self._finished:
            _, oldest = self._finished.popitem(last=False)
            self.forget(oldest)
            self.metrics.full.labels("evicted").inc()
        return not self.budget.full

    def forget(self, rec: Recording) -> None:
        """Drops a recording from this process (a resume then goes to Redis, or is 404): its bytes count no more."""
        if self.by_key.get(rec.key) is rec:
            del self.by_key[rec.key]
        if self._finished.get(rec.key) is rec:
            del self._finished[rec.key]
        rec.release()

    async def _admit(self, rec: Recording) -> None:
        """A shared recording takes its place in the tenant's quota (until the longest it may run, plus the window;
        shortened when it ends); without one it is recorded in this process only (a resume must reach it here)."""
        assert self.ledger is not None
        try:
            await self.ledger.reserve(rec.tenant, "resume", rec.key, quota=self.quota_of(rec.tenant),
                                      expires_at=time.time() + self.settings.request_timeout_s + self.window_s)
        except ResourceExhausted as err:
            rec.shared = False
            log.warning("a stream is recorded on this replica only", extra={"stream": rec.stream_id,
                                                                             "why": err.message})
        except GoodputError as err:  # the ledger unreachable: the stream's own bounds and window still hold
            self.metrics.errors.labels("quota").inc()
            log.warning("a stream's place in its tenant's quota is not counted", extra={"stream": rec.stream_id,
                                                                                         "why": err.message})

    async def _produce(self, rec: Recording) -> None:
        assert rec.source is not None
        end = End("done")
        # decided while the first event is awaited, before anything is written to the shared store
        admission = asyncio.ensure_future(self._admit(rec)) if rec.shared and self.ledger is not None else None
        try:
            async for data in rec.source:
                await self._pace(rec, len(data))
                if rec.add(data):
                    self.metrics.overflows.inc()
                if self.budget.full and rec.trim():
                    self.metrics.full.labels("trimmed").inc()
                if admission is not None:
                    await admission
                    admission = None
                if rec.shared:
                    self.dirty.add(rec)
                    self._kick.set()
        except asyncio.CancelledError:
            end = End("abandoned") if rec.abandoned else End.of(Unavailable(
                "the gateway stopped while streaming; the answer is incomplete: retry the request",
                code="gateway_stopped"))
            raise
        except GoodputError as err:
            end = End.of(err)
        except Exception as err:  # noqa: BLE001 - the followers get it as an error, not a stream that never ends
            log.exception("a recorded stream failed", extra={"stream": rec.stream_id})
            end = End.of(Internal(f"the stream failed ({type(err).__name__})"))
        finally:
            if admission is not None:
                with contextlib.suppress(BaseException):
                    await admission
            await self._close_source(rec)
            self._finish(rec, end)

    async def _pace(self, rec: Recording, size: int) -> None:
        """Flow control: the next event (``size`` bytes) waits while it would drop one that a follower here has yet to
        read, so that a slow client gets every event; one that reads nothing for RESUME__STALL_TIMEOUT_S is waited
        for no more (the generation's deadline bounds the wait too: its worker call ends with it)."""
        stall_s, began = self.settings.resume.stall_timeout_s, time.monotonic()
        paced = False
        try:
            while (slow := rec.slowest(size)) is not None:
                paced, idle = True, self.clock() - slow.moved_at
                if idle >= stall_s:
                    rec.let_go(slow)
                    self.metrics.stalled.inc()
                    log.warning("a client that read nothing while its generation waited for it was let go",
                                extra={"stream": rec.stream_id, "stall_s": stall_s})
                    continue
                rec.moved.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rec.moved.wait(), timeout=min(stall_s - idle, self.heartbeat_s))
        finally:
            if paced:
                self.metrics.paced.inc(time.monotonic() - began)

    async def _close_source(self, rec: Recording) -> None:
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

    def _finish(self, rec: Recording, end: End) -> None:
        if rec.end is not None:
            return
        rec.end, rec.ended_at = end, self.clock()
        rec.notify()
        if rec.left:
            self.metrics.detached.labels({"done": "finished", "abandoned": "abandoned"}.get(end.status, "failed")).inc()
        if rec.shared:
            self.dirty.add(rec)
            self._kick.set()
            return
        if not rec.resumable:
            self.forget(rec)
            return
        self._finished[rec.key] = rec
        budget, held = self.settings.resume.local_max_bytes, sum(r.size for r in self._finished.values())
        while held > budget and self._finished:
            _, oldest = self._finished.popitem(last=False)
            held -= oldest.size
            self.forget(oldest)

    def abandon(self, rec: Recording, *, why: str = "nobody followed it within the resume window") -> None:
        if rec.end is not None or rec.abandoned:
            return
        rec.abandoned = True
        log.info("stream abandoned", extra={"stream": rec.stream_id, "why": why})
        if rec.task is not None:
            rec.task.cancel()

    # ---- following ---------------------------------------------------------------------------------------------

    def _follower(self, rec: Recording, seq: int, gone: Callable[[], None]) -> Following:
        """A follower of this process's recording from event number ``seq``; ``gone`` runs once it has left."""
        cursor = rec.attach(seq, self.clock())

        def left() -> None:
            rec.detach(cursor, self.clock())
            gone()
        return Following(self._follow_local(rec, cursor), left)

    async def _follow_local(self, rec: Recording, cursor: Cursor) -> AsyncGenerator[Frame, None]:
        """The events from the cursor's on, from this process's recording, as they come, to its end; the cursor
        moves with what the follower takes (the producer waits for it: :meth:`_pace`)."""
        while True:
            frames = rec.since(cursor.seq)
            if frames is None:
                if cursor.cut:
                    raise stalled(rec.stream_id, cursor.seq - 1, rec.first, self.settings.resume.stall_timeout_s)
                raise dropped(rec.stream_id, cursor.seq - 1, rec.first)
            if frames:
                for frame in frames:
                    yield frame
                    rec.read(cursor, frame.seq + 1, self.clock())
                continue
            if rec.end is not None:
                rec.end.raise_error(rec.stream_id)
                return
            await rec.changed()
            rec.read(cursor, cursor.seq, self.clock())  # it waited for the stream, not the other way round

    def _place(self, key: str, tenant: str, stream_id: str) -> Callable[[], None]:
        """A resume's place within RESUME__MAX_FOLLOWERS_PER_STREAM and _PER_TENANT (429 past either), and what
        gives it back."""
        resume = self.settings.resume
        if self._per_stream[key] >= resume.max_followers_per_stream:
            raise too_many_followers(stream_id, tenant_wide=False, limit=resume.max_followers_per_stream)
        if self._per_tenant[tenant] >= resume.max_followers_per_tenant:
            raise too_many_followers(stream_id, tenant_wide=True, limit=resume.max_followers_per_tenant)
        self._per_stream[key] += 1
        self._per_tenant[tenant] += 1

        def give_back() -> None:
            for counts, name in ((self._per_stream, key), (self._per_tenant, tenant)):
                counts[name] -= 1
                if counts[name] <= 0:
                    del counts[name]
        return give_back

    async def resume(self, *, api: str, tenant: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        """The events of ``tenant``'s stream after number ``after`` (-1 = from the start), following it live to its
        end. Refusals (off, unknown, dropped, abandoned) are raised here, before any event."""
        outcome = "invalid"
        try:
            if not self.enabled:
                raise Unimplemented("stream resume is off on this gateway (its RESUME__WINDOW_S is 0)",
                                    code="resume_disabled")
            check_stream_id(stream_id)
            if not -1 <= after <= MAX_SEQ:
                raise InvalidArgument("the last event received must be a number from -1", param="after",
                                      code="invalid_value")
            key = self.key(api, tenant, stream_id)
            rec = self.by_key.get(key)
            if rec is not None and not rec.resumable:  # begun with RESUME__MAX_TOTAL_BYTES reached
                raise not_found(stream_id)
            if rec is not None and rec.end is not None and self.clock() - rec.ended_at >= self.window_s:
                rec = None  # its window passed (the flusher forgets it at its next turn)
            give_back = self._place(key, tenant, stream_id)
            try:
                if rec is not None and (rec.end is None or not rec.end_stored or self.shared is None):
                    if rec.abandoned or (rec.end is not None and rec.end.status == "abandoned"):
                        raise abandoned(stream_id)
                    if after + 1 < rec.first:
                        raise dropped(stream_id, after, rec.first)
                    frames: AsyncGenerator[Frame, None] = self._follower(rec, after + 1, give_back)
                elif self.shared is not None:
                    frames = Following(await self.shared.open(key, stream_id, after), give_back)
                else:
                    raise not_found(stream_id)
            except BaseException:
                give_back()
                raise
            outcome = "resumed"
            return frames
        except GoodputError as err:
            outcome = OUTCOMES.get(err.code or "", outcome)
            raise
        finally:
            self.metrics.resumes.labels(api, outcome).inc()

    # ---- the flusher -------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Writes recorded events to Redis in batches, beats for the producers, and cuts abandoned generations."""
        next_beat, warned = 0.0, float("-inf")
        while not self._closing:
            if not self.dirty:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), timeout=self.heartbeat_s)
            self._kick.clear()
            now = self.clock()
            beat = now >= next_beat
            if beat:
                next_beat = now + self.heartbeat_s
            failed = False
            try:
                if self.shared is None:
                    self.dirty.clear()
                else:
                    await self.shared.write(beat=beat, now=now)
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
            self._sweep(now, alone=self.shared is None or failed)
            await asyncio.sleep(self.heartbeat_s if failed else self.settings.resume.flush_s)

    def idle_too_long(self, rec: Recording, now: float) -> bool:
        return rec.end is None and rec.readers == 0 and rec.idle_since is not None \
            and now - rec.idle_since >= self.window_s

    def _sweep(self, now: float, *, alone: bool) -> None:
        """``alone`` (no Redis, or it failed): cuts the generations nobody here follows. Forgets finished streams
        after the window (with Redis: those whose end could not be written)."""
        for rec in list(self.by_key.values()):
            if rec.end is None:
                if alone and self.idle_too_long(rec, now):
                    self.abandon(rec)
            elif now - rec.ended_at >= self.window_s:
                self.forget(rec)

    async def close(self) -> None:
        """Stops the streams still producing (their followers get an error) and writes their ends."""
        running = [r for r in self.by_key.values() if r.end is None]
        tasks = [r.task for r in running if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        # bounded: a producer that does not stop must not hold the shutdown
        stuck = await _stopped(tasks, self.close_wait_s)
        if stuck:
            log.warning("stream producers did not stop on close", extra={"streams": stuck})
        for rec in running:
            if rec.end is None:
                if rec.task is None or rec.task.done():  # cancelled before it ran: it closed nothing
                    await self._close_source(rec)
                # else it is stuck, its source in use: closing it from here would fail or wait with it
                self._finish(rec, End.of(Unavailable("the gateway stopped while streaming; the answer is "
                                                      "incomplete: retry the request", code="gateway_stopped")))
        if self._flusher is not None:  # its turn in flight gives its batches back
            self._closing = True
            self._flusher.cancel()
            await _stopped([self._flusher], self.close_wait_s)
            self._flusher = None
        if self.shared is not None and self.dirty:
            try:
                await asyncio.wait_for(self.shared.write(beat=False, now=self.clock()), timeout=2)
            except (RedisError, OSError, TimeoutError) as err:
                log.warning("writing the last stream events failed", extra={"error": repr(err)})
        if self._own_readers and self.readers is not None:
            await self.readers.aclose()


def _capped(redis: aioredis.Redis, max_connections: int) -> aioredis.Redis:
    """A client on ``redis``'s server with a pool of its own of at most ``max_connections``: a resume waits for a free
    connection (READER_WAIT_S at most) rather than opening one more, whatever the number of followers."""
    pool = redis.connection_pool
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool(
        max_connections=max_connections, timeout=READER_WAIT_S, connection_class=pool.connection_class,
        **pool.connection_kwargs))


async def _stopped(tasks: list[asyncio.Task[Any]], wait_s: float) -> int:
    """Waits up to ``wait_s`` for cancelled tasks to end; how many did not. Their errors are their streams'
    (recorded as their ends), not the caller's: they are retrieved here, not logged as lost."""
    if not tasks:
        return 0
    done, stuck = await asyncio.wait(tasks, timeout=wait_s)
    for task in done:
        _ = task.cancelled() or task.exception()
    return len(stuck)
