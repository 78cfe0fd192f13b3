"""Where a request's time went: one :class:`Timeline` per request, marked at the end of each stage, refined with the
engine's own timings, and returned to the caller.

The gateway marks consecutive stage ends on one monotonic clock (auth/parse, quota, cache lookup, retrieval, prompt
assembly, queue wait, first token, last token, post-processing), so the stages add up to the end-to-end latency by
construction. The worker's span (lease granted to last token) is then split with the engine's timestamps
(``EngineTiming``): time queued in the engine, prefill, decode, and ``network`` for the rest (the hops, the
worker's own pre-processing, serialisation).

The breakdown goes back to the caller as ``Server-Timing`` (non-streaming REST), a final ``goodput_timing`` object
in the SSE stream, and ``goodput-timing`` trailing metadata on gRPC; it is recorded as one histogram per stage and
class (``goodput_gateway_stage_seconds``), a counter of stages over budget, and one span per stage.

    >>> clock = iter([0.010, 0.012, 0.020, 0.030, 0.100, 0.400, 0.402]).__next__
    >>> t = Timeline(arrived=0.0, now=clock)
    >>> for stage in ("auth_parse", "quota", "cache_lookup", "prompt_assembly", "queue_wait"):
    ...     t.mark(stage)
    >>> t.first_token(), t.last_token()
    (None, None)
    >>> t.engine = EngineTimes(queued_s=0.0, prefill_s=0.2, decode_s=0.0)
    >>> t.mark("post_processing", at=0.41)
    >>> b = t.breakdown()
    >>> {k: round(v * 1000) for k, v in b.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'auth_parse': 10, 'quota': 2, 'cache_lookup': 8, 'prompt_assembly': 10, 'queue_wait': 70, 'network': 102,
     'prefill': 200, 'decode': 0, 'post_processing': 8}
    >>> round(sum(b.values()), 3) == round(t.total(), 3) == 0.41
    True
    >>> t.server_timing()[:44]
    'auth_parse;dur=10.0, quota;dur=2.0, cache_lo'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput_core.metrics import LATENCY_BUCKETS

from goodput_gateway.profile import STAGES, ClassProfile, LatencyProfile

if TYPE_CHECKING:
    from goodput_gateway.autoroute import AutoChoice

__all__ = ["EngineTimes", "Timeline", "TimingMetrics"]

_PRIORITIES = {1: "P0", 2: "P1", 3: "P2"}


@dataclass(frozen=True)
class EngineTimes:
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class TimingMetrics:
    def __init__(self, registry: CollectorRegistry | None, profile: LatencyProfile, *,
                 labels: Callable[[str], str] | None = None) -> None:
        self.tenant_label = labels or (lambda tenant: tenant)  # bounded (goodput_gateway.tenants)
        self.slo = Counter("goodput_gateway_slo_requests_total", "Answered requests by whether they met their "
                           "class's SLO (TTFT and TPOT thresholds of the latency profile).",
                           ["priority", "tenant", "model", "result"], registry=registry)
        self.goodput_tokens = Counter("goodput_gateway_goodput_tokens_total", "Output tokens of requests that met "
                                      "their SLO (less those later discarded: "
                                      "goodput_gateway_goodput_discarded_tokens_total).",
                                      ["priority", "tenant", "model"], registry=registry)
        self.discarded_tokens = Counter("goodput_gateway_goodput_discarded_tokens_total", "Output tokens of "
                                        "SLO-meeting answers the caller reported discarded or regenerated "
                                        "(POST /v1/feedback): not goodput after all.",
                                        ["priority", "tenant", "model"], registry=registry)
        self.feedback = Counter("goodput_gateway_feedback_total", "Feedback on answers, by verdict.", ["verdict"],
                                registry=registry)
        self.stage = Histogram("goodput_gateway_stage_seconds", "Time per request stage, by class (the stages add "
                               "up to the end-to-end latency).", ["stage", "priority"], buckets=LATENCY_BUCKETS,
                               registry=registry)
        self.breaches = Counter("goodput_gateway_budget_breaches_total", "Requests whose stage took longer than "
                                "its budget in the latency profile.", ["stage", "priority"], registry=registry)
        budget = Gauge("goodput_gateway_stage_budget_seconds", "Each stage's budget per class (the latency "
                       "profile); decode's is per output token.", ["stage", "priority"], registry=registry)
        for prio, name in _PRIORITIES.items():
            cls = profile.of(prio)
            for stage in STAGES:
                value = cls.budget(stage) if stage != "decode" else cls.budgets.tpot
                if value is not None:
                    budget.labels(stage, name).set(value)
        self.deadline_refusals = Counter("goodput_gateway_deadline_refusals_total", "Requests refused or cut "
                                         "because their deadline passed (expired) or could not be met "
                                         "(predicted_late).", ["priority", "reason"], registry=registry)


@dataclass
class Timeline:
    """A request's stage ends on the monotonic clock. ``mark(stage)`` ends ``stage`` now (it began where the
    previous one ended); the generation's first and last token are marked by :meth:`first_token` and
    :meth:`last_token` (the worker's span, split at the end with :attr:`engine`)."""

    arrived: float
    now: Callable[[], float] = field(default=time.monotonic, repr=False)
    wall_arrived_ns: int = field(default_factory=time.time_ns)
    marks: list[tuple[str, float]] = field(default_factory=list)
    engine: EngineTimes | None = None
    completion_tokens: int = 0
    degraded: list[str] = field(default_factory=list)
    retrieval_legs: dict[str, float] = field(default_factory=dict)  # the retriever's legs (parallel), seconds
    retrieval_outcome: dict[str, str] = field(default_factory=dict)  # e.g. {"rerank": "skipped: deadline"}
    route: AutoChoice | None = None  # what model "auto" chose and predicted
    _first: float | None = None
    _last: float | None = None
    _finished: bool = False

    def mark(self, stage: str, *, at: float | None = None) -> None:
        self.marks.append((stage, self.now() if at is None else at))

    def first_token(self, at: float | None = None) -> None:
        """The worker's first token reached the gateway (ends the queue wait's successor: prefill + network)."""
        if self._first is None:
            self._first = self.now() if at is None else at

    def last_token(self, at: float | None = None) -> None:
        if self._last is None:
            self._last = self.now() if at is None else at

    def end(self) -> float:
        return self.marks[-1][1] if self.marks else self.arrived

    def total(self) -> float:
        return self.end() - self.arrived

    def breakdown(self) -> dict[str, float]:
        """Seconds per stage, in order; they add up to :meth:`total`."""
        out: dict[str, float] = {}
        start = self.arrived
        for stage, at in self.marks:
            if stage == "post_processing" and self._first is not None:
                self._split_worker(out, start, at)
                start = self._last if self._last is not None else at
            out[stage] = out.get(stage, 0.0) + max(at - start, 0.0)
            start = max(at, start)
        return out

    def _split_worker(self, out: dict[str, float], start: float, end: float) -> None:
        """The worker's span (from the grant to the last token) as network, engine queue, prefill and decode."""
        first = self._first if self._first is not None else end
        last = self._last if self._last is not None else end
        before, during = max(first - start, 0.0), max(last - first, 0.0)
        engine = self.engine or EngineTimes()
        queued = min(engine.queued_s, before)
        prefill = min(engine.prefill_s, before - queued)
        decode = min(engine.decode_s, during) if self.engine is not None else during
        out["network"] = before - queued - prefill + during - decode
        if queued:
            out["engine_queue"] = queued
        out["prefill"] = prefill if self.engine is not None else 0.0
        out["decode"] = decode

    def ttft(self) -> float | None:
        """Arrival to first token (None for an answer without one: a cache hit's is its whole time)."""
        return None if self._first is None else self._first - self.arrived

    def tpot(self) -> float:
        """Mean time per output token after the first."""
        if self._first is None or self._last is None or self.completion_tokens < 2:
            return 0.0
        return (self._last - self._first) / (self.completion_tokens - 1)

    def met(self, cls: ClassProfile) -> bool:
        """Whether the request met its class's SLO: TTFT (a cache hit: its whole time) and TPOT within bounds."""
        ttft = self.ttft()
        return (self.total() if ttft is None else ttft) <= cls.slo.ttft_s and self.tpot() <= cls.slo.tpot_s

    def server_timing(self) -> str:
        """The breakdown as an HTTP ``Server-Timing`` value (milliseconds), with ``total``."""
        parts = [f"{stage};dur={seconds * 1000:.1f}" for stage, seconds in self.breakdown().items()]
        return ", ".join([*parts, f"total;dur={self.total() * 1000:.1f}"])

    def as_json(self, cls: ClassProfile | None = None) -> dict[str, Any]:
        """The breakdown in milliseconds, the total, the stages over budget and the degradation steps taken."""
        stages = self.breakdown()
        body: dict[str, Any] = {"stages_ms": {k: round(v * 1000, 3) for k, v in stages.items()},
                                "total_ms": round(self.total() * 1000, 3)}
        if cls is not None:
            body["over_budget"] = self.over_budget(cls, stages)
        if self.degraded:
            body["degraded"] = list(self.degraded)
        if self.retrieval_legs:  # inside the retrieval stage (dense and lexical run in parallel)
            body["retrieval_legs_ms"] = {k: round(v * 1000, 3) for k, v in self.retrieval_legs.items()}
        if self.retrieval_outcome:  # a rerank asked for: applied, or skipped and why
            body.update(self.retrieval_outcome)
        return body

    def over_budget(self, cls: ClassProfile, stages: dict[str, float] | None = None) -> list[str]:
        stages = self.breakdown() if stages is None else stages
        over = []
        for stage, seconds in stages.items():
            if stage == "decode":
                budget = cls.budgets.tpot * max(self.completion_tokens - 1, 1)
            else:
                budget = cls.budget(stage)  # type: ignore[assignment]
            if budget is not None and seconds > budget:
                over.append(stage)
        return over

    def finish(self, metrics: TimingMetrics, cls: ClassProfile, priority: int, *,
               tracer: trace.Tracer | None = None) -> dict[str, float]:
        """Records the breakdown once (histograms, breaches, one span per stage); returns it."""
        stages = self.breakdown()
        if self._finished:
            return stages
        self._finished = True
        prio = _PRIORITIES.get(priority, "P1")
        for stage, seconds in stages.items():
            metrics.stage.labels(stage, prio).observe(seconds)
        for stage in self.over_budget(cls, stages):
            metrics.breaches.labels(stage, prio).inc()
        if tracer is not None and trace.get_current_span().is_recording():  # else its children are not sampled either
            self._spans(tracer, stages)
        return stages

    def _spans(self, tracer: trace.Tracer, stages: dict[str, float]) -> None:
        start = self.wall_arrived_ns
        for stage, seconds in stages.items():
            end = start + int(seconds * 1e9)
            tracer.start_span(f"stage.{stage}", start_time=start).end(end_time=end)
            start = end
