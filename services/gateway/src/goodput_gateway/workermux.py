"""The gateway's fast path to its workers: a request's generation as a message on a long-lived
``Inference/GenerateBatches`` stream to its worker (``WORKER_MUX``, on by default), instead of a ``Generate`` call set
up and torn down per request.

Streams to a worker open on use, up to ``WORKER_MUX_STREAMS``: a request goes to the least busy, and a new stream
opens only while every open one carries generations (an idle gateway keeps one, so a request after a pause pays no
call setup: that setup is most of what an idle gateway adds to TTFT). Starts and cancels go out through each stream's
queue, and the worker's events come back, batched the same way (``goodput_core.batching``: what queued up while the
previous write was in flight goes out as one message). That saves the gateway CPU under load, but a token on a stream
takes one more event-loop turn on each side than on a call (the reader task hands it to the request's task; at the
worker, the generation to the stream's writer), and a turn of a busy loop waits for everything queued before it; so
past ``WORKER_MUX_MAX_OPEN`` generations on a worker's streams the pipeline gives new requests a ``Generate`` call of
their own (measured: ``loadtests/reports/worker-mux-ab.md``). One reader task per stream hands each event to its
generation by ``stream_id``; each generation buffers its own chunks, so a slow caller holds up nobody else (a
generation's buffer is at most its ``max_tokens`` chunks).

A generation is used like the ``Generate`` call it replaces (:class:`MuxCall`: ``read()`` gives chunks, then
``grpc.aio.EOF``; a failure raises the :class:`grpc.aio.AioRpcError` the call would have ended with, its code,
message and trailing metadata; ``cancel()`` aborts it in the engine), so the pipeline's error handling is the same for
both. When the stream breaks (the worker died or restarted), every generation on it fails UNAVAILABLE, as each call
would have: a request not yet streaming is retried on another worker, one mid-stream ends with its error; the next
request opens a new stream.

Example (in a coroutine)::

    streams = WorkerStreams(channel_for=lambda address: channels[address])
    call = streams.generate("10.0.0.7:50061", request, timeout_s=30)  # None: make a Generate call
    while (chunk := await call.read()) is not grpc.aio.EOF:
        ...
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

import grpc
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio

from goodput_core.batching import batched
from goodput_core.errors import ERROR_CODE_KEY, ERROR_PARAM_KEY, RETRY_AFTER_KEY

__all__ = ["MuxCall", "WorkerStreams"]

log = logging.getLogger("goodput.gateway.workers")

_Request = inference_pb2.GenerateMuxRequest
_CLOSE = object()  # ends the outgoing messages (the stream's write side)
_NO_CONTEXT: Mapping[str, str] = {}
MAX_BATCH = 512  # messages in one GenerateMuxBatch


def _rpc_error(status: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> aio.AioRpcError:
    return aio.AioRpcError(status, aio.Metadata(), aio.Metadata(*trailing), details=details)


class MuxCall:
    """One generation on a worker's shared stream, read like a ``Generate`` call."""

    __slots__ = ("stream_id", "_stream", "_items", "_waiter", "_done", "_timer")

    def __init__(self, stream: _Stream, stream_id: str) -> None:
        self.stream_id = stream_id
        self._stream = stream
        self._items: deque[inference_pb2.GenerateChunk | object | aio.AioRpcError] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # its last event came (or it was cancelled, or its stream broke)
        self._timer: asyncio.TimerHandle | None = None

    async def read(self) -> Any:
        """The next chunk (a ``GenerateChunk``), ``aio.EOF`` after the last (typed as grpc's ``call.read()``);
        raises the generation's error."""
        while not self._items:
            if self._done:
                return aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, aio.AioRpcError):
            self._items.appendleft(item)  # a failed call keeps failing
            raise item
        return item

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Aborts the generation at the worker (nothing more comes for it); False if it had ended already."""
        if self._done:
            return False
        self._finish(_rpc_error(grpc.StatusCode.CANCELLED, "the generation was cancelled"))
        self._stream.cancel(self.stream_id)
        return True

    def _put(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _event(self, event: inference_pb2.GenerateMuxEvent) -> None:
        if self._done:
            return
        kind = event.WhichOneof("kind")
        if kind == "chunk":
            self._put(event.chunk)
            if event.chunk.HasField("finished"):
                self._finish(None)
        elif kind == "error":
            e = event.error
            trailing = [(RETRY_AFTER_KEY, f"{e.retry_after_s:.3f}")] if e.retry_after_s > 0 else []
            if e.code:
                trailing.append((ERROR_CODE_KEY, e.code))
            if e.param:
                trailing.append((ERROR_PARAM_KEY, e.param))
            self._finish(_rpc_error(getattr(grpc.StatusCode, e.status, grpc.StatusCode.UNKNOWN), e.message,
                                    tuple(trailing)))
        else:  # end: the worker's stream for it ended without `finished`
            self._finish(None)

    def _finish(self, error: aio.AioRpcError | None) -> None:
        self._done = True
        self._stream.calls.pop(self.stream_id, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if error is not None:
            self._put(error)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expire(self) -> None:
        """Its deadline passed (the worker enforces it too; this is for a worker that stopped answering)."""
        self._timer = None
        if not self._done:
            self._finish(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._stream.cancel(self.stream_id)


class _Stream:
    """One open ``GenerateBatches`` call to a worker: its outgoing queue, its reader, its open generations."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, address: str) -> None:
        self.address = address
        self.out: asyncio.Queue[object] = asyncio.Queue()
        self.calls: dict[str, MuxCall] = {}
        self.call: aio.StreamStreamCall = stub.GenerateBatches(self._requests())
        self.broken = False
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"worker-stream-{address}")

    async def _requests(self) -> AsyncIterator[inference_pb2.GenerateMuxBatch]:
        async with aclosing(batched(self.out, limit=MAX_BATCH, end=_CLOSE,
                                    wrap=lambda batch: inference_pb2.GenerateMuxBatch(requests=batch))) as messages:
            async for message in messages:
                yield message

    def start(self, stream_id: str, request: inference_pb2.GenerateRequest, *, timeout_s: float,
              trace_context: Mapping[str, str]) -> MuxCall:
        call = self.calls[stream_id] = MuxCall(self, stream_id)
        if timeout_s > 0:
            call._timer = asyncio.get_running_loop().call_later(timeout_s, call._expire)
        self.out.put_nowait(_Request(stream_id=stream_id, start=request, timeout_s=timeout_s,
                                     trace_context=trace_context))
        return call

    def cancel(self, stream_id: str) -> None:
        if not self.broken:
            self.out.put_nowait(_Request(stream_id=stream_id, cancel=inference_pb2.GenerateCancel()))

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker closed its generation stream")
        try:
            async for message in self.call:
                for event in message.events:
                    call = self.calls.get(event.stream_id)
                    if call is not None:
                        call._event(event)
        except aio.AioRpcError as err:
            error = err if err.code() != grpc.StatusCode.CANCELLED else \
                _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker's generation stream was closed")
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker's generation stream was closed")
            raise
        except Exception as exc:  # a reader that dies silently would leave every generation hanging
            log.exception("worker stream reader failed", extra={"worker": self.address})
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"the worker's generation stream failed: {exc}")
        finally:
            self._break(error)

    def _break(self, error: aio.AioRpcError) -> None:
        """Every generation still open fails as its own call would have when the connection broke."""
        if self.broken:
            return
        self.broken = True
        calls, self.calls = list(self.calls.values()), {}
        if calls:
            log.warning("worker stream broke with generations open", extra={"worker": self.address,
                                                                           "open": len(calls),
                                                                           "code": error.code().name})
        for call in calls:
            call._finish(error)
        self.out.put_nowait(_CLOSE)  # ends the request generator, so grpc's task consuming it is not left pending
        self.call.cancel()

    def close(self) -> None:
        self.out.put_nowait(_CLOSE)
        self.call.cancel()


class WorkerStreams:
    """This gateway's multiplexed generation streams, up to ``per_worker`` per worker address (see the module's
    docstring)."""

    def __init__(self, channel_for: Callable[[str], aio.Channel], *, per_worker: int = 8,
                 max_open: int = 8) -> None:
        self._channel_for = channel_for
        self.per_worker = per_worker
        self.max_open = max_open  # generations on a worker's streams at once (WORKER_MUX_MAX_OPEN)
        self._streams: dict[str, list[_Stream]] = {}
        self._ids = itertools.count()

    def generate(self, address: str, request: inference_pb2.GenerateRequest, *, timeout_s: float,
                 trace_context: Mapping[str, str] = _NO_CONTEXT) -> MuxCall | None:
        """Starts ``request`` on the least busy open stream to the worker at ``address`` (a new one while every
        open one carries generations and there are fewer than ``per_worker``: a stream writes one message at a
        time); read the returned call like a ``Generate`` call. None, and nothing started, when ``max_open``
        generations already run on that worker's streams: the caller makes a ``Generate`` call instead."""
        streams = self._streams.setdefault(address, [])
        streams[:] = [s for s in streams if not (s.broken or s.call.done())]  # those that ended dropped
        if sum(len(s.calls) for s in streams) >= self.max_open:
            return None
        best = min(streams, key=lambda s: len(s.calls), default=None)
        if best is None or (best.calls and len(streams) < self.per_worker):
            best = _Stream(inference_pb2_grpc.InferenceStub(self._channel_for(address)), address)
            streams.append(best)
        return best.start(f"{next(self._ids)}/{request.request_id}"[:256], request, timeout_s=timeout_s,
                          trace_context=trace_context)

    def open_to(self, address: str) -> int:
        """Generations open on the streams to ``address``."""
        return sum(len(s.calls) for s in self._streams.get(address, ()))

    @property
    def open(self) -> int:
        """Generations open across every stream."""
        return sum(len(s.calls) for streams in self._streams.values() for s in streams)

    async def close(self) -> None:
        streams = [s for per in self._streams.values() for s in per]
        self._streams = {}
        for stream in streams:
            stream.close()
            stream.reader.cancel()
        await asyncio.gather(*(s.reader for s in streams), return_exceptions=True)
