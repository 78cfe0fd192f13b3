"""The latency profile: per class, a request's default deadline, a budget per stage, the SLO it is judged by, and
its degradation ladder. Declarative: the defaults below, overridden by ``GOODPUT_GATEWAY_LATENCY_PROFILE`` (JSON;
the chart's ``gateway.latencyProfile`` values), class by class and field by field.

Every stage of a request runs under ``min(its budget, the time left before the deadline)`` (:meth:`Deadline.cap`):
a stage may not eat another's time, and none outlives the request. A budget is what an SRE expects a stage to
take at the class's p95; a stage over its budget is counted (``goodput_gateway_budget_breaches_total``) and the
breakdown says so.

    >>> profile = LatencyProfile.model_validate({"P0": {"deadline_s": 10, "budgets": {"cache_lookup": 0.05}}})
    >>> p0 = profile.of(1)
    >>> p0.deadline_s, p0.budgets.cache_lookup, p0.budgets.retrieval, profile.of(3).deadline_s
    (10.0, 0.05, 2.0, 300.0)
    >>> d = Deadline(arrived=100.0, deadline=100.5, now=lambda: 100.25)
    >>> d.remaining(), d.cap(1.0), d.cap(0.1)
    (0.25, 0.25, 0.1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from goodput_core.errors import DeadlineExceeded

__all__ = ["STAGES", "ClassProfile", "Deadline", "LatencyProfile", "LadderStep", "Slo", "StageBudgets"]

# The stages of a request, in order; the breakdown's `network` is what the engine's own timings do not explain.
STAGES = ("auth_parse", "quota", "cache_lookup", "retrieval", "prompt_assembly", "queue_wait", "network",
          "engine_queue", "prefill", "decode", "post_processing")

LadderStep = Literal["skip_rerank", "fewer_chunks", "exact_cache_only", "fallback_model", "shed"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageBudgets(_Strict):
    """Seconds each stage may take (at the class's p95); the stage runs under min(budget, time left)."""

    auth_parse: float = Field(0.05, gt=0, description="Authentication, parsing and validation.")
    quota: float = Field(0.5, gt=0, description="The tenant's quotas (Redis).")
    cache_lookup: float = Field(0.25, gt=0, description="Response-cache lookup; slower is served uncached.")
    retrieval: float = Field(2.0, gt=0, description="The retrieval hop (embed, dense and lexical legs, fusion, "
                                                    "rerank) of a RAG request.")
    retrieval_leg: float = Field(1.5, gt=0, description="Each retrieval leg, inside retrieval (dense: embed + vector "
                                                        "search; lexical: BM25), run in parallel; a leg over it is "
                                                        "dropped and the search is degraded.")
    rerank: float = Field(0.5, gt=0, description="Rerank, inside retrieval; over it, the fused order stands.")
    prompt_assembly: float = Field(0.05, gt=0, description="Grounding the prompt and estimating its cost.")
    queue_wait: float = Field(30.0, gt=0, description="Waiting in the scheduler's queue for a worker.")
    ttft: float = Field(10.0, gt=0, description="Prefill: worker start to first token.")
    tpot: float = Field(0.25, gt=0, description="Decode: time per output token after the first.")
    post_processing: float = Field(0.05, gt=0, description="Shaping the answer after its last token.")


class Slo(_Strict):
    """What a request of the class must achieve to count as goodput."""

    ttft_s: float = Field(2.0, gt=0, description="Time to first token, from arrival.")
    tpot_s: float = Field(0.1, gt=0, description="Mean time per output token after the first.")


_DEFAULT_LADDER: tuple[LadderStep, ...] = ("skip_rerank", "fewer_chunks", "exact_cache_only", "fallback_model",
                                           "shed")


class ClassProfile(_Strict):
    deadline_s: float = Field(60.0, gt=0, description="Deadline of a request that names none (header or gRPC).")
    budgets: StageBudgets = Field(default_factory=StageBudgets)
    slo: Slo = Field(default_factory=Slo)
    ladder: tuple[LadderStep, ...] = Field(_DEFAULT_LADDER, description="Degradation steps, in the order taken.")
    fallback_model: str = Field("", max_length=256, description="The model the fallback_model step sends the "
                                                                "class to; empty = the step is skipped.")

    def budget(self, stage: str) -> float | None:
        """A stage's budget in seconds; prefill is the TTFT budget; None for a stage without one."""
        if stage == "prefill":
            return self.budgets.ttft
        value = getattr(self.budgets, stage, None)
        return float(value) if isinstance(value, int | float) else None


_DEFAULTS: dict[str, dict[str, Any]] = {
    "P0": {"deadline_s": 60.0, "budgets": {"queue_wait": 5.0, "ttft": 5.0},
           "slo": {"ttft_s": 2.0, "tpot_s": 0.1}},
    "P1": {"deadline_s": 120.0, "budgets": {"queue_wait": 30.0, "ttft": 15.0},
           "slo": {"ttft_s": 10.0, "tpot_s": 0.2}},
    "P2": {"deadline_s": 300.0, "budgets": {"queue_wait": 240.0, "ttft": 60.0, "retrieval": 10.0},
           "slo": {"ttft_s": 60.0, "tpot_s": 0.5}, "ladder": ["skip_rerank", "fewer_chunks", "exact_cache_only",
                                                             "shed"]},
}


class LatencyProfile(_Strict):
    """The profile of each class (``P0``, ``P1``, ``P2``)."""

    P0: ClassProfile = Field(default_factory=ClassProfile)
    P1: ClassProfile = Field(default_factory=ClassProfile)
    P2: ClassProfile = Field(default_factory=ClassProfile)

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, value: Any) -> Any:
        """What is given overrides the defaults field by field (a class given only a deadline keeps its budgets)."""
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, dict):
            return value
        merged: dict[str, Any] = {}
        for name, defaults in _DEFAULTS.items():
            given = value.get(name) or {}
            if isinstance(given, BaseModel):
                given = given.model_dump()
            merged[name] = _merge(defaults, given)
        unknown = set(value) - set(_DEFAULTS)
        for name in unknown:
            merged[name] = value[name]  # refused by extra="forbid", naming it
        return merged

    def of(self, priority: int) -> ClassProfile:
        """The profile of a class (1 = P0 ... 3 = P2; anything else is P1's)."""
        return {1: self.P0, 2: self.P1, 3: self.P2}.get(priority, self.P1)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


@dataclass
class Deadline:
    """A request's deadline on the monotonic clock, and the time left for each stage."""

    arrived: float
    deadline: float
    now: Callable[[], float] = field(default=time.monotonic, repr=False)

    def remaining(self) -> float:
        return self.deadline - self.now()

    def cap(self, budget: float | None) -> float:
        """The time a stage may take: min(its budget, the time left); at least 1 ms (a hop is then cut at once)."""
        left = self.remaining()
        return max(min(budget, left) if budget is not None else left, 0.001)

    def check(self, stage: str) -> None:
        """Refuses to start ``stage`` once the deadline has passed: late work is not started."""
        if self.remaining() <= 0:
            raise DeadlineExceeded(f"the request's deadline passed before {stage.replace('_', ' ')}")
