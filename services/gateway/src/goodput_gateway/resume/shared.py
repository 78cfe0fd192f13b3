"""The shared store of the recorded streams (its layout: :mod:`goodput_gateway.resume`), written by the buffer's
flusher (:meth:`RedisStreams.write`) and followed by a reader on any replica (:meth:`RedisStreams.open`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from goodput_core.errors import GoodputError, Unavailable

from goodput_gateway.config import GatewaySettings
from goodput_gateway.resume.frames import UNKNOWN_AFTER_S, End, Frame, abandoned, dropped, log, not_found, seq_of
from goodput_gateway.resume.recording import Recording, ResumeMetrics
from goodput_gateway.storage import DEFAULT_STORAGE, AsyncStorageLedger


class Buffer(Protocol):
    """What the store needs of the buffer that holds it (:class:`goodput_gateway.resume.buffer.StreamBuffer`)."""

    settings: GatewaySettings
    metrics: ResumeMetrics
    window_s: float
    heartbeat_s: float
    live_ttl_s: float
    block_s: float
    clock: Callable[[], float]
    dirty: set[Recording]
    by_key: dict[str, Recording]
    ledger: AsyncStorageLedger | None

    def idle_too_long(self, rec: Recording, now: float) -> bool: ...

    def abandon(self, rec: Recording) -> None: ...

    def forget(self, rec: Recording) -> None: ...

__all__ = ["RedisStreams"]


class RedisStreams:
    """Writes with ``redis``; followers read with ``readers`` (a pool of their own, capped: one connection per
    blocking XREAD, so the cap bounds what a replica's resumes hold)."""

    def __init__(self, buffer: Buffer, redis: aioredis.Redis, readers: aioredis.Redis) -> None:
        self.buffer = buffer
        self.redis = redis
        self.readers = readers

    async def open(self, key: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        give_up = time.monotonic() + max(4 * self.buffer.settings.resume.flush_s, UNKNOWN_AFTER_S)
        while True:
            try:
                info = await self.readers.xinfo_stream(key)
                break
            except ResponseError as err:
                if "no such key" not in str(err).lower():
                    raise self.read_error(err) from None
                if time.monotonic() >= give_up:
                    raise not_found(stream_id) from None
            except (RedisError, OSError) as err:
                raise self.read_error(err) from None
            await asyncio.sleep(self.buffer.settings.resume.flush_s)
        last = info.get("last-entry")
        if last and b"e" in last[1] and End.decode(last[1][b"e"]).status == "abandoned":
            raise abandoned(stream_id)
        first_entry = info.get("first-entry")
        first = seq_of(first_entry[0]) if first_entry else seq_of(info["last-generated-id"]) + 1
        if after + 1 < first:
            raise dropped(stream_id, after, first)
        return self._follow(key, stream_id, after)

    def read_error(self, err: BaseException) -> Unavailable:
        self.buffer.metrics.errors.labels("read").inc()
        log.warning("the stream store failed", extra={"error": repr(err)})
        return Unavailable(f"the stream store is unavailable ({type(err).__name__})", code="store_unavailable")

    async def _follow(self, key: str, stream_id: str, after: int) -> AsyncGenerator[Frame, None]:
        """The events after number ``after`` from Redis: caught up, then followed with a blocking XREAD. Every
        heartbeat while it reads (or waits for events) the follower marks where it is (``<key>:readers``): the
        producer then neither cuts the generation nor runs more than the bounds ahead of it."""
        cursor = after + 1  # the entry id (0-<n>) of the last event received; the next wanted has number n
        marked, name = float("-inf"), uuid.uuid4().hex[:16]
        try:
            while True:
                try:
                    if self.buffer.clock() - marked >= self.buffer.heartbeat_s:
                        marked = await self._mark(key, name, cursor)
                    found: Any = await self.readers.xread({key: f"0-{cursor}"}, count=256,
                                                          block=max(int(self.buffer.block_s * 1000), 1))
                    if not found:
                        quiet = await self._quiet(key, stream_id, cursor)
                        if isinstance(quiet, End):
                            quiet.raise_error(stream_id)
                            return
                        found = quiet
                except (RedisError, OSError) as err:
                    raise self.read_error(err) from None
                for _, entries in found:
                    for entry_id, fields in entries:
                        seq = seq_of(entry_id)
                        if seq != cursor:  # a gap: dropped by the bounds while this reader was behind
                            raise dropped(stream_id, cursor - 1, seq)
                        if b"e" in fields:
                            End.decode(fields[b"e"]).raise_error(stream_id)
                            return
                        yield Frame(seq, fields[b"d"])
                        cursor = seq + 1
                        if self.buffer.clock() - marked >= self.buffer.heartbeat_s:  # a slow reader marks too
                            try:
                                marked = await self._mark(key, name, cursor)
                            except (RedisError, OSError) as err:
                                raise self.read_error(err) from None
        finally:  # gone: not waited for, but the generation still runs the window for a reconnect
            with contextlib.suppress(RedisError, OSError, TimeoutError):  # at most a moment: the stream is over
                await asyncio.wait_for(self._mark(key, name, None), timeout=self.buffer.heartbeat_s)

    async def _mark(self, key: str, name: str, cursor: int | None) -> float:
        """Where a follower is (``<next seq>:<unix ms>``; ``left`` once gone), kept the window; when it marked it (the
        buffer's clock)."""
        pipe = self.readers.pipeline(transaction=False)
        pipe.hset(f"{key}:readers", name, "left" if cursor is None else f"{cursor}:{int(time.time() * 1000)}")
        pipe.pexpire(f"{key}:readers", max(int(self.buffer.window_s * 1000), 1))
        await pipe.execute()
        return self.buffer.clock()

    async def _quiet(self, key: str, stream_id: str, cursor: int) -> Any:
        """Nothing new for a while: nothing to read while the producer lives; what came meanwhile, or the end (also
        for a reader that claims events past it), once it is gone; an error when it died before the end (its
        replica is gone)."""
        pipe = self.readers.pipeline(transaction=False)
        pipe.exists(f"{key}:live")
        pipe.exists(key)
        alive, exists = await pipe.execute()
        if alive and exists:
            return []
        if exists:
            found = await self.readers.xread({key: f"0-{cursor}"}, count=256)
            if found:
                return found
            last: Any = await self.readers.xrevrange(key, count=1)
            if last and b"e" in last[0][1]:
                return End.decode(last[0][1][b"e"])
        raise Unavailable(f"the gateway replica producing stream '{stream_id}' stopped before its end; the answer is "
                          "incomplete: retry the request", code="stream_lost")

    async def write(self, *, beat: bool, now: float) -> None:
        recs = set(self.buffer.dirty)
        self.buffer.dirty.clear()
        if beat:
            recs.update(r for r in self.buffer.by_key.values() if r.end is None)
        if not recs:
            return
        window_ms = max(int(self.buffer.window_s * 1000), 1)
        live_ms = int(self.buffer.live_ttl_s * 1000)
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
            check = marks = None
            if beat and self.buffer.idle_too_long(rec, now):
                check = len(pipe)
                pipe.exists(f"{rec.key}:readers")
            if beat and rec.end is None and rec.shared:  # where its followers on other replicas are
                marks = len(pipe)
                pipe.hgetall(f"{rec.key}:readers")
            plans.append((rec, batch, start, len(pipe), first, ending, check, marks))
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException:
            for rec, batch, *_ in plans:
                self.retry(rec, batch)
            raise
        ended, wall = [], time.time()
        for rec, batch, start, stop, first, ending, check, marks in plans:
            if marks is not None and isinstance(results[marks], dict):
                rec.remote(_marks(results[marks], wall), now)
            failed = [r for r in results[start:stop] if isinstance(r, Exception)
                      and "equal or smaller" not in str(r)]  # an XADD already applied by a turn that failed late
            if failed:
                self.buffer.metrics.errors.labels("write").inc()
                log.warning("writing a stream's events failed",
                            extra={"stream": rec.stream_id, "error": repr(failed[0])})
                self.retry(rec, batch)
                continue
            rec.announced, rec.stored_first = True, max(rec.stored_first, first)
            self.buffer.metrics.stored.inc(sum(len(d) for _, d in batch))
            if ending:
                rec.end_stored = True
                ended.append(rec)
                self.buffer.forget(rec)
            elif check is not None and not results[check]:
                self.buffer.abandon(rec)
        await self.release(ended)

    async def release(self, ended: list[Recording]) -> None:
        """Ended streams hold their place in their tenants' quotas only until their events expire (one round trip
        for all of them)."""
        if not ended or self.buffer.ledger is None:
            return
        until = time.time() + self.buffer.window_s
        try:
            await self.buffer.ledger.reserve_many([(r.tenant, "resume", r.key, until, DEFAULT_STORAGE) for r in ended])
        except GoodputError as err:  # they keep their places until the longest a stream may run
            self.buffer.metrics.errors.labels("quota").inc()
            log.warning("ended streams keep their places in the quota longer", extra={"error": err.message})

    def retry(self, rec: Recording, batch: list[tuple[int, bytes]]) -> None:
        rec.pending = [p for p in batch + rec.pending if p[0] >= rec.first]
        self.buffer.dirty.add(rec)


def _marks(raw: dict[bytes, bytes], wall: float) -> dict[str, tuple[int, float]]:
    """Followers' marks (name: ``<next seq>:<unix ms>``) as name: (next seq, seconds since the mark); those that left
    are not waited for."""
    out = {}
    for name, value in raw.items():
        seq, _, ms = value.partition(b":")
        if seq.isdigit() and ms.isdigit():
            out[name.decode()] = (int(seq), max(wall - int(ms) / 1000, 0.0))
    return out
