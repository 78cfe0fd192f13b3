"""The request pipeline behind both APIs: lease a worker from the scheduler, stream from that worker, release.

Tokens flow worker -> gateway -> caller with no buffering; the scheduler only holds the lease. Every exit path
(finished, caller gone, worker lost, error) releases the lease with its outcome, and a caller that goes away
cancels the worker call, which aborts the request in the engine.

Its parts: the models served (:mod:`.catalogue`), the lease client (:mod:`.leasemux`), speculative start
(:mod:`.speculation`), the worker call (one ``Inference/Generate`` per request) and the stream of one request
(:mod:`.stream`). A worker lost before it accepted a request is tried again on another; one lost with the request in
flight may have been crashed by it (:mod:`.quarantine`): such a request is not tried on another, and refused for a
while when it comes again. It knows nothing of caching, RAG or metering of the answer: the service wraps its token
stream.

Example (with a scheduler and its workers up, inside a coroutine)::

    stream = await pipeline.open(principal, request, cost, request_id="req-1", model="m",
                                 arrived=now, deadline=now + 300)
    async for event in stream.events():       # TextDelta ..., then StreamEnd
        ...
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import grpc
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from goodput_core.breaker import CircuitBreaker
from goodput_core.errors import DeadlineExceeded, GoodputError, ResourceExhausted, Unavailable, from_rpc_error
from goodput_core.sampling import sampling_to_proto

from goodput_gateway.auth import Principal
from goodput_gateway.catalogue import Catalogue
from goodput_gateway.config import GatewaySettings
from goodput_gateway.leasemux import LeaseStream
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.quarantine import Quarantine, Quarantined
from goodput_gateway.requests import Cost, GenerationRequest
from goodput_gateway.speculation import HEAD_START_S, Early, Speculation
from goodput_gateway.stream import (
    WORKER_CRASHED,
    WORKER_LOST,
    GenerationStream,
    Lease,
    StreamStart,
    WorkerCall,
    WorkerLost,
)
from goodput_gateway.timing import Timeline
from goodput_gateway.tokengate import TokenGate
from goodput_gateway.tools import worker_tools

__all__ = ["Pipeline"]

log = logging.getLogger("goodput.gateway.pipeline")
_tracer = trace.get_tracer("goodput.gateway")
_GENERATE = "goodput.inference.v1.Inference/Generate"
# a preempted request refused a place in the queue tries again after the scheduler's retry-after, at most this late:
# it has already sent its response's headers, so it waits for its turn (until its deadline) rather than fail
_READMIT_WAIT_S = 0.5
# a stream whose worker is lost goes on on another at most this many times (and a restart tries at most this many
# workers that fail before taking it): the scheduler checks a worker reported failed at once, so a second loss in a
# row is a fleet in trouble, which the caller should hear of
_FAILOVERS = 2

class Pipeline:
    def __init__(self, settings: GatewaySettings, *, scheduler: scheduler_pb2_grpc.SchedulerStub,
                 channel_factory: Callable[[str], aio.Channel], metrics: GatewayMetrics,
                 breaker: CircuitBreaker | None = None) -> None:
        self.settings = settings
        self.scheduler = scheduler
        # open: leases and model lists are refused at once (503 + retry-after) instead of each timing out
        self.breaker = breaker or CircuitBreaker("scheduler")
        self._channel_factory = channel_factory
        self._channels: dict[str, aio.Channel] = {}
        self.metrics = metrics
        self.catalogue = Catalogue(settings, scheduler=scheduler, breaker=self.breaker)
        self.speculation = Speculation(settings, metrics)
        self.quarantine = Quarantine(settings.quarantine, metrics)  # requests suspected of crashing a worker
        self.lease_stream = LeaseStream(scheduler)
        self._opening = 0  # requests between open() and their stream
        self.streams = 0  # generation streams open
        self.on_worker: Counter[str] = Counter()  # ... by worker address
        # later tokens a few per event-loop turn, so first tokens and new requests go first (tokengate.PER_TURN)
        self.token_gate = TokenGate(on_park=metrics.token_gate_parked.inc)
        self._lease_seq = itertools.count()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def inflight(self) -> int:
        """Requests between open() and the end of their stream."""
        return self._opening + self.streams

    def channel(self, address: str) -> aio.Channel:
        """The channel to the worker at ``address``, opened on first use and kept."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._channel_factory(address)
        return channel

    def _call_worker(self, address: str, gen: inference_pb2.GenerateRequest, *, deadline: float,
                     span: Span) -> WorkerCall:
        """Starts ``gen`` at the worker, a Generate call of its own: one call per request measured no slower than
        multiplexed streams at 1-128 streams (loadtests/reports/worker-mux-ab.md, "all-calls")."""
        timeout = max(deadline - time.monotonic(), 0.001)
        return inference_pb2_grpc.InferenceStub(self.channel(address)).Generate(
            gen, timeout=timeout, metadata=_trace_metadata(span))

    async def settle(self) -> None:
        """Waits (up to 5 s) for the releases sent off the response path."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)

    async def close(self) -> None:
        await self.settle()
        await self.lease_stream.close()
        for channel in self._channels.values():
            await channel.close(grace=None)

    # ---- generation ------------------------------------------------------------------------------------------

    async def open(self, principal: Principal, request: GenerationRequest, cost: Cost, *, request_id: str,
                   model: str, arrived: float, deadline: float, max_queue_wait_s: float = 0.0,
                   timeline: Timeline | None = None, speculate: bool = True) -> GenerationStream:
        """Leases a worker for ``request`` (its priority resolved, its cost estimated) and starts generation;
        returns once the worker accepted the request, so errors surface before any response bytes are sent. A
        worker that fails before accepting is retried once on another.

        With ``speculative_start`` the worker call starts while the lease is being granted, on the worker the
        scheduler granted last for the same model, class and session where it had slots to spare
        (``speculate=False`` for a request the scheduler may well refuse): the scheduler still decides, and a grant
        elsewhere, a refusal or a place in its queue cancels the early call before anything is sent to the
        caller. A request under quarantine (:mod:`.quarantine`) is refused before any of it."""
        self._opening += 1
        try:
            fingerprint = request.fingerprint(principal.tenant, model) if self.quarantine.enabled else ""
            self.quarantine.check(fingerprint)
            for attempt in range(2):
                early = self._speculate(principal, request, request_id=request_id, model=model, deadline=deadline) \
                    if attempt == 0 and speculate else None
                try:
                    if early is not None:
                        # the worker call first: the lease only has to come before the first token, and sent at the
                        # same moment the two wake the scheduler and the worker together, which then share the cores
                        await asyncio.wait({early.task}, timeout=HEAD_START_S)
                    lease = await self._lease(principal, request, cost, request_id=request_id, model=model,
                                              deadline=deadline, max_queue_wait_s=max_queue_wait_s,
                                              on_queued=early.on_queued if early is not None else None)
                except BaseException as err:
                    if early is not None:
                        if isinstance(err, GoodputError):  # the scheduler refused it (not the caller going away)
                            self.speculation.judge(model, request.priority, hit=False)
                        await self.speculation.drop(early, "refused")
                    raise
                self.speculation.granted(model, request.priority, request.affinity(principal.tenant),
                                         worker_id=lease.worker_id, address=lease.address, free_slots=lease.free_slots)
                if timeline is not None:
                    timeline.mark("queue_wait")
                try:
                    if time.monotonic() >= deadline:  # granted too late: the worker is never called
                        raise DeadlineExceeded("the request's deadline passed while it waited for a worker")
                    started = None
                    if early is not None:
                        guessed, early = early, None
                        if guessed.queued:  # cancelled when its lease was queued
                            self.speculation.judge(model, request.priority, hit=False)
                            await self.speculation.drop(guessed, "queued")
                        else:
                            hit = guessed.address == lease.address
                            self.speculation.judge(model, request.priority, hit=hit)
                            if hit:
                                self.metrics.speculative_starts.labels("hit").inc()
                                started = await guessed.task  # its failure is this worker's, as below
                            else:
                                await self.speculation.drop(guessed, "miss")
                    call, start, span = started or await self.start_worker(
                        principal, request, lease, request_id=request_id, model=model, deadline=deadline)
                    if (preempted := self.lease_stream.preempted(lease.lease_id)) is not None:
                        call = cast(WorkerCall, _Preemptible(call, preempted, partial(
                            self._restart, principal, request, cost, lease, request_id=request_id, model=model,
                            deadline=deadline, max_queue_wait_s=max_queue_wait_s), resumable=request.resumable,
                            report_first_token=partial(self.report_first_token, lease),
                            crashed=partial(self.crashed, lease, fingerprint)))
                    return GenerationStream(self, lease=lease, call=call, start=start, arrived=arrived,
                                            timeline=timeline, span=span, fingerprint=fingerprint)
                except WorkerLost as lost:
                    self.metrics.worker_failures.labels("before_first_token").inc()
                    self.release(lease, scheduler_pb2.OUTCOME_WORKER_FAILED)
                    if attempt == 1:
                        raise Unavailable(f"the inference worker failed: {lost}") from None
                    log.warning("worker failed before the first token; retrying on another",
                                extra={"worker": lease.worker_id})
                except BaseException:
                    if early is not None:
                        await self.speculation.drop(early, "refused")
                    self.release(lease, scheduler_pb2.OUTCOME_ERROR)
                    raise
            raise Unavailable("no worker could take the request")
        finally:
            self._opening -= 1

    def _speculate(self, principal: Principal, req: GenerationRequest, *, request_id: str, model: str,
                   deadline: float) -> Early | None:
        """The worker call started early where :meth:`Speculation.guess` says (None: no guess)."""
        hint = self.speculation.guess(model, req.priority, req.affinity(principal.tenant),
                                      inflight=self.inflight)
        if hint is None:
            return None
        worker_id, address = hint
        task = asyncio.get_running_loop().create_task(
            self.start_worker(principal, req, Lease(worker_id=worker_id, address=address), request_id=request_id,
                               model=model, deadline=deadline), name=f"early-start-{request_id}")
        return Early(address=address, task=task)

    async def _lease(self, principal: Principal, req: GenerationRequest, cost: Cost, *, request_id: str,
                     model: str, deadline: float, max_queue_wait_s: float = 0.0,
                     on_queued: Callable[[], None] | None = None, continuation: tuple[int, ...] = ()) -> Lease:
        started = time.monotonic()
        admit = scheduler_pb2.Admit(request_id=request_id, tenant=principal.tenant, priority=cast(Any, req.priority),
                                    model=model, prompt_tokens_estimate=cost.prompt_tokens,
                                    max_tokens=cost.max_tokens, n=cost.n, prefix_hint=req.prefix_hint(),
                                    session_id=req.affinity(principal.tenant), fixed_output=cost.fixed_output,
                                    tenant_weight=principal.weight, resumable=req.resumable,
                                    resumed=bool(continuation),
                                    max_queue_wait_s=0.0 if continuation else max_queue_wait_s)
        # unique on the stream even when a caller reuses its request id (or the worker retry leases again)
        lease_id = f"{request_id}/{next(self._lease_seq)}"
        async with self.breaker.guard():
            granted = await self.lease_stream.acquire(lease_id, admit, timeout_s=deadline - time.monotonic(),
                                                      on_queued=on_queued)
        self.metrics.stage.labels("schedule").observe(time.monotonic() - started)
        self.catalogue.queue_waits.observe(model, req.priority, granted.queue_wait_s)
        return Lease(worker_id=granted.worker_id, address=granted.address, lease_id=lease_id,
                      free_slots=granted.free_slots)

    async def _restart(self, principal: Principal, req: GenerationRequest, cost: Cost, lease: Lease,
                       continuation: tuple[int, ...], worker_lost: bool, *, request_id: str, model: str,
                       deadline: float, max_queue_wait_s: float) -> tuple[WorkerCall, asyncio.Future[str] | None]:
        """A request whose lease was preempted, or whose worker was lost (the lease then released as failed):
        leased again (back in the queue) and started on its new worker, or its answer continued there after the
        ``continuation`` tokens already sent; ``lease`` becomes the new lease, so the stream reports and releases
        that one. A worker lost before it takes the request is tried again, up to :data:`_FAILOVERS` times."""
        if worker_lost:
            self.metrics.worker_failures.labels("mid_stream").inc()
            log.warning("worker lost mid-stream; the answer goes on on another", extra={
                "worker": lease.worker_id, "tokens": len(continuation)})
            self.release(lease, scheduler_pb2.OUTCOME_WORKER_FAILED)
        else:
            self.metrics.preempted.labels("mid_stream" if continuation else "before_first_token").inc()
        for attempt in range(1, _FAILOVERS + 1):
            while True:
                try:
                    new = await self._lease(principal, req, cost, request_id=request_id, model=model,
                                            deadline=deadline, max_queue_wait_s=max_queue_wait_s,
                                            continuation=continuation)
                    break
                except ResourceExhausted as full:  # its tenant's places in the queue are taken: tries again in turn
                    wait = min(full.retry_after_s or _READMIT_WAIT_S, _READMIT_WAIT_S)
                    if time.monotonic() + wait >= deadline:
                        raise
                    await asyncio.sleep(wait)
            self._moved(lease.address, new.address)
            lease.worker_id, lease.address, lease.lease_id, lease.free_slots = (
                new.worker_id, new.address, new.lease_id, new.free_slots)
            lease.first_token_sent = lease.released = False  # the new lease's first token, and its end, to come
            try:
                call, _, span = await self.start_worker(principal, req, lease, request_id=request_id, model=model,
                                                        deadline=deadline, continuation=continuation)
            except WorkerLost as lost:
                self.release(lease, scheduler_pb2.OUTCOME_WORKER_FAILED)
                if attempt < _FAILOVERS:
                    continue
                raise Unavailable(f"the inference worker failed: {lost}") from None
            except BaseException:
                self.release(lease, scheduler_pb2.OUTCOME_ERROR)
                raise
            span.end()  # the stream ends the first call's span; this one's call runs on under it
            return call, self.lease_stream.preempted(lease.lease_id)
        raise AssertionError("the loop returns or raises")  # for the type checker

    async def start_worker(self, principal: Principal, req: GenerationRequest, lease: Lease, *, request_id: str,
                            model: str, deadline: float,
                            continuation: tuple[int, ...] = ()) -> tuple[WorkerCall, StreamStart, Span]:
        tools, parallel = worker_tools(req)  # tool_choice auto: the worker's template and tool parser take them
        gen = inference_pb2.GenerateRequest(
            request_id=request_id, model=model, prompt=req.prompt, sampling=sampling_to_proto(req.sampling),
            priority=cast(Any, req.priority), tenant=principal.tenant, tools=tools, parallel_tool_calls=parallel,
            continue_token_ids=continuation,
            messages=[types_pb2.ChatMessage(role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
                                            tool_calls=_calls_proto(m.tool_calls)) for m in req.messages])
        # The worker call's client span, made here rather than by a channel interceptor: an intercepted grpc.aio
        # call starts its interceptors in a task of their own and passes every token through two more async
        # generators, which the token path should not pay. The worker continues the trace from the metadata.
        span = _tracer.start_span(_GENERATE, kind=SpanKind.CLIENT, attributes={
            "rpc.system": "grpc", "rpc.service": "goodput.inference.v1.Inference", "rpc.method": "Generate",
            "server.address": lease.address, "goodput.worker": lease.worker_id})
        call = self._call_worker(lease.address, gen, deadline=deadline, span=span)
        try:
            first = await call.read()
        except grpc.RpcError as err:
            call.cancel()
            _end_failed(span, err)
            code = err.code() if isinstance(err, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
            if code in WORKER_LOST:
                raise WorkerLost(err.details() if isinstance(err, aio.AioRpcError) else str(err)) from None
            raise from_rpc_error(err) from None
        except BaseException:
            call.cancel()
            _end_failed(span)
            raise
        if first is aio.EOF or first.WhichOneof("kind") != "started":
            call.cancel()
            _end_failed(span)
            raise WorkerLost("the worker did not acknowledge the request")
        return call, StreamStart(request_id=request_id, model=model, worker_id=lease.worker_id,
                                 prompt_tokens=first.started.prompt_tokens), span

    def crashed(self, lease: Lease, fingerprint: str, code: grpc.StatusCode) -> Quarantined | None:
        """The worker of ``lease`` was lost after it accepted the request (its call ended with ``code``): the error
        to end the request with when the request is suspected of the crash (:mod:`.quarantine`: counted and
        quarantined, not tried on another worker), None when another worker may go on with it."""
        if code not in WORKER_CRASHED:
            return None
        return self.quarantine.lost(fingerprint, worker=lease.worker_id, address=lease.address,
                                    here=self.on_worker[lease.address], listed=self.catalogue.inflight(lease.address))

    def _moved(self, old: str, new: str) -> None:
        """A stream's request went on from the worker at ``old`` to the one at ``new``."""
        self.on_worker[old] -= 1
        if self.on_worker[old] <= 0:
            del self.on_worker[old]
        self.on_worker[new] += 1

    def report_first_token(self, lease: Lease, ttft_s: float) -> None:
        """Tells the scheduler the prompt's prefill is done (off the caller's path): its prefill gate and latency
        guard act on it before the request ends."""
        if lease.released or lease.first_token_sent:
            return
        lease.first_token_sent = True
        self.lease_stream.first_token(lease.lease_id, ttft_s)

    def release(self, lease: Lease, outcome: int, *, prompt_tokens: int = 0, completion_tokens: int = 0,
                ttft_s: float = 0.0) -> None:
        """Tells the scheduler the request ended, off the caller's path (it does not delay the response)."""
        if lease.released:
            return
        lease.released = True
        release = scheduler_pb2.Release(outcome=cast(Any, outcome), prompt_tokens=prompt_tokens,
                                        completion_tokens=completion_tokens, ttft_s=ttft_s)
        task = asyncio.get_running_loop().create_task(self.lease_stream.release(lease.lease_id, release))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Preemptible:
    """The worker call of a lease the scheduler may preempt (``goodput_scheduler.fairshare``) and whose worker may be
    lost. Preempted, the call is cancelled (the worker aborts the request); lost (the call ends UNAVAILABLE and the
    like), its lease is released as failed. Either way ``restart`` leases the request again, so it waits in the queue
    again and is never lost: before its first chunk it starts again (nothing reached the caller); after it, a
    ``resumable`` request's answer continues on the new worker from the tokens already read (``Delta.token_ids``),
    the caller's stream only pausing, while any other request reads on where it is when preempted (the scheduler
    preempts such a lease only before its first token, as far as it knows) and fails when its worker is lost. A
    request suspected of crashing its worker (``crashed`` says so: :mod:`.quarantine`) goes on nowhere. A
    preemption cancels the call as it comes, so each read costs no more than the call's own."""

    def __init__(self, call: WorkerCall, preempted: asyncio.Future[str],
                 restart: Callable[[tuple[int, ...], bool], Awaitable[tuple[WorkerCall, asyncio.Future[str] | None]]],
                 *, resumable: bool, report_first_token: Callable[[float], None],
                 crashed: Callable[[grpc.StatusCode], Quarantined | None]) -> None:
        self._call, self._restart, self._resumable = call, restart, resumable
        self._crashed = crashed
        self._report_first_token = report_first_token  # the new lease's, after a restart
        self._restarted_at: float | None = None
        self._sent: list[int] = []  # the answer's tokens read so far
        self._read_any = False
        self._cut = False  # this call was cancelled for a preemption
        self._failovers = 0
        self._watch(preempted)

    def _watch(self, preempted: asyncio.Future[str] | None) -> None:
        if preempted is not None:
            preempted.add_done_callback(self._preempted)

    def _preempted(self, preempted: asyncio.Future[str]) -> None:
        if not preempted.cancelled() and (self._resumable or not self._read_any) and not self._call.done():
            self._cut = True
            self._call.cancel()

    def done(self) -> bool:
        return self._call.done() and not self._cut

    def cancel(self) -> bool:
        return self._call.cancel()

    def _fails_over(self, err: BaseException) -> bool:
        """Whether the call's failure is its worker's (the gateway cancels a call only when it stops reading, or for a
        preemption), and the request can go on on another; raises :class:`Quarantined` when the request is suspected of
        the crash instead. A failure it does not fail over is judged by the stream (:class:`GenerationStream`)."""
        if not (isinstance(err, aio.AioRpcError) and err.code() in WORKER_LOST and self._failovers < _FAILOVERS
                and (self._resumable or not self._read_any)):
            return False
        if (crashed := self._crashed(err.code())) is not None:
            raise crashed
        self._failovers += 1
        return True

    async def read(self) -> Any:
        while True:
            lost = False
            try:
                chunk = await self._call.read()
            except (asyncio.CancelledError, grpc.RpcError) as err:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                if not self._cut and not (lost := self._fails_over(err)):
                    raise
            else:
                if not self._cut:
                    self._read_any = True
                    if chunk is not aio.EOF and chunk.WhichOneof("kind") == "delta":
                        self._sent.extend(chunk.delta.token_ids)
                        if chunk.delta.text and not chunk.delta.token_ids:  # a worker that does not say its tokens
                            self._resumable = False
                    if self._restarted_at is not None:
                        self._report_first_token(time.monotonic() - self._restarted_at)
                        self._restarted_at = None
                    return chunk
            self._cut = False
            self._call, preempted = await self._restart(tuple(self._sent) if self._read_any else (), lost)
            self._restarted_at = time.monotonic()
            self._watch(preempted)


def _trace_metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """The trace context of ``span`` as a call's metadata, for a channel without the tracing interceptor."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def _end_failed(span: Span, err: grpc.RpcError | None = None) -> None:
    code = err.code() if isinstance(err, aio.AioRpcError) else None
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, code.name if code is not None else None))
    span.end()


def _calls_proto(calls: str) -> list[types_pb2.ToolCall]:
    """An assistant message's earlier calls (OpenAI's tool_calls JSON) for the worker's tool template."""
    return [types_pb2.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in json.loads(calls)] if calls else []
