"""The request path behind every API, in one method: :meth:`GatewayService.generate`, which reads as its steps.

REST (:mod:`goodput_gateway.api`), gRPC (:mod:`goodput_gateway.servicer`) and the jobs worker
(:mod:`goodput_gateway.worker`) hand over a :class:`~goodput_gateway.generation.Call` and shape the events that come
back (:mod:`goodput_gateway.wire`); between them, in order: parse (authenticate, check, the class
and its deadline) -> choose the model -> apply the degradation ladder -> admit under the quotas -> answer (cache
lookup or retrieval, lease a worker and start, stream) -> settle (:mod:`goodput_gateway.accounting`). Cross-cutting
work wraps the token stream (timing, the cache store); it does not live inside it.

Example (the service composed by :func:`goodput_gateway.__main__.compose`, inside a coroutine)::

    generation = await service.open(Call(parse=parse_body, authorization="Bearer k"))
    async with generation:                 # closing releases the worker and records the answer
        async for event in generation:     # TextDelta ..., then StreamEnd
            ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace

from goodput.cache.v1 import cache_pb2
from opentelemetry import trace

from goodput_core.context import new_request_id, tenant_id_var
from goodput_core.errors import (
    DeadlineExceeded,
    GoodputError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from goodput_core.priority import priority_name

from goodput_gateway.accounting import Accounting, Used
from goodput_gateway.auth import ApiKeyStore, Principal
from goodput_gateway.autoroute import AUTO_MODEL
from goodput_gateway.caching import CacheStatus, GatewayCache, replay, sources_of
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.feedback import FeedbackStore
from goodput_gateway.generation import Call, Generation, Opened
from goodput_gateway.jobs.parking import park
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.knowledge import Knowledge
from goodput_gateway.ladder import Ladder
from goodput_gateway.metering import Meter
from goodput_gateway.metrics import GatewayMetrics, timed
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.profile import ClassProfile, Deadline
from goodput_gateway.quotas import Admission, Quotas
from goodput_gateway.rag import Source, augment, retrieval_for
from goodput_gateway.requests import GenerationRequest, estimate_tokens, resolve_cost, validate
from goodput_gateway.stream import GenerationStream
from goodput_gateway.timing import Timeline, TimingMetrics
from goodput_gateway.tools import apply_tools, auto
from goodput_gateway.trace_recorder import TraceRecorder

__all__ = ["GatewayService"]

log = logging.getLogger("goodput.gateway")


@dataclass
class _Request:
    """One generation as it goes through the steps: who asks, what (its model resolved as the steps go), by when."""

    call: Call
    principal: Principal
    request: GenerationRequest  # as the caller sent it, its priority resolved, its model the served one
    cls: ClassProfile  # its class's budgets and SLO
    timeline: Timeline
    deadline: Deadline
    request_id: str
    model: ModelEntry | None = None  # chosen by _choose_model
    steps: tuple[str, ...] = ()  # the degradation ladder's steps in force for its class

    @property
    def served(self) -> ModelEntry:
        assert self.model is not None, "the model is chosen before anything is spent"
        return self.model

    @property
    def prio(self) -> str:
        return priority_name(self.request.priority)

    def opened(self, *, worker_id: str, sources: list[Source], cache: CacheStatus | None,
               admission: Admission) -> Opened:
        return Opened(request_id=self.request_id, tenant=self.principal.tenant, priority=self.request.priority,
                      model=self.served.id, worker_id=worker_id, request=self.request, sources=sources, cache=cache,
                      rate_limits=admission.headers, timeline=self.timeline, profile=self.cls)


class GatewayService:
    def __init__(self, settings: GatewaySettings, *, keys: ApiKeyStore, pipeline: Pipeline,
                 metrics: GatewayMetrics, knowledge: Knowledge | None = None,
                 cache: GatewayCache | None = None, jobs: JobQueue | None = None, quotas: Quotas | None = None,
                 meter: Meter | None = None, timing_metrics: TimingMetrics | None = None,
                 ladder: Ladder | None = None, feedback: FeedbackStore | None = None,
                 trace: TraceRecorder | None = None) -> None:
        self.settings = settings
        self.timing_metrics = timing_metrics or TimingMetrics(None, settings.latency_profile)
        self.ladder = ladder or Ladder(settings.latency_profile, enabled=settings.ladder.enabled,
                                       interval_s=settings.ladder.interval_s, raise_at=settings.ladder.raise_at,
                                       lower_at=settings.ladder.lower_at)
        self.ladder.applies = self._step_applies
        self.keys = keys
        self.quotas = quotas or Quotas(settings, redis_url="")
        self.meter = meter or Meter(settings, redis=None)
        self.accounting = Accounting(metrics, self.timing_metrics, self.ladder, self.quotas, self.meter,
                                     feedback=feedback, trace=trace)
        self.pipeline = pipeline
        self.metrics = metrics
        self.knowledge = knowledge
        self.cache = cache
        self.jobs = jobs  # where shed P2 work is parked; None = not parked

    @property
    def feedback(self) -> FeedbackStore | None:
        return self.accounting.feedback

    @property
    def trace(self) -> TraceRecorder | None:
        return self.accounting.trace

    def authenticate(self, authorization: str | None) -> Principal:
        started = time.monotonic()
        principal = self.keys.authenticate(authorization)
        tenant_id_var.set(principal.tenant)
        self.metrics.stage.labels("auth").observe(time.monotonic() - started)
        return principal

    def metered(self, principal: Principal, *, what: str, tokens: int) -> AbstractAsyncContextManager[Admission]:
        """A call that is not a generation under the caller's quotas (:meth:`Accounting.metered`)."""
        return self.accounting.metered(principal, what=what, tokens=tokens, timeout_s=self.settings.request_timeout_s)

    async def open(self, call: Call) -> Generation:
        """Runs :meth:`generate` up to its first event; errors before it (bad input, shed, no worker) raise here,
        before the caller has sent anything."""
        events = self.generate(call)
        try:
            opened = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        assert isinstance(opened, Opened)
        return Generation(opened, events, on_timing=self.accounting.answered)

    async def generate(self, call: Call) -> AsyncGenerator[Opened | TextDelta | StreamEnd, None]:
        """One request, top to bottom: an :class:`Opened` event, then TextDelta events, then a StreamEnd."""
        req = await self._parse(call)  # authenticate, parse and check; its class and deadline
        await self._choose_model(req)  # auto, an alias, a lighter model where the one asked for is down
        await self._apply_ladder(req)  # the class's degradation steps in force (its last: shed a share)
        admission = await self._admit(req)  # the tenant's and the key's quotas, before anything is spent
        used = Used()
        answer = self._answer(req, admission, used)  # cache or retrieve, admit and start a worker, stream
        try:
            async for event in answer:
                yield event
        except GoodputError as err:
            self._refused(req, admission, err)
            raise
        finally:
            try:
                await answer.aclose()  # now, not when collected: its stream's release fills in `used`
            finally:  # whatever happened: the place goes back and the usage is metered (under who answered)
                self.accounting.settle(req.principal, used.model or req.served.id, admission, used)

    # ---- the steps, in order ---------------------------------------------------------------------------------------

    async def _parse(self, call: Call) -> _Request:
        arrived = call.arrived or time.monotonic()
        principal = call.principal or self.authenticate(call.authorization)  # before anything is parsed
        tenant_id_var.set(principal.tenant)  # also for a job's call: the dependencies' breakers tell tenants apart
        started = time.monotonic()
        asked = await call.parse()
        request = replace(asked, priority=principal.resolve_priority(asked.priority))  # once, against the key
        # the deadline: the caller's (gRPC deadline, or a REST header), else its class's; never past the longest
        cls = self.settings.latency_profile.of(request.priority)
        timeout = min(call.timeout_s or cls.deadline_s, self.settings.request_timeout_s)
        validate(request, self.settings)
        if request.safety_identifier:  # the end user, as traces keep it: a hash, never the value
            trace.get_current_span().set_attribute("goodput.safety_id", request.safety_hash(principal.tenant))
        self.metrics.stage.labels("validate").observe(time.monotonic() - started)
        return _Request(call, principal, request, cls, Timeline(arrived=arrived),
                        Deadline(arrived, arrived + timeout), call.request_id or new_request_id())

    async def _choose_model(self, req: _Request) -> None:
        request = req.request
        if request.model == AUTO_MODEL and not any(AUTO_MODEL == m.id or AUTO_MODEL in m.aliases
                                                   for m in await self.pipeline.catalogue.models()):
            request = req.request = await self._route_auto(request, req.cls, req.timeline)
        try:
            req.model = await self.pipeline.catalogue.resolve_model(request.model)
        except InvalidArgument as err:  # no healthy worker serves it: its lighter model, where configured and allowed
            if err.code != "model_not_found" or not await self._fall_back(req, "down", asked=request.model):
                raise
        if request.model and request.model != req.served.id:  # an alias: from here on the served name (cache
            req.request = replace(req.request, model=req.served.id)  # keys, quotas, metering and the answer agree)
        if auto(req.request) and not req.served.tool_call_parser:
            raise InvalidArgument(f"tool_choice 'auto' (the default with tools) needs the model's tool-call parser, "
                                  f"and {req.served.id!r} is served without one; use 'required' or a named function "
                                  "(enforced for any model) or 'none'", param="tool_choice", code="unsupported_value")

    async def _apply_ladder(self, req: _Request) -> None:
        """The ladder's steps in force for the class and the tenant (the higher of the two: a tenant whose own
        requests miss their SLO climbs a ladder of its own): shed a share, answer with the class's fallback model,
        skip the semantic cache here; the RAG steps are taken at retrieval
        (:func:`~goodput_gateway.rag.retrieval_for`), which knows the time left."""
        priority, tenant = req.request.priority, req.principal.tenant
        steps = req.steps = self.ladder.active(priority, tenant)
        if "shed" in steps and self.ladder.sheds(priority, tenant):
            self.ladder.taken("shed", priority)
            why = (f"your {req.prio} requests miss their SLO while the rest of {req.prio} meets it: a share of yours"
                   if self.ladder.level(priority, tenant) > self.ladder.level(priority) else
                   f"{req.prio} is degraded to its last step: a share of its requests")
            raise ResourceExhausted(f"{why} is shed so the rest meet their SLO; retry shortly", code="degraded_shed",
                                    retry_after_s=self.ladder.retry_after_s())
        fallback = req.cls.fallback_model
        if "fallback_model" in steps and fallback and fallback != req.served.id:
            req.model = await self.pipeline.catalogue.resolve_model(fallback)
            req.request = replace(req.request, model=req.served.id)
            self._degrade(req.timeline, "fallback_model", priority)
        if "exact_cache_only" in steps and self._step_applies(priority, "exact_cache_only"):
            self._degrade(req.timeline, "exact_cache_only", priority)
        req.timeline.mark("auth_parse")

    async def _admit(self, req: _Request) -> Admission:
        started = time.monotonic()
        _, estimate = resolve_cost(req.request, self.settings, max_model_len=req.served.max_model_len)
        # the most it may use is reserved (prompt + n * max_tokens), and corrected when it ends
        admission = await self.accounting.admit(req.principal, what=req.served.id, tokens=estimate.reservation,
                                                timeout_s=req.deadline.deadline - req.timeline.arrived)
        self.metrics.stage.labels("quota").observe(time.monotonic() - started)
        req.timeline.mark("quota")
        return admission

    async def _answer(self, req: _Request, admission: Admission,
                      used: Used) -> AsyncGenerator[Opened | TextDelta | StreamEnd, None]:
        """The request once its quotas admitted it; ``used`` records what it used, for the accounting."""
        # what the engine sees: tools described and a call's schema enforced (the caller's request is what an
        # answer is shaped from and what a parked job stores)
        engine = apply_tools(req.request)
        status: CacheStatus | None = None
        if self.cache is not None:  # a hit needs no retrieval and no worker
            status, hit = await self._lookup(req, engine)
            if hit is not None:
                used.cache_hit, used.saved = True, hit.usage.prompt_tokens + hit.usage.completion_tokens
                yield req.opened(worker_id="cache", sources=sources_of(hit), cache=status, admission=admission)
                async for event in timed(replay(hit), self.metrics, priority=req.prio, arrived=req.timeline.arrived):
                    yield event
                return
        grounded, sources = await self._ground(req, engine)
        stream = await self._start(req, grounded, used, status)
        try:  # tokens flow worker -> caller; the cache store and the timing wrap the stream
            used.inference = True
            yield req.opened(worker_id=stream.start.worker_id, sources=sources, cache=status, admission=admission)
            events = timed(stream.events(), self.metrics, priority=req.prio, arrived=req.timeline.arrived)
            if self.cache is not None and status is not None:
                events = self.cache.storing(events, status, sources)
            async for event in events:
                used.finished = used.finished or isinstance(event, StreamEnd)
                yield event
        finally:
            await stream.aclose()  # release: the worker call stops and the lease goes back, whatever happened
            used.prompt, used.completion, used.cached = stream.usage()

    async def _lookup(self, req: _Request,
                      engine: GenerationRequest) -> tuple[CacheStatus, cache_pb2.LookupResponse | None]:
        assert self.cache is not None
        req.deadline.check("cache_lookup")
        started = time.monotonic()
        status, hit = await self.cache.lookup(
            req.principal, engine, req.served, cache_control=req.call.cache_control,
            timeout_s=req.deadline.cap(min(req.cls.budgets.cache_lookup, self.settings.cache_timeout_s)),
            semantic="exact_cache_only" not in req.steps)
        self.metrics.stage.labels("cache").observe(time.monotonic() - started)
        req.timeline.mark("cache_lookup")
        return status, hit

    async def _ground(self, req: _Request, engine: GenerationRequest) -> tuple[GenerationRequest, list[Source]]:
        """RAG: the knowledge base's best chunks in front of the conversation (the request as it is without one)."""
        if not engine.knowledge_base:
            return engine, []
        if self.knowledge is None or not self.knowledge.retrieval_enabled:
            raise Unimplemented("knowledge_base needs the retriever service, which this gateway is not configured "
                                "with")
        req.deadline.check("retrieval")
        rag, taken = retrieval_for(req.cls, self.settings, steps=req.steps, remaining_s=req.deadline.remaining())
        for step in taken:
            self._degrade(req.timeline, step, req.request.priority)
        started = time.monotonic()
        grounded = await augment(self.knowledge, self.settings, tenant=req.principal.tenant, request=engine,
                                 max_model_len=req.served.max_model_len,
                                 timeout_s=req.deadline.cap(req.cls.budgets.retrieval), how=rag)  # and its sources
        self.metrics.stage.labels("retrieve").observe(time.monotonic() - started)
        req.timeline.mark("retrieval")
        req.timeline.retrieval_legs.update(rag.legs)  # inside retrieval, in parallel: reported, not summed
        req.timeline.retrieval_outcome.update(rag.outcome)
        return grounded

    async def _start(self, req: _Request, grounded: GenerationRequest, used: Used,
                     status: CacheStatus | None) -> GenerationStream:
        """Cost, once, on the final prompt; then the scheduler leases a worker (or sheds) and the worker starts. A
        saturated or down pool's lighter model answers where one is configured and allowed; batch work the
        scheduler sheds is parked. A caller's deadline shorter than its class's is where the scheduler refuses what
        it predicts late: such a request is not started before its grant (speculative start), so it reaches no
        worker."""
        speculate = not req.call.timeout_s or req.call.timeout_s >= req.cls.deadline_s
        req.timeline.mark("prompt_assembly")
        req.deadline.check("admission")
        asked = req.request

        async def lease() -> GenerationStream:
            final, cost = resolve_cost(replace(grounded, model=req.served.id), self.settings,
                                       max_model_len=req.served.max_model_len)
            return await self.pipeline.open(req.principal, final, cost, request_id=req.request_id,
                                            model=req.served.id, arrived=req.timeline.arrived,
                                            deadline=req.deadline.deadline,
                                            max_queue_wait_s=req.deadline.cap(req.cls.budgets.queue_wait),
                                            timeline=req.timeline, speculate=speculate)
        try:
            return await lease()
        except (ResourceExhausted, Unavailable) as err:
            reason = "saturated" if isinstance(err, ResourceExhausted) else "down"
            if not await self._fall_back(req, reason, asked=asked.model, grounded=grounded):
                if isinstance(err, ResourceExhausted):  # batch work is parked, not lost
                    raise await park(self.jobs, err, tenant=req.principal.tenant, request=asked,
                                     principal=req.principal) from None
                raise
        used.model = req.served.id  # never stored under the model asked for
        if status is not None:
            status.store = False
        try:
            return await lease()
        except ResourceExhausted as refused:  # batch work is parked as asked for, not lost
            raise await park(self.jobs, refused, tenant=req.principal.tenant, request=asked,
                             principal=req.principal) from None

    # ---- degradation and fallback ---------------------------------------------------------------------------------

    async def _fall_back(self, req: _Request, reason: str, *, asked: str,
                         grounded: GenerationRequest | None = None) -> bool:
        """The lighter model MODEL_FALLBACKS names for ``asked`` answers instead (the pool asked for is ``reason``:
        saturated or down), where the key allows it, it is served and the prompt fits its window. False: none."""
        lighter = self.settings.model_fallbacks.get(asked) if req.principal.model_fallback else None
        if not lighter:
            return False
        try:
            fallback = await self.pipeline.catalogue.resolve_model(lighter)
            if grounded is not None:  # the prompt must fit its context window
                resolve_cost(replace(grounded, model=fallback.id), self.settings, max_model_len=fallback.max_model_len)
        except GoodputError:  # the lighter model is not served, or cannot take it: the original refusal stands
            return False
        if req.model is not None and fallback.id == req.model.id:
            return False
        req.model, req.request = fallback, replace(req.request, model=fallback.id)
        req.timeline.degraded.append("model_fallback")
        self.metrics.model_fallbacks.labels(asked, fallback.id, reason).inc()
        log.info("model fallback", extra={"asked": asked, "served": fallback.id, "reason": reason})
        return True

    def _step_applies(self, priority: int, step: str) -> bool:
        """Whether a ladder step can change anything on this gateway (else the ladder passes over it)."""
        if step == "skip_rerank":
            return self.settings.rag.rerank
        if step == "exact_cache_only":
            return self.cache is not None and self.settings.cache_semantic
        if step == "fallback_model":
            return bool(self.settings.latency_profile.of(priority).fallback_model)
        return True

    def _degrade(self, timeline: Timeline, step: str, priority: int) -> None:
        timeline.degraded.append(step)
        self.ladder.taken(step, priority)

    async def _route_auto(self, request: GenerationRequest, cls: ClassProfile,
                          timeline: Timeline) -> GenerationRequest:
        """``model: "auto"``: the request for the cheapest pool predicted to meet its class's SLO (from here on it
        is a request for that model: cache, quotas, metering and the answer's ``model`` say which)."""
        route = await self.pipeline.catalogue.route_auto(
            priority=request.priority, prompt_tokens=estimate_tokens(request.prompt_chars()),
            output_tokens=request.sampling.max_tokens or self.settings.default_max_tokens,
            ttft_slo_s=cls.slo.ttft_s, tpot_slo_s=cls.slo.tpot_s, models=self.settings.auto_models)
        timeline.route = route
        self.metrics.auto_choices.labels(route.model, route.pool, route.reason).inc()
        return replace(request, model=route.model)

    # ---- refusals ---------------------------------------------------------------------------------------------------

    def _refused(self, req: _Request, admission: Admission, err: GoodputError) -> None:
        for name, value in admission.headers.items():  # a later refusal (shed, no worker) shows the limits too
            err.headers.setdefault(name, value)
        if isinstance(err, DeadlineExceeded):
            self.timing_metrics.deadline_refusals.labels(
                req.prio, "predicted_late" if err.code == "deadline_unreachable" else "expired").inc()
        elif err.code == "deadline_unreachable_now":
            self.timing_metrics.deadline_refusals.labels(req.prio, "predicted_late").inc()
