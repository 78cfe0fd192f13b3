"""What the gateway records of what it did, in one place: every request's quotas settled and its usage metered
(:meth:`Accounting.settle`, whatever became of it), every answer judged against its class's SLO, counted as goodput,
fed to the degradation ladder, kept for feedback and offered to the workload trace (:meth:`Accounting.answered`,
called by a :class:`~goodput_gateway.generation.Generation` when it is closed), and the calls that are not
generations metered under the caller's quotas (:meth:`Accounting.metered`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from opentelemetry import trace

from goodput_core.priority import priority_name

from goodput_gateway.auth import Principal
from goodput_gateway.events import StreamEnd
from goodput_gateway.feedback import FeedbackStore
from goodput_gateway.generation import Opened
from goodput_gateway.ladder import Ladder
from goodput_gateway.metering import Meter, Usage
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.quotas import Admission, Quotas, RateLimited
from goodput_gateway.timing import Timeline, TimingMetrics
from goodput_gateway.trace_recorder import TraceRecorder

__all__ = ["Accounting", "Used"]

_tracer = trace.get_tracer("goodput.gateway")
# Stages the ladder's steps relieve: one over budget counts as a miss for the ladder, like a missed SLO.
_LADDER_STAGES = {"cache_lookup", "retrieval", "queue_wait", "prefill"}


@dataclass
class Used:
    """What one admitted request used, filled in as it runs."""

    inference: bool = False  # a worker ran it
    finished: bool = False  # its stream reached its end
    cache_hit: bool = False
    saved: int = 0  # tokens a cache hit did not compute
    model: str = ""  # the model that answered, when a lighter one stood in for the one asked for
    prompt: int = 0
    completion: int = 0
    cached: int = 0  # prompt tokens from the engine's prefix cache


@dataclass
class Accounting:
    metrics: GatewayMetrics
    timing: TimingMetrics
    ladder: Ladder
    quotas: Quotas
    meter: Meter
    feedback: FeedbackStore | None = None  # what became of each answer (POST /v1/feedback); None = not taken
    trace: TraceRecorder | None = None  # the workload trace (TRACE__PATH); None = off

    def answered(self, opened: Opened, timeline: Timeline, end: StreamEnd | None = None) -> None:
        """A finished answer's breakdown: recorded (histograms, budget breaches, spans), judged against its class's
        SLO (goodput), fed to the degradation ladder, and offered to the workload trace (a sample, off this path)."""
        if self.trace is not None:
            self.trace.offer_answer(opened, timeline, end)
        cls = opened.profile
        if cls is None:
            return
        m = self.timing
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
        self.ladder.observe(opened.priority, missed=not met or bool(over), tenant=opened.tenant)
        if self.feedback is not None:
            self.feedback.remember(opened, tokens=timeline.completion_tokens if met else 0)

    def settle(self, principal: Principal, model: str, admission: Admission, used: Used) -> None:
        """The request's quotas settled with what it really used, and its usage metered (off the response path)."""
        admission.settle(prompt_tokens=used.prompt, completion_tokens=used.completion, inference=used.inference)
        if used.cache_hit:
            usage = Usage(requests=1, cache_hits=1, saved_tokens=used.saved)
        else:
            usage = Usage(requests=1, prompt_tokens=used.prompt, completion_tokens=used.completion,
                          cached_tokens=used.cached,
                          gpu_seconds=self.meter.gpu_seconds(used.prompt - used.cached, used.completion)
                          if used.inference else 0.0)
        outcome = "ok" if used.finished or used.cache_hit else "error" if not used.inference else "cancelled"
        self.meter.record(principal.tenant, model, usage, outcome=outcome)

    async def admit(self, principal: Principal, *, what: str, tokens: int, timeout_s: float) -> Admission:
        """The caller's quotas admit and reserve ``tokens`` (the most the call may use) for ``what`` (a model, or
        embeddings...); a refusal is metered and raised (a 429 with the limits)."""
        try:
            return await self.quotas.admit(principal, tokens=tokens, timeout_s=timeout_s)
        except RateLimited:
            self.meter.record(principal.tenant, what, Usage(refused=1))
            raise

    @asynccontextmanager
    async def metered(self, principal: Principal, *, what: str, tokens: int,
                      timeout_s: float) -> AsyncIterator[Admission]:
        """A call that is not a generation (embeddings, search, indexing: ``what``) under the caller's quotas,
        admitted with ``tokens`` estimated input tokens and metered; the block may set ``admission.used`` to the
        tokens really used. Its ``headers`` are the x-ratelimit-* values for the response.

        Example::

            async with accounting.metered(principal, what="embeddings", tokens=estimate, timeout_s=30) as admission:
                result = await knowledge.embed(texts)
                admission.used = result.tokens
        """
        admission = await self.admit(principal, what=what, tokens=tokens, timeout_s=timeout_s)
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
