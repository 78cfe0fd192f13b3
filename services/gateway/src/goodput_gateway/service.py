"""The request path behind both APIs, in one function: :meth:`GatewayService.generate`.

REST (:mod:`goodput_gateway.rest`), gRPC (:mod:`goodput_gateway.servicer`) and the jobs worker hand over a
:class:`Call` (credentials, a parser for their wire format, the caller's options) and shape the events that come
back; everything between is here, in the order it happens: authenticate -> parse -> quotas (the tenant's and the
key's limits) -> cache lookup -> RAG -> admit (lease a worker) -> stream -> release -> cache store -> settle the
quotas and meter the usage. Cross-cutting work wraps the token stream (timing, the cache
store); it does not live inside it.

Example (the service composed by :func:`goodput_gateway.__main__.compose`, inside a coroutine)::

    generation = await service.open(Call(parse=parse_body, authorization="Bearer k"))
    generation.opened.model, generation.opened.sources
    async with generation:
        async for event in generation:     # TextDelta ..., then StreamEnd
            ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

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

from goodput_gateway.auth import ApiKeyStore, Principal
from goodput_gateway.autoroute import AUTO_MODEL
from goodput_gateway.caching import CacheStatus, GatewayCache, replay, sources_of
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.feedback import FeedbackStore
from goodput_gateway.generation import Call, Generation, Opened
from goodput_gateway.jobs.parking import park
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.knowledge import Knowledge
from goodput_gateway.ladder import Ladder
from goodput_gateway.metering import Meter, Usage
from goodput_gateway.metrics import GatewayMetrics, timed
from goodput_gateway.pipeline import ModelEntry, Pipeline
from goodput_gateway.profile import ClassProfile, Deadline
from goodput_gateway.quotas import Admission, Quotas, RateLimited
from goodput_gateway.rag import Retrieval, Source, augment
from goodput_gateway.requests import GenerationRequest, estimate_tokens, resolve_cost, validate
from goodput_gateway.timing import Timeline, TimingMetrics
from goodput_gateway.tools import apply_tools, auto
from goodput_gateway.trace_recorder import TraceRecorder

__all__ = ["GatewayService"]

_tracer = trace.get_tracer("goodput.gateway")
log = logging.getLogger("goodput.gateway")
# Stages the ladder's steps relieve: one over budget counts as a miss for the ladder, like a missed SLO.
_LADDER_STAGES = {"cache_lookup", "retrieval", "queue_wait", "prefill"}


@dataclass
class _Tokens:
    """What one admitted request used, filled in as it runs."""

    inference: bool = False  # a worker ran it
    finished: bool = False  # its stream reached its end
    cache_hit: bool = False
    saved: int = 0  # tokens a cache hit did not compute
    model: str = ""  # the model that answered, when a lighter one stood in for the one asked for
    prompt: int = 0
    completion: int = 0
    cached: int = 0  # prompt tokens from the engine's prefix cache


class GatewayService:
    def __init__(self, settings: GatewaySettings, *, keys: ApiKeyStore, pipeline: Pipeline,
                 metrics: GatewayMetrics, knowledge: Knowledge | None = None,
                 cache: GatewayCache | None = None, jobs: JobQueue | None = None, quotas: Quotas | None = None,
                 meter: Meter | None = None, timing_metrics: TimingMetrics | None = None,
                 ladder: Ladder | None = None, feedback: FeedbackStore | None = None,
                 trace: TraceRecorder | None = None) -> None:
        self.settings = settings
        self.trace = trace  # the workload trace (TRACE_PATH); None = off
        self.feedback = feedback  # what became of each answer (POST /v1/feedback); None = not taken
        self.timing_metrics = timing_metrics or TimingMetrics(None, settings.latency_profile)
        self.ladder = ladder or Ladder(settings.latency_profile, enabled=settings.ladder_enabled,
                                       interval_s=settings.ladder_interval_s, raise_at=settings.ladder_raise_at,
                                       lower_at=settings.ladder_lower_at)
        self.ladder.applies = self._step_applies
        self.keys = keys
        self.quotas = quotas or Quotas(settings, redis_url="")
        self.meter = meter or Meter(settings, redis=None)
        self.pipeline = pipeline
        self.metrics = metrics
        self.knowledge = knowledge
        self.cache = cache
        self.jobs = jobs  # where shed P2 work is parked; None = not parked

    def _timed(self, opened: Opened, timeline: Timeline, end: StreamEnd | None = None) -> None:
        """A finished answer's breakdown: recorded (histograms, budget breaches, spans), judged against its class's
        SLO (goodput), fed to the degradation ladder, and offered to the workload trace (a sample, off this path)."""
        if self.trace is not None:
            self.trace.offer_answer(opened, timeline, end)
        cls = opened.profile
        if cls is None:
            return
        m = self.timing_metrics
        stages = timeline.finish(m, cls, opened.priority, tracer=_tracer)
        met = timeline.met(cls)
        ttft, route = timeline.ttft(), timeline.route
        if route is not None and ttft is not None:  # the auto predictor's error, measured on what it routed
            self.metrics.auto_prediction.labels("ttft").observe(ttft / max(route.prediction.ttft_s, 1e-6))
            if timeline.completion_tokens > 1:
                self.metrics.auto_prediction.labels("tpot").observe(timeline.tpot() / max(route.prediction.tpot_s,
                                                                                           1e-6))
        prio, tenant = priority_name(opened.priority), m.tenant_label(opened.tenant)
        m.slo.labels(prio, tenant, opened.model, "met" if met else "missed").inc()
        if met:
            m.goodput_tokens.labels(prio, tenant, opened.model).inc(timeline.completion_tokens)
        over = set(timeline.over_budget(cls, stages)) & _LADDER_STAGES
        self.ladder.observe(opened.priority, missed=not met or bool(over))
        if self.feedback is not None:
            self.feedback.remember(opened, tokens=timeline.completion_tokens if met else 0)

    def authenticate(self, authorization: str | None) -> Principal:
        started = time.monotonic()
        principal = self.keys.authenticate(authorization)
        tenant_id_var.set(principal.tenant)
        self.metrics.stage.labels("auth").observe(time.monotonic() - started)
        return principal

    @asynccontextmanager
    async def metered(self, principal: Principal, *, what: str, tokens: int) -> AsyncIterator[Admission]:
        """A call that is not a generation (embeddings, search, indexing: ``what``) under the caller's quotas,
        admitted with ``tokens`` estimated input tokens and metered; the block may set ``admission.used`` to the
        tokens really used. Its ``headers`` are the x-ratelimit-* values for the response.

        Example::

            async with service.metered(principal, what="embeddings", tokens=estimate) as admission:
                result = await knowledge.embed(texts)
                admission.used = result.tokens
        """
        try:
            admission = await self.quotas.admit(principal, prompt_tokens=tokens,
                                                timeout_s=self.settings.request_timeout_s)
        except RateLimited:
            self.meter.record(principal.tenant, what, Usage(refused=1))
            raise
        done = False
        try:
            yield admission
            done = True
        finally:
            used = tokens if admission.used is None else admission.used
            admission.settle(prompt_tokens=used, completion_tokens=0, inference=done)
            self.meter.record(principal.tenant, what, Usage(requests=1, prompt_tokens=used if done else 0,
                                                            gpu_seconds=self.meter.gpu_seconds(used, 0) if done
                                                            else 0.0), outcome="ok" if done else "error")

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
        return Generation(opened, events, on_timing=self._timed)

    async def generate(self, call: Call) -> AsyncGenerator[Opened | TextDelta | StreamEnd, None]:
        """One request, top to bottom: an :class:`Opened` event, then TextDelta events, then a StreamEnd."""
        arrived = call.arrived or time.monotonic()
        request_id = call.request_id or new_request_id()
        timeline = Timeline(arrived=arrived)

        # authenticate, before anything is parsed
        principal = call.principal or self.authenticate(call.authorization)

        # parse and check; the priority is resolved against the key here, once, before anything is spent
        started = time.monotonic()
        asked = await call.parse()
        request = replace(asked, priority=principal.resolve_priority(asked.priority))
        # the deadline: the caller's (gRPC deadline, or a REST header), else its class's; never past the longest
        cls = self.settings.latency_profile.of(request.priority)
        timeout = min(call.timeout_s or cls.deadline_s, self.settings.request_timeout_s)
        deadline = arrived + timeout
        validate(request, self.settings)
        if request.safety_identifier:  # the end user, as traces keep it: a hash, never the value
            trace.get_current_span().set_attribute("goodput.safety_id", request.safety_hash(principal.tenant))
        if request.model == AUTO_MODEL and not any(AUTO_MODEL == m.id or AUTO_MODEL in m.aliases
                                                   for m in await self.pipeline.models()):
            request = await self._route_auto(request, cls, timeline)
        try:
            model = await self.pipeline.resolve_model(request.model)
        except InvalidArgument as err:  # no healthy worker serves it: its lighter model, where configured and allowed
            lighter = self._fallback_for(principal, request.model)
            if err.code != "model_not_found" or lighter is None:
                raise
            model = await self.pipeline.resolve_model(lighter)
            self._fell_back(timeline, request.model, model.id, "down")
        if request.model and request.model != model.id:  # an alias: from here on the model's served name (cache
            request = replace(request, model=model.id)  # keys, quotas, metering and the answer's `model` agree)
        steps = self.ladder.active(request.priority)  # the degradation ladder's steps in force for the class
        if "shed" in steps and self.ladder.sheds(request.priority):
            self.ladder.taken("shed", request.priority)
            raise ResourceExhausted(f"{priority_name(request.priority)} is degraded to its last step: a share of its "
                                    "requests is shed so the rest meet their SLO; retry shortly",
                                    code="degraded_shed", retry_after_s=self.ladder.retry_after_s())
        if "fallback_model" in steps and cls.fallback_model and cls.fallback_model != model.id:
            model = await self.pipeline.resolve_model(cls.fallback_model)
            request = replace(request, model=model.id)
            timeline.degraded.append("fallback_model")
            self.ladder.taken("fallback_model", request.priority)
        if auto(request) and not model.tool_call_parser:
            raise InvalidArgument(f"tool_choice 'auto' (the default with tools) needs the model's tool-call parser, "
                                  f"and {model.id!r} is served without one; use 'required' or a named function "
                                  "(enforced for any model) or 'none'", param="tool_choice", code="unsupported_value")
        self.metrics.stage.labels("validate").observe(time.monotonic() - started)
        prio = priority_name(request.priority)
        timeline.mark("auth_parse")

        # quotas: the tenant's and the key's limits, before anything is spent (a refusal is a 429 with the limits)
        started = time.monotonic()
        _, estimate = resolve_cost(request, self.settings, max_model_len=model.max_model_len)
        try:
            # an answer that runs to max_tokens (ignore_eos) is counted whole at admission: its size is known
            admission = await self.quotas.admit(principal, prompt_tokens=estimate.known_tokens, timeout_s=timeout)
        except RateLimited:
            self.meter.record(principal.tenant, model.id, Usage(refused=1))
            raise
        self.metrics.stage.labels("quota").observe(time.monotonic() - started)
        timeline.mark("quota")
        tokens = _Tokens()
        admitted = self._admitted(call, principal, request, model, admission, tokens, request_id=request_id,
                                  arrived=arrived, deadline=Deadline(arrived, deadline), prio=prio,
                                  timeline=timeline, cls=cls, steps=steps)
        try:
            async for event in admitted:
                yield event
        except GoodputError as err:
            for name, value in admission.headers.items():  # a later refusal (shed, no worker) shows the limits too
                err.headers.setdefault(name, value)
            if isinstance(err, DeadlineExceeded):
                self.timing_metrics.deadline_refusals.labels(
                    prio, "predicted_late" if err.code == "deadline_unreachable" else "expired").inc()
            elif err.code == "deadline_unreachable_now":
                self.timing_metrics.deadline_refusals.labels(prio, "predicted_late").inc()
            raise
        finally:
            try:
                await admitted.aclose()  # now, not when collected: its stream's release fills in `tokens`
            finally:
                # whatever happened: the place goes back (under the model that answered)
                self._account(principal, tokens.model or model.id, admission, tokens)

    async def _admitted(self, call: Call, principal: Principal, request: GenerationRequest, model: ModelEntry,
                        admission: Admission, tokens: _Tokens, *, request_id: str, arrived: float,
                        deadline: Deadline, prio: str, timeline: Timeline, cls: ClassProfile,
                        steps: tuple[str, ...] = ()) -> AsyncGenerator[Opened | TextDelta | StreamEnd, None]:
        """The request once its quotas admitted it; ``tokens`` records what it used, for the accounting."""
        # what the engine sees: tools described and a call's schema enforced (the caller's request is what an
        # answer is shaped from and what a parked job stores)
        engine = apply_tools(request)
        # cache lookup: a hit needs no retrieval and no worker
        status: CacheStatus | None = None
        if self.cache is not None:
            deadline.check("cache_lookup")
            started = time.monotonic()
            semantic = "exact_cache_only" not in steps
            if not semantic and self.settings.cache_semantic:
                self._degrade(timeline, "exact_cache_only", request.priority)
            status, hit = await self.cache.lookup(principal, engine, model, cache_control=call.cache_control,
                                                  timeout_s=deadline.cap(min(cls.budgets.cache_lookup,
                                                                             self.settings.cache_timeout_s)),
                                                  semantic=semantic)
            self.metrics.stage.labels("cache").observe(time.monotonic() - started)
            timeline.mark("cache_lookup")
            if hit is not None:
                tokens.cache_hit = True
                tokens.saved = hit.usage.prompt_tokens + hit.usage.completion_tokens
                yield Opened(request_id=request_id, tenant=principal.tenant, priority=request.priority, model=model.id,
                             worker_id="cache", request=request, sources=sources_of(hit), cache=status,
                             rate_limits=admission.headers, timeline=timeline, profile=cls)
                async for event in timed(replay(hit), self.metrics, priority=prio, arrived=arrived):
                    yield event
                return

        # RAG: the knowledge base's best chunks in front of the conversation
        rag = Retrieval()
        if engine.knowledge_base:
            deadline.check("retrieval")
            rag = self._rag_steps(steps, deadline, cls, timeline, request.priority)
        grounded, sources = await self._retrieve(principal, engine, max_model_len=model.max_model_len,
                                                 timeout_s=deadline.cap(cls.budgets.retrieval), rag=rag)
        if engine.knowledge_base:
            timeline.mark("retrieval")
            timeline.retrieval_legs.update(rag.legs)  # inside retrieval, in parallel: reported, not summed
            timeline.retrieval_outcome.update(rag.outcome)

        # cost, once, on the final prompt; then admission: the scheduler leases a worker (or sheds). A caller's
        # deadline shorter than its class's is where the scheduler refuses what it predicts late: such a request is
        # not started on a worker before its grant (speculative start), so a refused one reaches no worker.
        final, cost = resolve_cost(grounded, self.settings, max_model_len=model.max_model_len)
        speculate = not call.timeout_s or call.timeout_s >= cls.deadline_s
        timeline.mark("prompt_assembly")
        deadline.check("admission")
        try:
            stream = await self.pipeline.open(principal, final, cost, request_id=request_id, model=model.id,
                                              arrived=arrived, deadline=deadline.deadline,
                                              max_queue_wait_s=deadline.cap(cls.budgets.queue_wait),
                                              timeline=timeline, speculate=speculate)
        except (ResourceExhausted, Unavailable) as err:
            lighter = self._fallback_for(principal, model.id)
            try:
                fallback = await self.pipeline.resolve_model(lighter) if lighter else None
                if fallback is not None:  # and the prompt must fit its context window
                    resolve_cost(replace(grounded, model=fallback.id), self.settings,
                                 max_model_len=fallback.max_model_len)
            except GoodputError:  # the lighter model is not served, or cannot take it: the original refusal stands
                fallback = None
            if fallback is None or fallback.id == model.id:
                if isinstance(err, ResourceExhausted):
                    await self._park(err, principal, request)  # batch work is parked, not lost (raises Parked)
                raise
            # the model's pool is saturated or down: its lighter model answers (never stored under the asked one)
            self._fell_back(timeline, model.id, fallback.id, "saturated" if isinstance(err, ResourceExhausted)
                            else "down")
            asked = request
            model, request = fallback, replace(request, model=fallback.id)
            tokens.model = fallback.id
            if status is not None:
                status.store = False
            final, cost = resolve_cost(replace(grounded, model=fallback.id), self.settings,
                                       max_model_len=model.max_model_len)
            try:
                stream = await self.pipeline.open(principal, final, cost, request_id=request_id, model=model.id,
                                                  arrived=arrived, deadline=deadline.deadline,
                                                  max_queue_wait_s=deadline.cap(cls.budgets.queue_wait),
                                                  timeline=timeline, speculate=speculate)
            except ResourceExhausted as refused:
                await self._park(refused, principal, asked)  # batch work is parked as asked for, not lost
                raise

        # stream: tokens flow worker -> caller; the cache store and the timing wrap the stream
        try:
            tokens.inference = True
            yield Opened(request_id=request_id, tenant=principal.tenant, priority=request.priority, model=model.id,
                         worker_id=stream.start.worker_id, request=request, sources=sources, cache=status,
                         rate_limits=admission.headers, timeline=timeline, profile=cls)
            events = timed(stream.events(), self.metrics, priority=prio, arrived=arrived)
            if self.cache is not None and status is not None:
                events = self.cache.storing(events, status, sources)
            async for event in events:
                if isinstance(event, StreamEnd):
                    tokens.finished = True
                yield event
        finally:
            await stream.aclose()  # release: the worker call stops and the lease goes back, whatever happened
            tokens.prompt, tokens.completion, tokens.cached = stream.usage()

    def _account(self, principal: Principal, model: str, admission: Admission, tokens: _Tokens) -> None:
        """The request's quotas settled with what it really used, and its usage metered (off the response path)."""
        admission.settle(prompt_tokens=tokens.prompt, completion_tokens=tokens.completion,
                         inference=tokens.inference)
        if tokens.cache_hit:
            usage = Usage(requests=1, cache_hits=1, saved_tokens=tokens.saved)
        else:
            usage = Usage(requests=1, prompt_tokens=tokens.prompt, completion_tokens=tokens.completion,
                          cached_tokens=tokens.cached,
                          gpu_seconds=self.meter.gpu_seconds(tokens.prompt - tokens.cached, tokens.completion)
                          if tokens.inference else 0.0)
        outcome = "ok" if tokens.finished or tokens.cache_hit else "error" if not tokens.inference else "cancelled"
        self.meter.record(principal.tenant, model, usage, outcome=outcome)

    def _step_applies(self, priority: int, step: str) -> bool:
        """Whether a ladder step can change anything on this gateway (else the ladder passes over it)."""
        if step == "skip_rerank":
            return self.settings.rag_rerank
        if step == "exact_cache_only":
            return self.cache is not None and self.settings.cache_semantic
        if step == "fallback_model":
            return bool(self.settings.latency_profile.of(priority).fallback_model)
        return True

    async def _route_auto(self, request: GenerationRequest, cls: ClassProfile,
                          timeline: Timeline) -> GenerationRequest:
        """``model: "auto"``: the request for the cheapest pool predicted to meet its class's SLO (from here on it
        is a request for that model: cache, quotas, metering and the answer's ``model`` say which)."""
        route = await self.pipeline.route_auto(
            priority=request.priority, prompt_tokens=estimate_tokens(request.prompt_chars()),
            output_tokens=request.sampling.max_tokens or self.settings.default_max_tokens,
            ttft_slo_s=cls.slo.ttft_s, tpot_slo_s=cls.slo.tpot_s, models=self.settings.auto_models)
        timeline.route = route
        self.metrics.auto_choices.labels(route.model, route.pool, route.reason).inc()
        return replace(request, model=route.model)

    def _fallback_for(self, principal: Principal, model: str) -> str | None:
        """The lighter model that may answer for ``model``: configured for it (MODEL_FALLBACKS) and allowed for the
        key (its model_fallback); None otherwise."""
        if not principal.model_fallback:
            return None
        return self.settings.model_fallbacks.get(model)

    def _fell_back(self, timeline: Timeline, asked: str, served: str, reason: str) -> None:
        timeline.degraded.append("model_fallback")
        self.metrics.model_fallbacks.labels(asked, served, reason).inc()
        log.info("model fallback", extra={"asked": asked, "served": served, "reason": reason})

    def _degrade(self, timeline: Timeline, step: str, priority: int) -> None:
        timeline.degraded.append(step)
        self.ladder.taken(step, priority)

    def _rag_steps(self, steps: tuple[str, ...], deadline: Deadline, cls: ClassProfile, timeline: Timeline,
                   priority: int) -> Retrieval:
        """How this request retrieves: the ladder's RAG steps in force, or taken for this request alone when the
        time it has left cannot cover its retrieval and prefill budgets."""
        at_risk = deadline.remaining() < cls.budgets.retrieval + cls.budgets.ttft
        take = {s for s in ("skip_rerank", "fewer_chunks") if s in cls.ladder and (s in steps or at_risk)}
        rerank = self.settings.rag_rerank
        if rerank and "skip_rerank" in take:
            rerank = False
            self._degrade(timeline, "skip_rerank", priority)
        legs, rerank_s = cls.budgets.retrieval_leg, cls.budgets.rerank
        if "fewer_chunks" in take:
            self._degrade(timeline, "fewer_chunks", priority)
            return Retrieval(top_k=max(self.settings.rag_top_k // 2, 1), rerank=rerank, context_share=0.5,
                             leg_budget_s=legs, rerank_budget_s=rerank_s)
        return Retrieval(rerank=rerank, leg_budget_s=legs, rerank_budget_s=rerank_s)

    async def _retrieve(self, principal: Principal, request: GenerationRequest, *, max_model_len: int,
                        timeout_s: float | None = None,
                        rag: Retrieval | None = None) -> tuple[GenerationRequest, list[Source]]:
        if not request.knowledge_base:
            return request, []
        if self.knowledge is None or not self.knowledge.retrieval_enabled:
            raise Unimplemented("knowledge_base needs the retriever service, which this gateway is not configured "
                                "with")
        started = time.monotonic()
        grounded = await augment(self.knowledge, self.settings, tenant=principal.tenant, request=request,
                                 max_model_len=max_model_len, timeout_s=timeout_s, how=rag or Retrieval())
        self.metrics.stage.labels("retrieve").observe(time.monotonic() - started)
        return grounded

    async def _park(self, err: ResourceExhausted, principal: Principal, request: GenerationRequest) -> None:
        """A shed P2 request (the caller's, as parsed) becomes a job; the error then names it. Best effort: the
        caller gets its honest 429 either way."""
        if self.jobs is None:
            return
        try:
            parked = await park(self.jobs, err, tenant=principal.tenant, request=request)
        except Exception:  # noqa: BLE001
            log.exception("could not park a shed P2 request")
            return
        if parked is not None:
            raise parked from err
