"""Stream resume's buffer (goodput_gateway.resume.StreamBuffer), against a real Redis shared by two "replicas" (two
buffers on one Redis) and in this process without one: a resume gets exactly the events after the last one
received, following a running stream live; the bounds drop the oldest events (a resume before them is 410, the
newest still resume); the window expires a stream; only its tenant sees it; a generation nobody follows is cut after
the window, one followed from another replica is not; a replica that dies mid-stream is an error, not a wait.
The buffers' windows and heartbeats run on a :class:`FakeClock` the test moves; Redis's key expiry keeps its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from goodput_core.errors import NotFound, ResourceExhausted, Unavailable, Unimplemented
from goodput_testing import async_wait_until, dead_port

from goodput_gateway.config import GatewaySettings
from goodput_gateway.resume import Frame, StreamBuffer, StreamGone, parse_last_event_id, sse_events
from goodput_gateway.storage import StorageQuota

from .helpers import FakeClock

TIMING = {"heartbeat_s": 0.05, "live_ttl_s": 1.0, "block_s": 0.05}


class Source:
    """An API's event stream under the test's control: ``send`` events, ``None`` to end, an exception to fail."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.closed = 0  # the generation's closer calls

    def send(self, *items: bytes | BaseException | None) -> None:
        for item in items:
            self.queue.put_nowait(item)

    async def events(self) -> AsyncIterator[bytes]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def closer(self) -> None:
        self.closed += 1


def frames(n: int, start: int = 0) -> list[bytes]:
    return [f"data: {i}\n\n".encode() for i in range(start, start + n)]


async def take(it: AsyncIterator[Frame], n: int | None = None) -> list[Frame]:
    out: list[Frame] = []
    async for frame in it:
        out.append(frame)
        if n is not None and len(out) == n:
            break
    return out


async def stored(buffer: StreamBuffer, api: str, tenant: str, stream_id: str) -> None:
    """Waits for the stream's first events in Redis (a loaded machine may run the flusher late)."""
    if buffer.redis is not None:
        key = buffer.key(api, tenant, stream_id)
        await async_wait_until(lambda: buffer.redis.exists(key), timeout=5, interval=0.01,  # type: ignore[union-attr]
                               message=f"{key} was never written")


@pytest.fixture(params=["redis", "local"])
async def replicas(request: pytest.FixtureRequest, redis_url: str,
                   redis_prefix: str) -> AsyncIterator[Callable[..., tuple[StreamBuffer, StreamBuffer]]]:
    """A factory of two buffers: on one Redis (two replicas), or one in-process buffer (a resume must reach the
    replica that produced the stream)."""
    made: list[StreamBuffer] = []

    def make(*, clock: Callable[[], float] = time.monotonic, **resume: object) -> tuple[StreamBuffer, StreamBuffer]:
        settings = GatewaySettings(resume={"window_s": 30.0, "prefix": redis_prefix, "flush_s": 0.01, **resume},
                                   quotas={"prefix": f"{redis_prefix}-quota"})
        pair = [StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url) if request.param == "redis" else None,
                             clock=clock, **TIMING) for _ in range(2 if request.param == "redis" else 1)]
        made.extend(pair)
        return pair[0], pair[-1]

    yield make
    await close(*made)


async def close(*buffers: StreamBuffer) -> None:
    for b in buffers:
        await b.close()
        if b.redis is not None:
            await b.redis.aclose()


async def test_a_resume_gets_exactly_the_events_after_the_last_one_received(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = replicas()
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-1", closer=source.closer)
    source.send(*frames(5))
    got = await take(client, 3)
    assert [f.seq for f in got] == [0, 1, 2]
    await client.aclose()  # the client's connection drops: the generation goes on
    source.send(*frames(5, start=5))
    await stored(a, "sse", "acme", "req-1")  # written every resume_flush_s: the other replica finds it from then on
    resumed = await b.resume(api="sse", tenant="acme", stream_id="req-1", after=2)
    first = await take(resumed, 4)  # caught up (from Redis on the other replica), then followed live
    assert [f.seq for f in first] == [3, 4, 5, 6]
    source.send(*frames(3, start=10), None)
    rest = await take(resumed)
    assert [f.seq for f in rest] == [7, 8, 9, 10, 11, 12]
    assert b"".join(f.data for f in got + first + rest) == b"".join(frames(13))
    assert source.closed == 1  # the generation was closed once, at its end, not when the client went away
    # after its end: the whole stream again, to its end; nothing after the last event
    assert [f.seq for f in await take(await b.resume(api="sse", tenant="acme", stream_id="req-1", after=-1))] \
        == list(range(13))
    assert await take(await b.resume(api="sse", tenant="acme", stream_id="req-1", after=12)) == []


class Looking(aioredis.Redis):
    """A replica's Redis client that counts the streams it looked for and did not find (yet)."""

    missed = 0

    async def xinfo_stream(self, name: Any, full: bool = False) -> Any:
        try:
            return await super().xinfo_stream(name, full)
        except ResponseError:
            self.missed += 1
            raise


async def test_a_resume_on_another_replica_before_the_first_flush_waits_for_it(redis_url: str,
                                                                              redis_prefix: str) -> None:
    """A client reconnects to another replica before the producing one has written anything of the stream to Redis
    (its first events are written at its next flush): the stream is looked for again for a moment, not answered
    404."""
    settings = GatewaySettings(resume={"window_s": 30, "prefix": redis_prefix, "flush_s": 0.1},
                               quotas={"prefix": f"{redis_prefix}-quota"})
    looking = Looking.from_url(redis_url)
    a = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING)
    b = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), readers=looking, **TIMING)  # b's resumes
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-early", closer=source.closer)
    resuming = asyncio.ensure_future(b.resume(api="sse", tenant="acme", stream_id="req-early", after=-1))
    await async_wait_until(lambda: looking.missed, timeout=5, interval=0.005)  # b has looked: nothing there yet
    source.send(*frames(2), None)
    assert [f.seq for f in await take(await resuming)] == [0, 1]
    await client.aclose()
    await close(a, b)
    await looking.aclose()


async def test_only_its_tenant_may_resume_a_stream_and_unknown_ids_are_404(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = replicas()
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-2", closer=source.closer)
    source.send(*frames(2), None)
    assert len(await take(client)) == 2
    for api, tenant, sid in (("sse", "globex", "req-2"), ("sse", "acme", "req-unknown"), ("grpc", "acme", "req-2")):
        with pytest.raises(NotFound) as refused:
            await b.resume(api=api, tenant=tenant, stream_id=sid, after=-1)
        assert refused.value.code == "stream_not_found"
    assert b.metrics.resumes.labels("sse", "not_found")._value.get() == 2  # noqa: SLF001


async def test_the_bounds_drop_the_oldest_events_and_a_resume_before_them_is_gone(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = replicas(max_events=4, max_bytes=1024)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-3", closer=source.closer)
    await client.aclose()
    source.send(*frames(10), None)
    await async_wait_until(lambda: source.closed == 1, timeout=5)
    with pytest.raises(StreamGone) as gone:
        await b.resume(api="sse", tenant="acme", stream_id="req-3", after=2)
    assert gone.value.code == "stream_events_dropped" and gone.value.http_status == 410
    assert [f.seq for f in await take(await b.resume(api="sse", tenant="acme", stream_id="req-3", after=5))] \
        == [6, 7, 8, 9]
    # bytes bound: 3 events of 400 bytes in 1024
    big = Source()
    client = a.stream(big.events(), api="sse", tenant="acme", stream_id="req-4", closer=big.closer)
    await client.aclose()
    big.send(*[bytes([65 + i]) * 400 for i in range(5)], None)
    await async_wait_until(lambda: big.closed == 1, timeout=5)
    with pytest.raises(StreamGone):
        await b.resume(api="sse", tenant="acme", stream_id="req-4", after=1)
    assert [f.data[:1] for f in await take(await b.resume(api="sse", tenant="acme", stream_id="req-4",
                                                          after=2))] == [b"D", b"E"]
    assert a.metrics.overflows._value.get() == 2  # noqa: SLF001


async def test_a_stream_expires_its_window_after_its_end(replicas) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    a, b = replicas(window_s=0.4, clock=clock)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-5", closer=source.closer)
    source.send(*frames(3), None)
    assert len(await take(client)) == 3
    resumed = await async_wait_until(lambda: _resumable(b, "req-5", after=0), timeout=5)
    assert len(await take(resumed)) == 2  # type: ignore[arg-type]
    clock.advance(0.4)  # the window passes for the buffers
    if a.redis is not None:  # Redis expires the stream's keys by its own clock
        prefix = a.settings.resume.prefix
        await async_wait_until(lambda: _no_keys(a.redis, prefix), timeout=5, message="keys left after the window")
    else:
        await async_wait_until(lambda: not a.recordings(), timeout=5)  # forgotten by the flusher's next sweep
    with pytest.raises(NotFound):
        await b.resume(api="sse", tenant="acme", stream_id="req-5", after=0)


async def _no_keys(redis: aioredis.Redis, prefix: str) -> bool:
    return not await redis.keys(f"{prefix}:*")


async def _turns(clock: FakeClock, n: int = 2) -> None:
    """Waits until the code on ``clock`` has read it ``n`` more times: a flusher's turn that began after the clock
    moved has ended once the next one begins."""
    reads = clock.reads
    await async_wait_until(lambda: clock.reads >= reads + n, timeout=5, interval=0.005)


async def test_a_generation_nobody_follows_is_cut_after_the_window(replicas) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    a, b = replicas(window_s=0.5, clock=clock)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-6", closer=source.closer)
    source.send(*frames(2))
    assert len(await take(client, 2)) == 2
    await client.aclose()
    clock.advance(0.4)
    await _turns(clock)
    assert source.closed == 0  # within the window: it runs on for a reconnect
    clock.advance(0.1)
    await async_wait_until(lambda: source.closed == 1, timeout=5, message="the abandoned generation still runs")

    async def refused() -> str | None:  # once its end is written (at the flusher's next turn, on another replica)
        try:
            await b.resume(api="sse", tenant="acme", stream_id="req-6", after=1)
        except StreamGone as gone:
            return gone.code
        return None
    assert await async_wait_until(refused, timeout=5) == "stream_abandoned"
    assert a.metrics.detached.labels("abandoned")._value.get() == 1  # noqa: SLF001


async def test_a_follower_on_another_replica_keeps_the_generation_going(redis_url: str, redis_prefix: str) -> None:
    settings = GatewaySettings(resume={"window_s": 0.4, "prefix": redis_prefix, "flush_s": 0.01},
                               quotas={"prefix": f"{redis_prefix}-quota"})
    a = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING)
    b = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING)
    source = Source()
    await a.stream(source.events(), api="sse", tenant="acme", stream_id="req-7", closer=source.closer).aclose()
    source.send(*frames(1))
    resumed = await async_wait_until(lambda: _resumable(b, "req-7"), timeout=5)
    received: list[Frame] = []

    async def follow() -> None:
        received.extend(await take(resumed))

    follower = asyncio.ensure_future(follow())
    for i in range(1, 9):  # twice the window, an event every 0.1 s: the producer's replica has no follower of its own
        source.send(*frames(1, start=i))
        await asyncio.sleep(0.1)
    assert source.closed == 0
    source.send(None)
    await asyncio.wait_for(follower, 5)
    assert [f.seq for f in received] == list(range(9)) and source.closed == 1
    await close(a, b)


async def test_a_replica_that_dies_mid_stream_is_an_error_not_a_wait(redis_url: str, redis_prefix: str) -> None:
    settings = GatewaySettings(resume={"window_s": 30, "prefix": redis_prefix, "flush_s": 0.01},
                               quotas={"prefix": f"{redis_prefix}-quota"})
    a = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING)
    b = StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING)
    source = Source()
    await a.stream(source.events(), api="sse", tenant="acme", stream_id="req-8", closer=source.closer).aclose()
    source.send(*frames(3))
    resumed = await async_wait_until(lambda: _resumable(b, "req-8"), timeout=5)
    assert len(await take(resumed, 3)) == 3
    (flusher,) = [t for t in asyncio.all_tasks() if t.get_name() == "stream flusher"]  # a's: b produces nothing
    flusher.cancel()  # the replica dies: nothing more is written, its heartbeat lapses
    with pytest.raises(Unavailable) as lost:
        await asyncio.wait_for(take(resumed), 5)
    assert lost.value.code == "stream_lost"
    source.send(None)
    await close(a, b)


async def _resumable(buffer: StreamBuffer, sid: str, *, api: str = "sse", after: int = -1,
                     tenant: str = "acme") -> object:
    """The stream's events once they reached the store (another replica sees them a flush after they were made)."""
    try:
        return await buffer.resume(api=api, tenant=tenant, stream_id=sid, after=after)
    except NotFound:
        return None


async def test_an_error_the_stream_ended_with_reaches_every_follower(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = replicas()
    source = Source()
    client = a.stream(source.events(), api="grpc", tenant="acme", stream_id="req-9", closer=source.closer)
    source.send(*frames(2), Unavailable("the inference worker failed mid-stream", code="worker_lost"))
    with pytest.raises(Unavailable) as failed:
        await take(client)
    assert failed.value.code == "worker_lost"
    resumed = await async_wait_until(lambda: _resumable(b, "req-9", api="grpc", after=0), timeout=5)
    with pytest.raises(Unavailable):
        await take(resumed)
    # on SSE the error is the last event, without an id
    sse = Source()
    client = a.stream(sse.events(), api="sse", tenant="acme", stream_id="req-10", closer=sse.closer)
    sse.send(b"data: {}\n\n", RuntimeError("bug"))
    body = b"".join([e async for e in sse_events(client, "req-10")])
    assert body.startswith(b"id: req-10:0\ndata: {}\n\n") and b'"type":"server_error"' in body


async def test_without_redis_reachable_the_client_is_still_served() -> None:
    down = aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0", socket_connect_timeout=0.2)
    a = StreamBuffer(GatewaySettings(resume={"window_s": 30, "flush_s": 0.01}), redis=down,
                     **TIMING)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-11", closer=source.closer)
    source.send(*frames(4), None)
    assert [f.seq for f in await take(client)] == [0, 1, 2, 3]
    await async_wait_until(lambda: a.metrics.errors.labels("write")._value.get() >= 1, timeout=5)  # noqa: SLF001
    # on this replica the recording itself still resumes, until it is written or its window passes
    assert len(await take(await a.resume(api="sse", tenant="acme", stream_id="req-11", after=1))) == 2
    await close(a)


async def test_with_redis_unreachable_a_generation_nobody_follows_is_still_cut() -> None:
    down = aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0", socket_connect_timeout=0.2)
    clock = FakeClock()
    a = StreamBuffer(GatewaySettings(resume={"window_s": 0.3, "flush_s": 0.01}), redis=down, clock=clock, **TIMING)
    source = Source()
    await a.stream(source.events(), api="sse", tenant="acme", stream_id="req-12", closer=source.closer).aclose()
    source.send(*frames(2))
    clock.advance(0.3)
    await async_wait_until(lambda: source.closed == 1, timeout=5, message="the abandoned generation still runs")
    await close(a)


async def test_closing_ends_every_stream_even_one_whose_producer_does_not_stop() -> None:
    """The gateway stops: a stream still producing ends with a clear error for its client, and its generation is
    closed; one whose source ignores the cancel (a bug) cannot hold the shutdown: close() returns after the bounded
    wait and that stream's client gets the same error."""
    released = asyncio.Event()

    async def stubborn() -> AsyncIterator[bytes]:
        yield b"data: 0\n\n"
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if released.is_set():
                    raise
                # else: does not stop when asked

    a = StreamBuffer(GatewaySettings(resume={"window_s": 30, "flush_s": 0.01}), redis=None, close_wait_s=0.2,
                     **TIMING)
    polite, stuck = Source(), Source()
    clients = [a.stream(polite.events(), api="sse", tenant="acme", stream_id="req-13", closer=polite.closer),
               a.stream(stubborn(), api="sse", tenant="acme", stream_id="req-14", closer=stuck.closer)]
    (producer,) = [t for t in asyncio.all_tasks() if t.get_name() == "stream req-14"]
    try:
        polite.send(*frames(1))
        for client in clients:
            assert [f.seq for f in await take(client, 1)] == [0]
        await asyncio.wait_for(a.close(), timeout=5)
        for client in clients:
            with pytest.raises(Unavailable) as stopped:
                await take(client)
            assert stopped.value.code == "gateway_stopped"
        assert polite.closed == 1
        assert stuck.closed == 0  # its source still in use: not closed under it
    finally:  # the test's own cleanup, pass or fail: the stuck producer stops at its next cancel
        released.set()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


async def test_resume_off_is_a_clear_refusal() -> None:
    off = StreamBuffer(GatewaySettings(), redis=None)
    assert not off.enabled
    with pytest.raises(Unimplemented):
        await off.resume(api="sse", tenant="acme", stream_id="req-1", after=-1)


def test_last_event_id_is_checked() -> None:
    assert parse_last_event_id(" req-1:0 ") == ("req-1", 0)
    assert parse_last_event_id("resp_ab:12", stream_id="resp_ab") == ("resp_ab", 12)
    from goodput_core.errors import InvalidArgument

    for bad in ("req-1", "req-1:-1", "req-1:x", ":3", "a b:1", "req-1:99999999999999"):
        with pytest.raises(InvalidArgument):
            parse_last_event_id(bad)
    with pytest.raises(InvalidArgument):
        parse_last_event_id("req-1:3", stream_id="req-2")


async def test_a_tenant_past_its_resume_quota_is_recorded_on_its_replica_only(redis_url: str,
                                                                             redis_prefix: str) -> None:
    """resume_streams (goodput_gateway.storage) bounds a tenant's recordings in Redis: past it, a stream is still
    served and resumable on its own replica, never written to the shared store; another tenant's are; an ended
    stream holds its place only for the window."""
    settings = GatewaySettings(resume={"window_s": 30, "prefix": redis_prefix, "flush_s": 0.01},
                               quotas={"prefix": f"{redis_prefix}-quota"})
    quota = StorageQuota(resume_streams=1)
    a, b = (StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), quota_of=lambda tenant: quota, **TIMING)
            for _ in range(2))
    for tenant, sid in (("acme", "req-q1"), ("acme", "req-q2"), ("globex", "req-q3")):  # one after the other
        source = Source()
        client = a.stream(source.events(), api="sse", tenant=tenant, stream_id=sid, closer=source.closer)
        source.send(*frames(2), None)
        assert len(await take(client)) == 2
        if sid != "req-q2":
            await stored(a, "sse", tenant, sid)
    assert [f.seq for f in await take(await b.resume(api="sse", tenant="acme", stream_id="req-q1", after=0))] == [1]
    assert not await a.redis.exists(a.key("sse", "acme", "req-q2"))  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        await b.resume(api="sse", tenant="acme", stream_id="req-q2", after=-1)
    assert len(await take(await a.resume(api="sse", tenant="acme", stream_id="req-q2", after=-1))) == 2
    assert a.ledger is not None
    await async_wait_until(lambda: _held_until(a, "acme"), timeout=5, message="the ended stream's hold not moved")
    await close(a, b)


async def _held_until(buffer: StreamBuffer, tenant: str) -> bool:
    """True once the tenant's one held recording expires within the window (its end moved its hold)."""
    assert buffer.redis is not None and buffer.ledger is not None
    held = await buffer.redis.zrange(buffer.ledger._keys(tenant, "resume")[0], 0, -1, withscores=True)  # noqa: SLF001
    return len(held) == 1 and held[0][1] <= time.time() + buffer.window_s + 1


async def test_a_slow_client_paces_its_generation_and_gets_every_event(replicas) -> None:  # type: ignore[no-untyped-def]
    """A client that stops reading while its stream runs is waited for (flow control), not cut: the generation stops
    pulling events once the client has RESUME__MAX_EVENTS to read, and goes on as the client reads on."""
    a, _ = replicas(max_events=4, max_bytes=1024)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-p1", closer=source.closer)
    source.send(*frames(20))
    assert [f.seq for f in await take(client, 1)] == [0]  # then the client reads nothing for a while
    await async_wait_until(lambda: source.queue.qsize() == 15, timeout=5)  # 4 to read, the 5th waits its turn
    await asyncio.sleep(0.3)
    assert source.queue.qsize() == 15 and a.metrics.overflows._value.get() == 0  # noqa: SLF001
    source.send(None)
    rest = await take(client)
    assert [f.seq for f in rest] == list(range(1, 20))  # every event, none dropped
    assert b"".join(f.data for f in rest) == b"".join(frames(19, start=1))
    assert a.metrics.paced._value.get() > 0 and a.metrics.stalled._value.get() == 0  # noqa: SLF001


async def test_a_slow_follower_on_another_replica_paces_the_generation_too(redis_url: str,
                                                                          redis_prefix: str) -> None:
    """A client that came back on another replica reads the stream from Redis; where it is (its mark, every
    heartbeat) paces the producing replica as a client of its own would: it gets every event."""
    settings = GatewaySettings(resume={"window_s": 30, "prefix": redis_prefix, "flush_s": 0.01, "max_events": 4,
                                       "max_bytes": 1024}, quotas={"prefix": f"{redis_prefix}-quota"})
    a, b = (StreamBuffer(settings, redis=aioredis.Redis.from_url(redis_url), **TIMING) for _ in range(2))
    source = Source()
    await a.stream(source.events(), api="sse", tenant="acme", stream_id="req-p3", closer=source.closer).aclose()
    source.send(*frames(1))
    resumed = await async_wait_until(lambda: _resumable(b, "req-p3"), timeout=5)
    assert [f.seq for f in await take(resumed, 1)] == [0]  # type: ignore[arg-type]  # then it reads nothing a while
    await async_wait_until(lambda: any(c.name for r in a.recordings() for c in r.cursors), timeout=5,
                           message="the producer never saw the follower's mark")
    source.send(*frames(19, start=1))
    await async_wait_until(lambda: source.queue.qsize() == 15, timeout=5)
    await asyncio.sleep(0.3)
    assert source.queue.qsize() == 15
    source.send(None)
    assert [f.seq for f in await take(resumed)] == list(range(1, 20))  # type: ignore[arg-type]
    await close(a, b)


async def test_a_client_that_reads_nothing_for_the_stall_timeout_is_let_go(replicas) -> None:  # type: ignore[no-untyped-def]
    """One client cannot hold a generation (and its worker) forever: one that reads nothing for
    RESUME__STALL_TIMEOUT_S is waited for no more; the generation runs to its end, and the client, should it read
    again, gets 410 stream_events_dropped saying why."""
    clock = FakeClock()
    a, _ = replicas(max_events=4, max_bytes=1024, stall_timeout_s=10, clock=clock)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-p2", closer=source.closer)
    source.send(*frames(12), None)
    assert len(await take(client, 1)) == 1
    await async_wait_until(lambda: source.queue.qsize() == 8, timeout=5)  # paced
    clock.advance(9)
    await _turns(clock)
    assert source.closed == 0 and source.queue.qsize() == 8  # still waited for
    clock.advance(1)
    await async_wait_until(lambda: source.closed == 1, timeout=5, message="the generation still waits")
    with pytest.raises(StreamGone) as gone:
        await take(client)
    assert gone.value.code == "stream_events_dropped" and "RESUME__STALL_TIMEOUT_S" in gone.value.message
    assert a.metrics.stalled._value.get() == 1  # noqa: SLF001


async def test_a_follower_past_the_streams_bound_is_refused_with_429(replicas) -> None:  # type: ignore[no-untyped-def]
    """RESUME__MAX_FOLLOWERS_PER_STREAM resumes follow a stream at once on a replica (its client's own response
    aside); one more is 429 too_many_stream_followers in OpenAI's shape; a follower that goes (even before reading
    anything) gives its place back."""
    a, b = replicas(max_followers_per_stream=2)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-f1", closer=source.closer)
    source.send(*frames(3))
    followers = [await async_wait_until(lambda: _resumable(b, "req-f1"), timeout=5) for _ in range(2)]
    with pytest.raises(ResourceExhausted) as refused:
        await b.resume(api="sse", tenant="acme", stream_id="req-f1", after=-1)
    error = refused.value.openai_body()["error"]
    assert refused.value.http_status == 429 and refused.value.retry_after_s
    assert error["code"] == "too_many_stream_followers" and error["type"] == "rate_limit_error"
    assert b.metrics.resumes.labels("sse", "limited")._value.get() == 1  # noqa: SLF001
    assert _followers(b) == 2
    assert len(await take(followers[0], 3)) == 3  # type: ignore[arg-type]
    await followers[0].aclose()  # type: ignore[attr-defined]
    await followers[1].aclose()  # type: ignore[attr-defined]  # before its first event
    again = [await b.resume(api="sse", tenant="acme", stream_id="req-f1", after=0) for _ in range(2)]
    source.send(None)
    for follower in again:
        assert [f.seq for f in await take(follower)] == [1, 2]
    assert len(await take(client)) == 3


async def test_a_tenants_followers_are_bounded_across_its_streams(replicas) -> None:  # type: ignore[no-untyped-def]
    """RESUME__MAX_FOLLOWERS_PER_TENANT bounds a tenant's resumes on a replica, whatever stream they follow; another
    tenant's are its own."""
    a, b = replicas(max_followers_per_tenant=2)
    sources = {sid: Source() for sid in ("req-t1", "req-t2", "req-t3")}
    for sid, source in sources.items():
        tenant = "globex" if sid == "req-t3" else "acme"
        await a.stream(source.events(), api="sse", tenant=tenant, stream_id=sid, closer=source.closer).aclose()
        source.send(*frames(2), None)
    held = [await async_wait_until(lambda sid=sid: _resumable(b, sid), timeout=5) for sid in ("req-t1", "req-t2")]
    with pytest.raises(ResourceExhausted) as refused:
        await b.resume(api="sse", tenant="acme", stream_id="req-t1", after=-1)
    assert refused.value.code == "too_many_tenant_followers"
    assert _followers(b) == 2
    other = await async_wait_until(lambda: _resumable(b, "req-t3", tenant="globex"), timeout=5)
    assert len(await take(other)) == 2  # type: ignore[arg-type]
    assert len(await take(held[0])) == 2  # type: ignore[arg-type]  # read to its end: its place is free again
    assert len(await take(await b.resume(api="sse", tenant="acme", stream_id="req-t1", after=-1))) == 2
    await held[1].aclose()  # type: ignore[attr-defined]
    assert _followers(b) == 0


async def test_past_the_memory_bound_new_streams_are_served_but_not_kept(replicas) -> None:  # type: ignore[no-untyped-def]
    """RESUME__MAX_TOTAL_BYTES bounds what a replica's recordings hold: with it reached (here by a client that has
    1.2 MiB to read), a new stream still serves its client every event but is not recorded (a resume is 404, its
    client leaving cuts it, as with resume off); the bound's own client loses nothing."""
    a, b = replicas(max_total_bytes=1 << 20, max_bytes=2 << 20)
    big = Source()
    slow = a.stream(big.events(), api="sse", tenant="acme", stream_id="req-m1", closer=big.closer)
    chunks = [bytes([65 + i]) * (300 << 10) for i in range(4)]
    big.send(*chunks)
    await async_wait_until(lambda: a.budget.full, timeout=5)
    source = Source()
    client = a.stream(source.events(), api="sse", tenant="acme", stream_id="req-m2", closer=source.closer)
    source.send(*frames(3))
    assert [f.seq for f in await take(client, 3)] == [0, 1, 2]  # its client is served
    assert a.metrics.full.labels("unrecorded")._value.get() == 1  # noqa: SLF001
    for buffer in {a, b}:
        with pytest.raises(NotFound):
            await buffer.resume(api="sse", tenant="acme", stream_id="req-m2", after=0)
    await client.aclose()
    await async_wait_until(lambda: source.closed == 1, timeout=5, message="the unrecorded stream runs on")
    big.send(None)
    assert [f.data for f in await take(slow)] == chunks  # the slow client got all of its own
    if a.redis is not None:  # its end in Redis: it is no longer held here
        await async_wait_until(lambda: not a.budget.full, timeout=5)
    # room again (without Redis: the finished stream kept here is forgotten for it): recorded, resumable
    kept = Source()
    client = a.stream(kept.events(), api="sse", tenant="acme", stream_id="req-m3", closer=kept.closer)
    kept.send(*frames(2), None)
    assert len(await take(client)) == 2
    resumed = await async_wait_until(lambda: _resumable(b, "req-m3", after=0), timeout=5)
    assert [f.seq for f in await take(resumed)] == [1]  # type: ignore[arg-type]
    if a.redis is None:
        assert a.metrics.full.labels("evicted")._value.get() == 1  # noqa: SLF001
        with pytest.raises(NotFound):
            await a.resume(api="sse", tenant="acme", stream_id="req-m1", after=0)


def _followers(buffer: StreamBuffer) -> float:
    """goodput_gateway_stream_followers, as scraped."""
    return buffer.metrics.followers.collect()[0].samples[0].value
