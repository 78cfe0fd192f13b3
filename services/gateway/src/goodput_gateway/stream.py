"""One request on a worker, under a lease (:class:`GenerationStream`): the worker's chunks as the gateway's events
(:mod:`goodput_gateway.events`), the first token reported and the lease released with the request's outcome and
usage, whatever ended it (finished, caller gone, worker lost, error). A worker lost with the request in flight may
have been crashed by it: the pipeline judges that (:mod:`goodput_gateway.quarantine`)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import grpc
from goodput.scheduler.v1 import scheduler_pb2
from grpc import aio
from opentelemetry.trace import Span, Status, StatusCode

from goodput_core.errors import GoodputError, Unavailable, from_rpc_error
from goodput_core.sampling import logprobs_from_proto

from goodput_gateway.events import StreamEnd, TextDelta, finish_reason
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.quarantine import Quarantined
from goodput_gateway.timing import EngineTimes, Timeline
from goodput_gateway.tokengate import TokenGate

__all__ = ["WORKER_CRASHED", "WORKER_LOST", "GenerationStream", "Lease", "StreamStart", "WorkerCall", "WorkerLost"]

log = logging.getLogger("goodput.gateway.pipeline")
WorkerCall: TypeAlias = aio.UnaryStreamCall  # the worker's Generate call
# What a worker that went away (crashed, restarted, the connection cut) ends its call with.
WORKER_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.CANCELLED}
# ... and those of them that, once the worker accepted the request, say it died or failed with it in flight: the
# request may be what crashed it (CANCELLED is a call cancelled on purpose, by a server that stops or by the gateway).
WORKER_CRASHED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class WorkerLost(Exception):
    """The worker failed before it accepted the request: another may take it."""


@dataclass(frozen=True)
class StreamStart:
    request_id: str
    model: str
    worker_id: str
    prompt_tokens: int


@dataclass
class Lease:
    worker_id: str
    address: str
    lease_id: str = ""  # its id on the gateway's lease stream
    free_slots: int = 0  # the lease slots its worker had left once it was granted (the scheduler's word)
    released: bool = False
    first_token_sent: bool = False


class Owner(Protocol):
    """What a stream needs of the pipeline that opened it."""

    metrics: GatewayMetrics
    token_gate: TokenGate
    streams: int
    on_worker: Counter[str]  # open streams by worker address

    def crashed(self, lease: Lease, fingerprint: str, code: grpc.StatusCode) -> Quarantined | None: ...

    def report_first_token(self, lease: Lease, ttft_s: float) -> None: ...

    def release(self, lease: Lease, outcome: int, *, prompt_tokens: int = 0, completion_tokens: int = 0,
                ttft_s: float = 0.0) -> None: ...


class GenerationStream:
    """One request on a worker, under a lease. Iterate :meth:`events` for TextDelta events and a final StreamEnd;
    :meth:`aclose` (always called, also after the last event) stops the worker call and releases the lease."""

    def __init__(self, pipeline: Owner, *, lease: Lease, call: WorkerCall, start: StreamStart,
                 arrived: float, timeline: Timeline | None = None, span: Span | None = None,
                 fingerprint: str = "") -> None:
        self.pipeline = pipeline
        self._span = span  # the worker call's client span, ended with the call
        self._fingerprint = fingerprint  # the request's, for the quarantine ("": not judged)
        pipeline.streams += 1
        pipeline.on_worker[lease.address] += 1  # the pipeline moves it along when the request changes workers
        self._timeline = timeline
        self.start = start
        self._lease = lease
        self._call = call
        self._arrived = arrived
        self._completion_tokens = 0
        self._prompt_tokens = start.prompt_tokens
        self._cached_tokens = 0
        self._ttft_s = 0.0
        self._outcome = scheduler_pb2.OUTCOME_CANCELLED
        self._closed = False

    async def events(self) -> AsyncIterator[TextDelta | StreamEnd]:
        try:
            while True:
                try:
                    chunk = await self._call.read()
                except grpc.RpcError as err:
                    raise self._mid_stream_error(err) from None
                except Quarantined as err:  # judged where the call would have gone on on another worker
                    self.pipeline.metrics.worker_failures.labels("mid_stream").inc()
                    raise self._fail(err) from None
                if chunk is aio.EOF:
                    raise self._fail(Unavailable("the worker ended the stream without finishing"))
                kind = chunk.WhichOneof("kind")
                if self._ttft_s and (turn := self.pipeline.token_gate.wait()) is not None:
                    await turn  # a later token: after this turn's share (the first token never waits)
                if kind == "delta":
                    if self._timeline is not None:
                        self._timeline.first_token()
                    if not self._ttft_s:
                        self._ttft_s = max(time.monotonic() - self._arrived, 1e-6)
                        self.pipeline.report_first_token(self._lease, self._ttft_s)
                    self._completion_tokens = chunk.delta.completion_tokens
                    delta = chunk.delta
                    if not (delta.text or delta.logprobs or delta.prompt_logprobs):
                        continue  # tokens that make no text yet (an incomplete character): nothing for the caller
                    yield TextDelta(delta.text, logprobs_from_proto(delta.logprobs) if delta.logprobs else (),
                                    delta.index,
                                    logprobs_from_proto(delta.prompt_logprobs) if delta.prompt_logprobs else (),
                                    prompt_tokens=self._prompt_tokens, completion_tokens=delta.completion_tokens)
                elif kind == "finished":
                    f = chunk.finished
                    if self._timeline is not None:
                        self._timeline.first_token()  # an empty answer: its end is its first token
                        self._timeline.last_token()
                        self._timeline.completion_tokens = f.usage.completion_tokens
                        if f.HasField("timing"):
                            self._timeline.engine = EngineTimes(queued_s=f.timing.queued_s,
                                                                prefill_s=f.timing.prefill_s,
                                                                decode_s=f.timing.decode_s)
                    self._outcome = scheduler_pb2.OUTCOME_OK
                    self._prompt_tokens = f.usage.prompt_tokens or self._prompt_tokens
                    self._completion_tokens = f.usage.completion_tokens
                    self._cached_tokens = f.usage.cached_tokens
                    yield StreamEnd(finish_reason=finish_reason(f.finish_reason),
                                    prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
                                    cached_tokens=f.usage.cached_tokens,
                                    finish_reasons=tuple(finish_reason(r) for r in f.choice_finish_reasons),
                                    tool_calls=tuple({"id": c.id, "type": "function",
                                                      "function": {"name": c.name, "arguments": c.arguments}}
                                                     for c in f.tool_calls))
                    return
        finally:
            await self.aclose()

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, prefix-cached) tokens so far: the worker's final count, or what it reported
        before the stream ended early."""
        return self._prompt_tokens, self._completion_tokens, self._cached_tokens

    def _fail(self, err: GoodputError) -> GoodputError:
        self._outcome = scheduler_pb2.OUTCOME_WORKER_FAILED
        return err

    def _mid_stream_error(self, err: grpc.RpcError) -> GoodputError:
        code = err.code() if isinstance(err, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._outcome = scheduler_pb2.OUTCOME_ERROR
            return from_rpc_error(err)
        if code in WORKER_LOST:
            self.pipeline.metrics.worker_failures.labels("mid_stream").inc()
            if (crashed := self.pipeline.crashed(self._lease, self._fingerprint, code)) is not None:
                return self._fail(crashed)
            log.warning("worker lost mid-stream", extra={"worker": self._lease.worker_id, "code": code.name})
            return self._fail(Unavailable(f"the inference worker failed mid-stream ({code.name.lower()}); "
                                          "the answer is incomplete, retry the request"))
        self._outcome = scheduler_pb2.OUTCOME_ERROR
        return from_rpc_error(err)

    async def aclose(self) -> None:
        """Stops the worker call (aborting generation) if still running, and releases the lease."""
        if self._closed:
            return
        self._closed = True
        self.pipeline.streams -= 1
        self.pipeline.on_worker[self._lease.address] -= 1
        if self.pipeline.on_worker[self._lease.address] <= 0:
            del self.pipeline.on_worker[self._lease.address]
        if not self._call.done():
            self._call.cancel()
        if self._span is not None:
            if self._outcome not in (scheduler_pb2.OUTCOME_OK, scheduler_pb2.OUTCOME_CANCELLED):
                self._span.set_status(Status(StatusCode.ERROR))
            self._span.end()
        self.pipeline.release(self._lease, self._outcome, prompt_tokens=self.start.prompt_tokens,
                              completion_tokens=self._completion_tokens, ttft_s=self._ttft_s)
