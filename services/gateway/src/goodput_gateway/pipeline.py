"""The request pipeline behind both APIs: lease a worker from the scheduler, stream from that worker, release.

Tokens flow worker -> gateway -> caller with no buffering; the scheduler only holds the lease. Every exit path
(finished, caller gone, worker lost, error) releases the lease with its outcome, and a caller that goes away
cancels the worker call, which aborts the request in the engine.

The pipeline knows nothing of caching, RAG or metering of the answer: the service wraps its token stream for those.

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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import grpc
from cachetools import TTLCache
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from goodput_core.breaker import CircuitBreaker
from goodput_core.errors import DeadlineExceeded, GoodputError, InvalidArgument, Unavailable, from_rpc_error
from goodput_core.sampling import logprobs_from_proto, sampling_to_proto

from goodput_gateway.auth import Principal
from goodput_gateway.autoroute import AutoChoice, QueueWaits, choose, pools_from
from goodput_gateway.config import GatewaySettings
from goodput_gateway.leasemux import LeaseStream
from goodput_gateway.metrics import GatewayMetrics, StreamEnd, TextDelta
from goodput_gateway.requests import Cost, GenerationRequest
from goodput_gateway.timing import EngineTimes, Timeline
from goodput_gateway.tokengate import TokenGate
from goodput_gateway.tools import worker_tools
from goodput_gateway.workermux import MuxCall, WorkerStreams

__all__ = ["GenerationStream", "ModelEntry", "Pipeline", "StreamEnd", "StreamStart", "TextDelta"]

log = logging.getLogger("goodput.gateway.pipeline")
_tracer = trace.get_tracer("goodput.gateway")
_GENERATE = "goodput.inference.v1.Inference/Generate"

_WORKER_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.CANCELLED}
_FINISH = {types_pb2.FINISH_REASON_STOP: "stop", types_pb2.FINISH_REASON_LENGTH: "length",
           types_pb2.FINISH_REASON_ABORT: "abort"}


# Speculative start: a grant older than this is no guess for the next one (the fleet may have changed); at most this
# many guesses kept (one per model and class, and per session with SESSION affinity); a (model, class) is guessed
# for while its recent hit rate (an exponential average, weight _HIT_WEIGHT) is at least _HIT_FLOOR, and below it
# one eligible request in _PROBE_EVERY still is (so a guess that turned good again is found again).
_HINT_TTL_S = 30.0
_HINTS_MAX = 10_000
_HIT_WEIGHT = 0.2
_HIT_FLOOR = 0.7
_PROBE_EVERY = 10
# An early worker call is given this long (at most) to be accepted by its worker before the lease is asked for.
_HEAD_START_S = 0.005

# A worker call: a Generate call, or a generation on the worker's shared stream (read alike).
WorkerCall: TypeAlias = aio.UnaryStreamCall | MuxCall


@dataclass
class _Early:
    """A worker call started before its grant (speculative_start), on ``address``."""

    address: str
    task: asyncio.Task[tuple[WorkerCall, StreamStart, Span]]
    queued: bool = False  # the scheduler queued the lease: the early call was cancelled then (never run unadmitted)

    def on_queued(self) -> None:
        self.queued = True
        self.task.cancel()


@dataclass(frozen=True)
class ModelEntry:
    id: str
    max_model_len: int
    model_version: str
    workers: int
    tool_call_parser: str = ""  # what gives the model tool_choice "auto" (on every worker); empty = none
    aliases: tuple[str, ...] = ()  # other names the model's workers answer to (SERVED_MODEL_ALIASES)


@dataclass(frozen=True)
class StreamStart:
    request_id: str
    model: str
    worker_id: str
    prompt_tokens: int


@dataclass
class _Lease:
    worker_id: str
    address: str
    lease_id: str = ""  # its id on the gateway's lease stream
    free_slots: int = 0  # the lease slots its worker had left once it was granted (the scheduler's word)
    released: bool = False
    first_token_sent: bool = False


class GenerationStream:
    """One request on a worker, under a lease. Iterate :meth:`events` for TextDelta events and a final StreamEnd;
    :meth:`aclose` (always called, also after the last event) stops the worker call and releases the lease."""

    def __init__(self, pipeline: Pipeline, *, lease: _Lease, call: WorkerCall, start: StreamStart,
                 arrived: float, timeline: Timeline | None = None, span: Span | None = None) -> None:
        self.pipeline = pipeline
        self._span = span  # the worker call's client span, ended with the call
        pipeline.streams += 1
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
                if chunk is aio.EOF:
                    raise self._fail(Unavailable("the worker ended the stream without finishing"))
                kind = chunk.WhichOneof("kind")
                if self._ttft_s and (gate := self.pipeline.token_gate) is not None and \
                        (turn := gate.wait()) is not None:
                    await turn  # a later token: after this turn's share (the first token never waits)
                if kind == "delta":
                    if self._timeline is not None:
                        self._timeline.first_token()
                    if not self._ttft_s:
                        self._ttft_s = max(time.monotonic() - self._arrived, 1e-6)
                        self.pipeline.report_first_token(self._lease, self._ttft_s)
                    self._completion_tokens = chunk.delta.completion_tokens
                    delta = chunk.delta
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
                    yield StreamEnd(finish_reason=_FINISH.get(f.finish_reason, "stop"),
                                    prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
                                    cached_tokens=f.usage.cached_tokens,
                                    finish_reasons=tuple(_FINISH.get(r, "stop") for r in f.choice_finish_reasons),
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
        if code in _WORKER_LOST:
            self.pipeline.metrics.worker_failures.labels("mid_stream").inc()
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
        if not self._call.done():
            self._call.cancel()
        if self._span is not None:
            if self._outcome not in (scheduler_pb2.OUTCOME_OK, scheduler_pb2.OUTCOME_CANCELLED):
                self._span.set_status(Status(StatusCode.ERROR))
            self._span.end()
        self.pipeline.release(self._lease, self._outcome, prompt_tokens=self.start.prompt_tokens,
                              completion_tokens=self._completion_tokens, ttft_s=self._ttft_s)


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
        self._models: tuple[float, list[ModelEntry]] = (0.0, [])
        self._workers: list[scheduler_pb2.WorkerStatus] = []  # the same ListWorkers answer, for model "auto"
        self.queue_waits = QueueWaits()  # measured per (model, class): what model "auto" expects to wait
        self.lease_stream = LeaseStream(scheduler)
        self.worker_streams = WorkerStreams(self._channel, per_worker=settings.worker_mux_streams,
                                            max_open=settings.worker_mux_max_open) \
            if settings.worker_mux else None  # the fast path
        # (model, class, session) -> the last grant's (worker id, address); the hit rate and probe count per
        # (model, class)
        self._hints: TTLCache[tuple[str, int, str], tuple[str, str]] = TTLCache(maxsize=_HINTS_MAX, ttl=_HINT_TTL_S)
        self._hit_rate: dict[tuple[str, int], float] = {}
        # worker address -> the lease slots it had left at its latest grant (any request's): a speculative start goes
        # only where the scheduler will very likely grant the lease at once
        self._free_slots: TTLCache[str, int] = TTLCache(maxsize=_HINTS_MAX, ttl=_HINT_TTL_S)
        self._probes: dict[tuple[str, int], int] = {}
        self._opening = 0  # requests between open() and their stream
        self.streams = 0  # generation streams open
        # later tokens at most TOKEN_GATE_PER_TURN per event-loop turn, so first tokens and new requests go first
        self.token_gate = TokenGate(settings.token_gate_per_turn, on_park=metrics.token_gate_parked.inc) \
            if settings.token_gate_per_turn else None
        self._lease_seq = itertools.count()
        self._models_refresh: asyncio.Task[list[ModelEntry]] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _channel(self, address: str) -> aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._channel_factory(address)
        return channel

    def _call_worker(self, address: str, gen: inference_pb2.GenerateRequest, *, deadline: float,
                     span: Span) -> WorkerCall:
        """Starts ``gen`` at the worker: on a shared stream (WORKER_MUX) while few of this gateway's requests run
        there (WORKER_MUX_MAX_OPEN); else as a Generate call of its own."""
        timeout = max(deadline - time.monotonic(), 0.001)
        if self.worker_streams is not None:
            started = self.worker_streams.generate(address, gen, timeout_s=timeout,
                                                   trace_context=dict(_trace_metadata(span)))
            if started is not None:
                self.metrics.worker_starts.labels("stream").inc()
                return started
        self.metrics.worker_starts.labels("call").inc()
        return inference_pb2_grpc.InferenceStub(self._channel(address)).Generate(
            gen, timeout=timeout, metadata=_trace_metadata(span))

    async def settle(self) -> None:
        """Waits (up to 5 s) for the releases sent off the response path."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)

    async def close(self) -> None:
        await self.settle()
        await self.lease_stream.close()
        if self.worker_streams is not None:
            await self.worker_streams.close()
        for channel in self._channels.values():
            await channel.close(grace=None)

    # ---- models ----------------------------------------------------------------------------------------------

    async def models(self) -> list[ModelEntry]:
        """Models served by healthy workers. Cached for ``models_cache_s``; a stale list is served while one
        refresh runs in the background, so no request waits for the scheduler once a list is known."""
        cached_at, cached = self._models
        fresh = time.monotonic() - cached_at < self.settings.models_cache_s
        if cached and fresh:
            return cached
        if self._models_refresh is None or self._models_refresh.done():
            self._models_refresh = asyncio.get_running_loop().create_task(self._fetch_models())
            # A failed background refresh keeps the old list; its error is consumed here, not logged as lost.
            self._models_refresh.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        if cached:
            return cached
        return await asyncio.shield(self._models_refresh)

    async def _fetch_models(self) -> list[ModelEntry]:
        try:
            async with self.breaker.guard():
                # a refresh behind a known list (no request waits for it) waits out a scheduler failover (no replica
                # leads for a few seconds) instead of failing at once and opening the scheduler's breaker; the first
                # fetch, which a request waits for, fails fast
                resp = await self.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5,
                                                        wait_for_ready=bool(self._models[1]))
        except grpc.RpcError as err:
            raise Unavailable(f"scheduler unavailable: {err.details() if hasattr(err, 'details') else err}") \
                from None
        by_name: dict[str, ModelEntry] = {}
        for w in resp.workers:
            if not w.healthy or not w.model.served_model_name:
                continue
            name = w.model.served_model_name
            prev = by_name.get(name)
            # "auto" tools only where every worker of the model has a parser (a request may land on any of them)
            parser = w.model.tool_call_parser if prev is None or prev.tool_call_parser == w.model.tool_call_parser \
                else ""
            # an alias counts where every worker of the model declares it (a request may land on any of them)
            aliases = tuple(sorted(set(w.model.aliases) if prev is None else set(prev.aliases) & set(w.model.aliases)))
            by_name[name] = ModelEntry(id=name, max_model_len=w.model.max_model_len,
                                       model_version=w.model.model_version,
                                       workers=(prev.workers if prev else 0) + 1, tool_call_parser=parser,
                                       aliases=aliases)
        models = sorted(by_name.values(), key=lambda m: m.id)
        self._workers = list(resp.workers)
        self._models = (time.monotonic(), models)
        return models

    async def route_auto(self, *, priority: int, prompt_tokens: int, output_tokens: int, ttft_slo_s: float,
                         tpot_slo_s: float, models: Sequence[str] = ()) -> AutoChoice:
        """``model: "auto"``: the cheapest pool predicted to meet the SLO (:mod:`goodput_gateway.autoroute`)."""
        await self.models()  # the worker list comes with the models' (cached for models_cache_s)
        pools = pools_from(self._workers, priority=priority, models=models)
        if not pools:
            raise Unavailable("model 'auto': no healthy worker serves a model it may choose"
                              + (f" ({', '.join(models)})" if models else ""), retry_after_s=5.0)
        choice = choose(pools, prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft_slo_s=ttft_slo_s,
                        tpot_slo_s=tpot_slo_s, queue_wait=lambda model: self.queue_waits.get(model, priority))
        if choice is None:
            longest = max(p.max_model_len for p in pools)
            raise InvalidArgument(f"model 'auto': the prompt (~{prompt_tokens} tokens) and max_tokens "
                                  f"({output_tokens}) fit no model's context window (the largest: {longest})",
                                  param="messages", code="context_length_exceeded")
        return choice

    async def resolve_model(self, name: str) -> ModelEntry:
        models = await self.models()
        if not models:
            raise Unavailable("no healthy inference worker is serving a model yet", retry_after_s=5.0)
        if not name:
            return models[0]
        for m in models:
            if m.id == name:
                return m
        for m in models:  # an alias answers as the model it names (the response carries m.id)
            if name in m.aliases:
                return m
        raise InvalidArgument(f"model {name!r} does not exist; available: {', '.join(m.id for m in models)}",
                              param="model", code="model_not_found")

    # ---- generation ------------------------------------------------------------------------------------------

    async def open(self, principal: Principal, request: GenerationRequest, cost: Cost, *, request_id: str,
                   model: str, arrived: float, deadline: float, max_queue_wait_s: float = 0.0,
                   timeline: Timeline | None = None, speculate: bool = True) -> GenerationStream:
        """Leases a worker for ``request`` (its priority resolved, its cost estimated) and starts generation;
        returns once the worker accepted the request, so errors surface before any response bytes are sent. A
        worker that fails before accepting is retried once on another (``worker_retry``).

        With ``speculative_start`` the worker call starts while the lease is being granted, on the worker the
        scheduler granted last for the same model, class and session where it had slots to spare
        (``speculate=False`` for a request the scheduler may well refuse): the scheduler still decides, and a grant
        elsewhere, a refusal or a place in its queue cancels the early call before anything is sent to the
        caller."""
        attempts = 2 if self.settings.worker_retry else 1
        self._opening += 1
        try:
            for attempt in range(attempts):
                early = self._speculate(principal, request, request_id=request_id, model=model, deadline=deadline) \
                    if attempt == 0 and speculate else None
                try:
                    if early is not None:
                        # the worker call first: the lease only has to come before the first token, and sent at the
                        # same moment the two wake the scheduler and the worker together, which then share the cores
                        await asyncio.wait({early.task}, timeout=_HEAD_START_S)
                    lease = await self._lease(principal, request, cost, request_id=request_id, model=model,
                                              deadline=deadline, max_queue_wait_s=max_queue_wait_s,
                                              on_queued=early.on_queued if early is not None else None)
                except BaseException as err:
                    if early is not None:
                        if isinstance(err, GoodputError):  # the scheduler refused it (not the caller going away)
                            self._judge(model, request.priority, hit=False)
                        await self._drop_early(early, "refused")
                    raise
                self._hints[(model, request.priority, request.affinity(principal.tenant))] = \
                    (lease.worker_id, lease.address)
                self._free_slots[lease.address] = lease.free_slots
                if timeline is not None:
                    timeline.mark("queue_wait")
                try:
                    if time.monotonic() >= deadline:  # granted too late: the worker is never called
                        raise DeadlineExceeded("the request's deadline passed while it waited for a worker")
                    started = None
                    if early is not None:
                        guessed, early = early, None
                        if guessed.queued:  # cancelled when its lease was queued
                            self._judge(model, request.priority, hit=False)
                            await self._drop_early(guessed, "queued")
                        else:
                            hit = guessed.address == lease.address
                            self._judge(model, request.priority, hit=hit)
                            if hit:
                                self.metrics.speculative_starts.labels("hit").inc()
                                started = await guessed.task  # its failure is this worker's, as below
                            else:
                                await self._drop_early(guessed, "miss")
                    call, start, span = started or await self._start_worker(
                        principal, request, lease, request_id=request_id, model=model, deadline=deadline)
                    return GenerationStream(self, lease=lease, call=call, start=start, arrived=arrived,
                                            timeline=timeline, span=span)
                except _WorkerLost as lost:
                    self.metrics.worker_failures.labels("before_first_token").inc()
                    self.release(lease, scheduler_pb2.OUTCOME_WORKER_FAILED)
                    if attempt + 1 == attempts:
                        raise Unavailable(f"the inference worker failed: {lost}") from None
                    log.warning("worker failed before the first token; retrying on another",
                                extra={"worker": lease.worker_id})
                except BaseException:
                    if early is not None:
                        await self._drop_early(early, "refused")
                    self.release(lease, scheduler_pb2.OUTCOME_ERROR)
                    raise
            raise Unavailable("no worker could take the request")
        finally:
            self._opening -= 1

    def _judge(self, model: str, priority: int, *, hit: bool) -> None:
        """A guess's outcome in its (model, class)'s hit rate: granted elsewhere, queued or refused is a miss."""
        key = (model, priority)
        self._hit_rate[key] = (1 - _HIT_WEIGHT) * self._hit_rate.get(key, 1.0) + _HIT_WEIGHT * hit

    def _speculate(self, principal: Principal, req: GenerationRequest, *, request_id: str, model: str,
                   deadline: float) -> _Early | None:
        """The worker call started early on the last granted worker of (model, class, session), when that grant is
        recent, the worker had slots to spare at its latest grant, the gateway's in-flight requests are within
        bounds and such guesses have lately been right; None otherwise."""
        if not self.settings.speculative_start or \
                self._opening + self.streams > self.settings.speculative_start_max_inflight:
            return None
        hint = self._hints.get((model, req.priority, req.affinity(principal.tenant)))
        if hint is None or self._free_slots.get(hint[1], 0) < self.settings.speculative_start_min_free_slots:
            return None
        key = (model, req.priority)
        if self._hit_rate.get(key, 1.0) < _HIT_FLOOR:  # lately wrong (an idle fleet of equals, spread at random)
            self._probes[key] = self._probes.get(key, 0) + 1
            if self._probes[key] % _PROBE_EVERY:
                return None
        worker_id, address = hint
        guess = _Lease(worker_id=worker_id, address=address)
        task = asyncio.get_running_loop().create_task(
            self._start_worker(principal, req, guess, request_id=request_id, model=model, deadline=deadline),
            name=f"early-start-{request_id}")
        return _Early(address=address, task=task)

    async def _drop_early(self, early: _Early, why: str) -> None:
        """Cancels an early worker call that the grant did not confirm: the worker aborts it."""
        self.metrics.speculative_starts.labels(why).inc()
        if not early.task.done():
            early.task.cancel()  # _start_worker cancels its call and ends its span on the way out
        try:
            call, _, span = await early.task
        except (asyncio.CancelledError, Exception):  # whatever the early call met, nobody waits for it
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # this request itself is being cancelled
                raise
            return
        call.cancel()
        span.set_attribute("goodput.speculative", why)
        span.end()

    async def _lease(self, principal: Principal, req: GenerationRequest, cost: Cost, *, request_id: str,
                     model: str, deadline: float, max_queue_wait_s: float = 0.0,
                     on_queued: Callable[[], None] | None = None) -> _Lease:
        started = time.monotonic()
        admit = scheduler_pb2.Admit(request_id=request_id, tenant=principal.tenant, priority=cast(Any, req.priority),
                                    model=model, prompt_tokens_estimate=cost.prompt_tokens,
                                    max_tokens=cost.max_tokens, prefix_hint=req.prefix_hint(),
                                    session_id=req.affinity(principal.tenant), fixed_output=cost.fixed_output,
                                    tenant_weight=principal.weight,
                                    max_queue_wait_s=max_queue_wait_s)
        # unique on the stream even when a caller reuses its request id (or the worker retry leases again)
        lease_id = f"{request_id}/{next(self._lease_seq)}"
        async with self.breaker.guard():
            granted = await self.lease_stream.acquire(lease_id, admit, timeout_s=deadline - time.monotonic(),
                                                      on_queued=on_queued)
        self.metrics.stage.labels("schedule").observe(time.monotonic() - started)
        self.queue_waits.observe(model, req.priority, granted.queue_wait_s)
        return _Lease(worker_id=granted.worker_id, address=granted.address, lease_id=lease_id,
                      free_slots=granted.free_slots)

    async def _start_worker(self, principal: Principal, req: GenerationRequest, lease: _Lease, *, request_id: str,
                            model: str, deadline: float) -> tuple[WorkerCall, StreamStart, Span]:
        tools, parallel = worker_tools(req)  # tool_choice auto: the worker's template and tool parser take them
        gen = inference_pb2.GenerateRequest(
            request_id=request_id, model=model, prompt=req.prompt, sampling=sampling_to_proto(req.sampling),
            priority=cast(Any, req.priority), tenant=principal.tenant, tools=tools, parallel_tool_calls=parallel,
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
            if code in _WORKER_LOST:
                raise _WorkerLost(err.details() if isinstance(err, aio.AioRpcError) else str(err)) from None
            raise from_rpc_error(err) from None
        except BaseException:
            call.cancel()
            _end_failed(span)
            raise
        if first is aio.EOF or first.WhichOneof("kind") != "started":
            call.cancel()
            _end_failed(span)
            raise _WorkerLost("the worker did not acknowledge the request")
        return call, StreamStart(request_id=request_id, model=model, worker_id=lease.worker_id,
                                 prompt_tokens=first.started.prompt_tokens), span

    def report_first_token(self, lease: _Lease, ttft_s: float) -> None:
        """Tells the scheduler the prompt's prefill is done (off the caller's path): its prefill gate and latency
        guard act on it before the request ends."""
        if lease.released or lease.first_token_sent:
            return
        lease.first_token_sent = True
        self.lease_stream.first_token(lease.lease_id, ttft_s)

    def release(self, lease: _Lease, outcome: int, *, prompt_tokens: int = 0, completion_tokens: int = 0,
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


class _WorkerLost(Exception):
    pass
