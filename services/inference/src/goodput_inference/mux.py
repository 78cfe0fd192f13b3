"""Many generations over one stream (``Inference/GenerateBatches``): the gateway's fast path to a worker.

A ``Generate`` call per request costs a call's setup and teardown on both sides, and a gRPC message (a write, its
completion through grpc's poller thread and the event loop) per token. On one long-lived stream per gateway a
generation is a ``start`` message on a connection already open, and its chunks travel with every other generation's
that queued up behind the previous write, as one message (``goodput_core.batching``): at 128 streams a decode step's
128 tokens leave as a handful of messages instead of 128.

Each message names its generation (``stream_id``). A generation runs exactly as a ``Generate`` call does (the same
servicer code: validation, engine, metrics, logs); its chunks go out in order, ``finished`` last, and what would end a
``Generate`` call with a status is a ``GenerateError`` event for that generation alone. ``cancel`` aborts it in the
engine; so does the stream's end (the gateway went away), for every generation still open. The open generations per
stream are bounded (``MUX_MAX_GENERATIONS``), a start past the bound is refused RESOURCE_EXHAUSTED; a start's deadline
(``timeout_s``) is enforced here as a call's would be.

A slow reader cannot hold up the others: the gateway reads the stream continuously and buffers each generation's
chunks for its own caller (at most ``max_tokens`` of them).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping

from goodput.inference.v1 import inference_pb2
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from goodput_core.errors import DeadlineExceeded, GoodputError, Internal, InvalidArgument, ResourceExhausted

__all__ = ["MAX_BATCH", "GenerateMux", "error_event"]

log = logging.getLogger("goodput.inference.mux")
_tracer = trace.get_tracer("goodput.inference")
_SPAN = "goodput.inference.v1.Inference/Generate"
MAX_BATCH = 512  # events in one GenerateMuxEventBatch message (a token's event is tens of bytes)
MAX_ID_CHARS = 256

Event = inference_pb2.GenerateMuxEvent
Generate = Callable[[inference_pb2.GenerateRequest], AsyncIterator[inference_pb2.GenerateChunk]]


def error_event(stream_id: str, err: GoodputError) -> Event:
    return Event(stream_id=stream_id, error=inference_pb2.GenerateError(
        status=err.grpc_code.name, message=err.message, code=err.code or "", param=err.param or "",
        retry_after_s=err.retry_after_s or 0.0))


class GenerateMux:
    """The generations of one ``GenerateBatches`` stream. :meth:`handle` takes each request message; events go to
    ``emit``; :meth:`close` (always called) aborts whatever is still running.

    ``generate`` runs one request (the servicer's, as for ``Generate``); ``refuse`` says why no new generation may
    start now (the worker is draining), or None."""

    def __init__(self, generate: Generate, emit: Callable[[Event], None], *, max_open: int,
                 refuse: Callable[[], GoodputError | None] = lambda: None) -> None:
        self._generate = generate
        self._emit = emit
        self.max_open = max_open
        self._refuse = refuse
        self._open: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def handle(self, msg: inference_pb2.GenerateMuxRequest) -> None:
        stream_id = msg.stream_id
        if not stream_id or len(stream_id) > MAX_ID_CHARS:
            self._emit(error_event(stream_id[:MAX_ID_CHARS], InvalidArgument(
                f"every message names its generation (stream_id, 1 to {MAX_ID_CHARS} characters)",
                param="stream_id")))
            return
        kind = msg.WhichOneof("kind")
        if kind == "start":
            self._start(stream_id, msg)
        elif kind == "cancel":
            task = self._open.pop(stream_id, None)  # ended already: a late cancel is harmless
            if task is not None:
                task.cancel()

    def _start(self, stream_id: str, msg: inference_pb2.GenerateMuxRequest) -> None:
        if stream_id in self._open:
            self._emit(error_event(stream_id, InvalidArgument(
                f"generation {stream_id!r} is already open on this stream", param="stream_id")))
            return
        refusal = self._refuse()
        if refusal is None and len(self._open) >= self.max_open:
            refusal = ResourceExhausted(f"this stream has {len(self._open)} generations open, its limit "
                                        "(MUX_MAX_GENERATIONS); open another stream", code="too_many_generations",
                                        retry_after_s=1.0)
        if refusal is None and not (math.isfinite(msg.timeout_s) and msg.timeout_s >= 0):
            refusal = InvalidArgument("timeout_s must be a finite number of seconds, 0 or more", param="timeout_s")
        if refusal is not None:
            self._emit(error_event(stream_id, refusal))
            return
        self._open[stream_id] = asyncio.get_running_loop().create_task(
            self._run(stream_id, msg.start, msg.timeout_s, msg.trace_context), name=f"generate-{stream_id}")

    async def _run(self, stream_id: str, request: inference_pb2.GenerateRequest, timeout_s: float,
                   trace_context: Mapping[str, str]) -> None:
        span = _tracer.start_span(_SPAN, kind=SpanKind.SERVER, context=propagate.extract(dict(trace_context)),
                                  attributes={"rpc.system": "grpc", "goodput.stream_id": stream_id})
        ended = False
        try:
            with trace.use_span(span, end_on_exit=False):
                async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                    async for chunk in self._generate(request):
                        ended = chunk.HasField("finished")
                        self._emit(Event(stream_id=stream_id, chunk=chunk))
            if not ended:
                self._emit(Event(stream_id=stream_id, end=inference_pb2.GenerateEnd()))
        except TimeoutError:
            self._fail(span, stream_id, DeadlineExceeded("the request's deadline passed during generation"))
        except GoodputError as err:
            self._fail(span, stream_id, err)
        except asyncio.CancelledError:  # cancelled by its caller, or the stream ended: nobody is listening
            span.set_attribute("goodput.cancelled", True)
        except Exception as exc:  # never leave the caller waiting for a generation that died here
            log.exception("generation failed", extra={"request_id": request.request_id})
            self._fail(span, stream_id, Internal(f"the worker failed to generate: {exc}"))
        finally:
            if self._open.get(stream_id) is asyncio.current_task():
                del self._open[stream_id]
            span.end()

    def _fail(self, span: trace.Span, stream_id: str, err: GoodputError) -> None:
        span.set_status(Status(StatusCode.ERROR, err.grpc_code.name))
        self._emit(error_event(stream_id, err))

    def close(self) -> None:
        """The stream ended: every generation still open is aborted."""
        if self._open:
            log.info("generation stream closed with generations open: aborted", extra={"open": len(self._open)})
        tasks, self._open = list(self._open.values()), {}
        for task in tasks:
            task.cancel()
