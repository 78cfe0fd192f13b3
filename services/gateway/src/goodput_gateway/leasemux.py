"""How the gateway leases workers: every request's lease over one long-lived ``Scheduler/LeaseBatches`` stream to the
scheduler, not a stream set up and torn down per request.

One stream per gateway process, opened on first use. Messages go out through one queue that gRPC drains in order (a
stream takes one write at a time): what queued up while the previous write was in flight goes out as one batch
message (``goodput_core.batching``), so under load an admit waits for at most one write, not for every message ahead
of it. Events come back, batched the same way by the scheduler, through one reader task that hands each to its lease
by ``lease_id``. A lease is admit, then ``granted`` (or a ``LeaseError``, turned back into the
:class:`~goodput_core.errors.GoodputError` it stands for), first token, release. A caller that goes away while it
waits sends ``cancel``. A granted lease may be ``preempted`` before its first token (the scheduler made room for a
tenant below its fair share): it is released there, and :meth:`LeaseStream.preempted` tells its holder, which
admits the request again.

**Failover.** The scheduler runs active-passive (``goodput_scheduler.leader``); the channel reaches the replica that
leads. When the stream breaks (the leader died, stepped down or restarted), the scheduler side has given back
everything the stream held, and the gateway:

* opens a new stream (retrying with a short backoff while no replica leads yet, for up to ``FAILOVER_WINDOW_S``)
  and *attaches* every lease it still holds (the request is still streaming from its worker), so the new leader's
  counts are right again;
* re-admits every admission that was still waiting, within its own deadline and the same window: a request a retry
  can save is not lost (it joins the new leader's queue at the back).

A scheduler that was never reachable is not a failover: the admission fails at once with UNAVAILABLE (503).

Example (in a coroutine)::

    leases = LeaseStream(scheduler_stub)
    granted = await leases.acquire("req-1", admit, timeout_s=30)     # or raises ResourceExhausted, ...
    leases.first_token("req-1", ttft_s=0.12)
    await leases.release("req-1", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from opentelemetry import propagate

from goodput_core.batching import batched
from goodput_core.errors import DeadlineExceeded, GoodputError, Unavailable, from_rpc_error, from_status

__all__ = ["LeaseStream"]

log = logging.getLogger("goodput.gateway.leases")

_Request = scheduler_pb2.LeaseMuxRequest
_CLOSE = object()  # ends the outgoing messages (the stream's write side)
MAX_BATCH = 512  # lease messages in one LeaseBatches message (a few hundred bytes each)
_RETRY_FIRST_S, _RETRY_MAX_S = 0.05, 1.0
FAILOVER_WINDOW_S = 30.0  # how long a failover is waited out (re-admission, re-attachment) before giving up


class _Broken(Exception):
    """The stream an admission waited on broke (not the scheduler's answer to it): it may be admitted again."""

    def __init__(self, err: GoodputError, *, answered: bool) -> None:
        super().__init__(err.message)
        self.err = err
        self.answered = answered


class _Stream:
    """One open ``LeaseBatches`` call: its outgoing queue, its reader, the leases waiting for a grant or a release."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, on_broken: Callable[[_Stream], None],
                 on_preempted: Callable[[str, str], None]) -> None:
        self.out: asyncio.Queue[object] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Future[scheduler_pb2.LeaseMuxEvent]] = {}  # admits awaiting their answer
        self.releasing: dict[str, asyncio.Future[None]] = {}  # releases awaiting the scheduler's `released`
        self.on_queued: dict[str, Callable[[], None]] = {}  # admits whose caller wants to know they wait
        self.call: aio.StreamStreamCall = stub.LeaseBatches(self._requests())
        self.broken: GoodputError | None = None
        self.answered = False  # a scheduler answered on it (so its end is a failover, not an absent scheduler)
        self._on_broken = on_broken
        self._on_preempted = on_preempted
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="lease-stream-reader")

    async def _requests(self) -> AsyncIterator[scheduler_pb2.LeaseMuxBatch]:
        """What queued up while the previous message was being written, as one message (goodput_core.batching)."""
        async with aclosing(batched(self.out, limit=MAX_BATCH, end=_CLOSE,
                                    wrap=lambda batch: scheduler_pb2.LeaseMuxBatch(requests=batch))) as messages:
            async for message in messages:
                yield message

    def send(self, msg: _Request) -> None:
        self.out.put_nowait(msg)

    async def _read(self) -> None:
        try:
            async for message in self.call:
                for event in message.events:
                    self._route(event)
            self._break(Unavailable("the scheduler closed the lease stream", retry_after_s=0.5))
        except grpc.RpcError as err:
            self._break(from_rpc_error(err) if err.code() != grpc.StatusCode.CANCELLED else
                        Unavailable("the lease stream was closed", retry_after_s=0.5))
        except asyncio.CancelledError:
            self._break(Unavailable("the lease stream was closed", retry_after_s=0.5))
            raise
        except Exception as exc:  # a reader that dies silently would leave every admission hanging
            log.exception("lease stream reader failed")
            self._break(Unavailable(f"the lease stream failed: {exc}", retry_after_s=0.5))

    def _route(self, event: scheduler_pb2.LeaseMuxEvent) -> None:
        self.answered = True
        kind = event.WhichOneof("kind")
        if kind == "queued":
            queued = self.on_queued.pop(event.lease_id, None)
            if queued is not None:
                queued()
            return
        if kind == "preempted":
            self._on_preempted(event.lease_id, event.preempted.reason)
            return
        if kind == "released":
            done = self.releasing.pop(event.lease_id, None)
            if done is not None and not done.done():
                done.set_result(None)
            return
        waiter = self.waiting.pop(event.lease_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
        elif kind == "error":  # an attach the new leader could not take (e.g. it does not know the worker)
            log.info("lease not attached", extra={"lease": event.lease_id, "error": event.error.message})

    def _break(self, err: GoodputError) -> None:
        if self.broken is not None:
            return
        self.broken = err
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(_Broken(err, answered=self.answered))
        for released in self.releasing.values():  # the scheduler gave them back as abandoned
            if not released.done():
                released.set_result(None)
        self.waiting.clear()
        self.releasing.clear()
        self.out.put_nowait(_CLOSE)  # ends the request generator, so grpc's task consuming it is not left pending
        self.call.cancel()
        self._on_broken(self)

    def close(self) -> None:
        self.out.put_nowait(_CLOSE)
        self.call.cancel()


@dataclass
class _Held:
    """A granted lease: what the gateway needs to bring it to a new leader."""

    stream: _Stream
    admit: scheduler_pb2.Admit
    worker_id: str
    first_token_seen: bool = False
    preempted: asyncio.Future[str] | None = None  # set (to the reason) when the scheduler takes the lease back


class LeaseStream:
    """This gateway's multiplexed leases (see the module's docstring)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._held: dict[str, _Held] = {}
        self._closed = False
        self._reattacher: asyncio.Task[None] | None = None
        # until when a failover is waited out: a stream that a scheduler had answered on broke (new admissions then
        # wait for the next leader too, instead of failing while none is elected yet)
        self._failover_until = 0.0
        self.failovers = 0  # streams that broke with leases on them (a metric)

    def _open(self) -> _Stream:
        stream = self._stream
        if stream is None or stream.broken is not None or stream.call.done():
            stream = self._stream = _Stream(self._stub, self._broken, self._preempted)
        return stream

    def _preempted(self, lease_id: str, reason: str) -> None:
        """The scheduler took a lease back before its first token (it is released there): whoever holds it is told,
        through :meth:`preempted`, and admits the request again."""
        held = self._held.pop(lease_id, None)
        log.info("lease preempted", extra={"lease": lease_id, "reason": reason})
        if held is not None and held.preempted is not None and not held.preempted.done():
            held.preempted.set_result(reason)

    def preempted(self, lease_id: str) -> asyncio.Future[str] | None:
        """Done (with the scheduler's reason) once the held lease ``lease_id`` is preempted; None when not held."""
        held = self._held.get(lease_id)
        return held.preempted if held is not None else None

    def _broken(self, stream: _Stream) -> None:
        """A stream broke: the leases it held are attached to a new one (in the background, while no replica leads
        yet), before new work needs it."""
        if stream.answered:
            self._failover_until = asyncio.get_running_loop().time() + FAILOVER_WINDOW_S
        if self._closed or not any(held.stream is stream for held in self._held.values()):
            return
        if self._reattacher is None or self._reattacher.done():
            self.failovers += 1
            log.warning("lease stream broke with leases held: attaching them at the leader",
                        extra={"error": stream.broken.message if stream.broken else ""})
            self._reattacher = asyncio.get_running_loop().create_task(self._reattach(), name="lease-reattach")

    async def _reattach(self) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + FAILOVER_WINDOW_S
        backoff = _RETRY_FIRST_S
        while not self._closed:
            orphans = [(lease_id, held) for lease_id, held in self._held.items() if held.stream.broken is not None]
            if not orphans:
                return
            if loop.time() >= give_up:
                log.warning("no scheduler leads: leases left unattached", extra={"leases": len(orphans)})
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _RETRY_MAX_S)
            stream = self._open()
            for lease_id, held in orphans:
                if self._held.get(lease_id) is held:  # not released meanwhile
                    held.stream = stream
                    stream.send(_Request(lease_id=lease_id, attach=scheduler_pb2.Attach(
                        admit=held.admit, worker_id=held.worker_id, first_token_seen=held.first_token_seen)))
            # done once a scheduler answers on it; a stream that breaks first (no leader yet) is tried again
            while not (stream.answered or stream.broken is not None or self._closed):
                await asyncio.sleep(_RETRY_FIRST_S)

    async def acquire(self, lease_id: str, admit: scheduler_pb2.Admit, *, timeout_s: float,
                      on_queued: Callable[[], None] | None = None) -> scheduler_pb2.Granted:
        """Admits the request and waits for its grant (at most ``timeout_s``), admitting it again when the stream
        breaks meanwhile. Raises what the scheduler refused it with (ResourceExhausted, DeadlineExceeded,
        Unavailable, ...); on cancellation the lease is withdrawn. ``on_queued`` is called if the scheduler queues
        it rather than granting it at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.001)
        backoff = _RETRY_FIRST_S
        failover_until: float | None = None  # set once a failover is being waited out
        while True:
            stream = self._open()
            waiter: asyncio.Future[scheduler_pb2.LeaseMuxEvent] = loop.create_future()
            stream.waiting[lease_id] = waiter
            if on_queued is not None:
                stream.on_queued[lease_id] = on_queued
            left = max(deadline - loop.time(), 0.001)
            carrier: dict[str, str] = {}
            propagate.inject(carrier)  # the request's trace continues at the scheduler, stream shared or not
            stream.send(_Request(lease_id=lease_id, admit=admit, timeout_s=left, trace_context=carrier))
            try:
                try:
                    event = await asyncio.wait_for(waiter, timeout=left)
                finally:
                    stream.on_queued.pop(lease_id, None)
                break
            except asyncio.CancelledError:
                self._withdraw(stream, lease_id)
                raise
            except TimeoutError:
                self._withdraw(stream, lease_id)
                raise DeadlineExceeded("the request's deadline passed while it waited for a worker") from None
            except _Broken as broken:  # a failover: admitted again at the new leader while its deadline allows
                if failover_until is None:
                    # no scheduler ever answered on that stream, and none failed over lately: it is absent
                    if not broken.answered and loop.time() >= self._failover_until:
                        raise broken.err from None
                    failover_until = loop.time() + FAILOVER_WINDOW_S
                if min(deadline, failover_until) - loop.time() <= backoff:
                    raise broken.err from None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _RETRY_MAX_S)
                reattacher = self._reattacher
                if reattacher is not None and not reattacher.done():  # the leases held go back first: the new
                    await asyncio.wait({reattacher}, timeout=max(min(deadline, failover_until) - loop.time(), 0))
        if event.HasField("error"):
            e = event.error
            raise from_status(getattr(grpc.StatusCode, e.status, grpc.StatusCode.UNKNOWN), e.message,
                              code=e.code or None, param=e.param or None,
                              retry_after_s=e.retry_after_s if e.retry_after_s > 0 else None)
        self._held[lease_id] = _Held(stream=stream, admit=admit, worker_id=event.granted.worker_id,
                                     preempted=loop.create_future())
        self._failover_until = 0.0  # a leader answers again
        return event.granted

    @staticmethod
    def _withdraw(stream: _Stream, lease_id: str) -> None:
        stream.waiting.pop(lease_id, None)
        if stream.broken is None:  # a broken stream's leases are already given back
            stream.send(_Request(lease_id=lease_id, cancel=scheduler_pb2.Cancel()))

    def first_token(self, lease_id: str, ttft_s: float) -> None:
        held = self._held.get(lease_id)
        if held is None:
            return
        held.first_token_seen = True
        if held.stream.broken is None:
            held.stream.send(_Request(lease_id=lease_id, first_token=scheduler_pb2.FirstToken(ttft_s=ttft_s)))

    def release(self, lease_id: str, release: scheduler_pb2.Release, *,
                timeout_s: float = 5.0) -> Coroutine[Any, Any, None]:
        """Releases the lease: sent at once, so it reaches the scheduler before anything sent after it (a failed
        worker's release before the failover's admission, which must not be granted that worker again); the
        returned coroutine waits (at most ``timeout_s``) for the scheduler to confirm. A lease whose stream broke and
        could not be attached elsewhere was already given back there."""
        held = self._held.pop(lease_id, None)
        if held is None or held.stream.broken is not None:
            return asyncio.sleep(0)
        stream = held.stream
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stream.releasing[lease_id] = done
        stream.send(_Request(lease_id=lease_id, release=release))
        return self._confirmed(stream, lease_id, done, timeout_s)

    @staticmethod
    async def _confirmed(stream: _Stream, lease_id: str, done: asyncio.Future[None], timeout_s: float) -> None:
        try:
            await asyncio.wait_for(done, timeout=timeout_s)
        except TimeoutError:
            stream.releasing.pop(lease_id, None)

    @property
    def held(self) -> int:
        return len(self._held)

    async def close(self) -> None:
        self._closed = True
        if self._reattacher is not None:
            self._reattacher.cancel()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            stream.reader.cancel()
            await asyncio.gather(stream.reader, return_exceptions=True)
