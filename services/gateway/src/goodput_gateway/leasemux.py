"""The gateway's fast path to the scheduler: every request's lease over one long-lived ``Scheduler/Leases`` stream
(``LEASE_MUX``, on by default), instead of a ``Lease`` stream set up and torn down per request.

One stream per gateway process, opened on first use and again after it breaks. Messages go out through one queue
that gRPC drains in order (a stream takes one write at a time); events come back through one reader task that hands
each to its lease by ``lease_id``. A lease is the same conversation as on ``Lease``: admit, then ``granted`` (or a
``LeaseError``, turned back into the same :class:`~goodput_core.errors.GoodputError` a failed ``Lease`` call
gives), first token, release. A caller that goes away while it waits sends ``cancel``. When the stream breaks, the
scheduler gives back everything it held (as abandoned); the gateway fails the admissions still waiting with
UNAVAILABLE (a retry opens a new stream) and forgets the held leases (their releases have nothing left to do).

Example (in a coroutine)::

    leases = LeaseStream(scheduler_stub)
    granted = await leases.acquire("req-1", admit, timeout_s=30)     # or raises ResourceExhausted, ...
    leases.first_token("req-1", ttft_s=0.12)
    await leases.release("req-1", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio

from goodput_core.errors import DeadlineExceeded, GoodputError, Unavailable, from_rpc_error, from_status

__all__ = ["LeaseStream"]

log = logging.getLogger("goodput.gateway.leases")

_Request = scheduler_pb2.LeaseMuxRequest
_CLOSE = object()  # ends the outgoing messages (the stream's write side)


class _Stream:
    """One open ``Leases`` call: its outgoing queue, its reader, the leases waiting for a grant or a release."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.out: asyncio.Queue[object] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Future[scheduler_pb2.LeaseMuxEvent]] = {}  # admits awaiting their answer
        self.releasing: dict[str, asyncio.Future[None]] = {}  # releases awaiting the scheduler's `released`
        self.call: aio.StreamStreamCall = stub.Leases(self._requests())
        self.broken: GoodputError | None = None
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="lease-stream-reader")

    async def _requests(self) -> AsyncIterator[_Request]:
        while (msg := await self.out.get()) is not _CLOSE:
            yield msg  # type: ignore[misc]

    def send(self, msg: _Request) -> None:
        self.out.put_nowait(msg)

    async def _read(self) -> None:
        try:
            async for event in self.call:
                self._route(event)
            self._break(Unavailable("the scheduler closed the lease stream", retry_after_s=1.0))
        except grpc.RpcError as err:
            self._break(from_rpc_error(err) if err.code() != grpc.StatusCode.CANCELLED else
                        Unavailable("the lease stream was closed", retry_after_s=1.0))
        except asyncio.CancelledError:
            self._break(Unavailable("the lease stream was closed", retry_after_s=1.0))
            raise
        except Exception as exc:  # a reader that dies silently would leave every admission hanging
            log.exception("lease stream reader failed")
            self._break(Unavailable(f"the lease stream failed: {exc}", retry_after_s=1.0))

    def _route(self, event: scheduler_pb2.LeaseMuxEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "queued":
            return
        if kind == "released":
            done = self.releasing.pop(event.lease_id, None)
            if done is not None and not done.done():
                done.set_result(None)
            return
        waiter = self.waiting.pop(event.lease_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(event)

    def _break(self, err: GoodputError) -> None:
        if self.broken is None:
            self.broken = err
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(err)
        for released in self.releasing.values():  # the scheduler gave them back as abandoned
            if not released.done():
                released.set_result(None)
        self.waiting.clear()
        self.releasing.clear()

    def close(self) -> None:
        self.out.put_nowait(_CLOSE)
        self.call.cancel()


class LeaseStream:
    """This gateway's multiplexed leases (see the module's docstring)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._held: dict[str, _Stream] = {}  # granted leases, by id, on the stream that holds them

    def _open(self) -> _Stream:
        stream = self._stream
        if stream is None or stream.broken is not None or stream.call.done():
            stream = self._stream = _Stream(self._stub)
        return stream

    async def acquire(self, lease_id: str, admit: scheduler_pb2.Admit, *, timeout_s: float) -> scheduler_pb2.Granted:
        """Admits the request and waits for its grant (at most ``timeout_s``). Raises what the scheduler refused
        it with (ResourceExhausted, DeadlineExceeded, Unavailable, ...); on cancellation the lease is withdrawn."""
        stream = self._open()
        waiter: asyncio.Future[scheduler_pb2.LeaseMuxEvent] = asyncio.get_running_loop().create_future()
        stream.waiting[lease_id] = waiter
        stream.send(_Request(lease_id=lease_id, admit=admit, timeout_s=max(timeout_s, 0.001)))
        try:
            event = await asyncio.wait_for(waiter, timeout=max(timeout_s, 0.001))
        except asyncio.CancelledError:
            self._withdraw(stream, lease_id)
            raise
        except TimeoutError:
            self._withdraw(stream, lease_id)
            raise DeadlineExceeded("the request's deadline passed while it waited for a worker") from None
        if event.HasField("error"):
            e = event.error
            raise from_status(getattr(grpc.StatusCode, e.status, grpc.StatusCode.UNKNOWN), e.message,
                              code=e.code or None, param=e.param or None,
                              retry_after_s=e.retry_after_s if e.retry_after_s > 0 else None)
        self._held[lease_id] = stream
        return event.granted

    @staticmethod
    def _withdraw(stream: _Stream, lease_id: str) -> None:
        stream.waiting.pop(lease_id, None)
        if stream.broken is None:  # a broken stream's leases are already given back
            stream.send(_Request(lease_id=lease_id, cancel=scheduler_pb2.Cancel()))

    def first_token(self, lease_id: str, ttft_s: float) -> None:
        stream = self._held.get(lease_id)
        if stream is not None and stream.broken is None:
            stream.send(_Request(lease_id=lease_id, first_token=scheduler_pb2.FirstToken(ttft_s=ttft_s)))

    async def release(self, lease_id: str, release: scheduler_pb2.Release, *, timeout_s: float = 5.0) -> None:
        """Releases the lease and waits (at most ``timeout_s``) for the scheduler to confirm; a lease whose stream
        broke was already given back there."""
        stream = self._held.pop(lease_id, None)
        if stream is None or stream.broken is not None:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stream.releasing[lease_id] = done
        stream.send(_Request(lease_id=lease_id, release=release))
        try:
            await asyncio.wait_for(done, timeout=timeout_s)
        except TimeoutError:
            stream.releasing.pop(lease_id, None)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            stream.reader.cancel()
            await asyncio.gather(stream.reader, return_exceptions=True)
