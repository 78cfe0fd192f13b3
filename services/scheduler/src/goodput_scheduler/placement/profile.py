"""The declarative placement profile (``GOODPUT_SCHEDULER_PROFILE``: JSON, or the path of a JSON/YAML file) and
the pipeline it describes.

A step is a name, or an object with the name and the step's ``parameters`` (a scorer also has a ``weight``)::

    {"filters": ["healthy", "serves_model", "serves_class", "has_capacity",
                 {"name": "prefill_gate", "parameters": {"budget_tokens": 1024}}],
     "scorers": [{"name": "least_loaded", "weight": 1.0, "parameters": {"kv_weight": 0.2}},
                 {"name": "prefix_affinity", "weight": 2.0, "parameters": {"block_chars": 64}}],
     "picker": "max_score"}

The profile is the one source of a step's parameters: one it leaves out takes the step's own default (its
``Parameters`` model), never a setting. What placement shares with the rest of the scheduler comes from the settings
through the plugin handle: the per-worker cap (``MAX_INFLIGHT_PER_WORKER``), the class shares (``P1_MAX_SHARE``,
``P2_MAX_SHARE``), the queue policy, and the tenants' cache sharing groups (``CACHE_SHARING_GROUPS``, the workers'
own setting, which a profile cannot contradict). Unknown steps, unknown parameters and values out of bounds are
refused when the profile is read, naming the step.

Example:
    >>> profile = Profile.parse('{"scorers": [{"name": "least_loaded", "weight": 1}, '
    ...                         '{"name": "prefix_affinity", "weight": 2, "parameters": {"block_chars": 64}}]}')
    >>> profile.filters                 # left out: the default filters
    ('healthy', 'serves_model', 'serves_class', 'has_capacity', 'prefill_gate')
    >>> profile.scorers, profile.picker, profile.parameters
    ((('least_loaded', 1.0), ('prefix_affinity', 2.0)), 'max_score', {'prefix_affinity': {'block_chars': 64}})
    >>> Profile.parse('{"scorers": [{"name": "prefix_affinity", "parameters": {"block_size": 64}}]}')
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: bad parameters for scorer 'prefix_affinity': ...
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter

from goodput_contracts.sharing import SharingGroups
from goodput_core.priority import priority_name

from goodput_scheduler.clock import Clock, SystemClock
from goodput_scheduler.placement.filters import HasCapacity, Healthy, PrefillGate, ServesClass, ServesModel
from goodput_scheduler.placement.pickers import MaxScore, RandomPick, RoundRobin
from goodput_scheduler.placement.pipeline import PlacementPipeline
from goodput_scheduler.placement.plugins import (
    Filter,
    GuardSignals,
    NoParameters,
    Picker,
    PlacementSettings,
    PluginHandle,
    PluginSpec,
    Scorer,
    StepKind,
)
from goodput_scheduler.placement.scorers import (
    LeastLoaded,
    LeastPrefill,
    PredictedFinish,
    PrefixAffinity,
    PrefixIndex,
    SessionAffinity,
)
from goodput_scheduler.queues import P1, P2, QUEUE_POLICIES

__all__ = ["BUILTIN_PLUGINS", "DEFAULT_PROFILE", "Profile", "build_pipeline"]


def _has_capacity(p: HasCapacity.Parameters, h: PluginHandle) -> HasCapacity:
    s = h.settings  # the cap and the class shares are the scheduler's (the latency guard and overload read them too)
    return HasCapacity(max_inflight=s.max_inflight_per_worker, kv_full=p.kv_full,
                       shares={P1: s.p1_max_share, P2: s.p2_max_share},
                       low_limit=h.guard.current if h.guard is not None else None)


def _prefill_gate(p: PrefillGate.Parameters, h: PluginHandle) -> PrefillGate:
    return PrefillGate(p.budget_tokens, enabled=p.enabled and QUEUE_POLICIES[h.settings.queue_policy].gates_classes,
                       p0_exclusive=p.p0_exclusive, p0_reserve=h.guard.p0_reserve if h.guard is not None else None)


def _serves_class(p: NoParameters, h: PluginHandle) -> ServesClass:
    if h.registry is None:
        return ServesClass()
    fallbacks = Counter("goodput_scheduler_pool_fallback_total", "Grants to a worker whose model pool does not "
                        "serve the request's class, because no healthy worker's pool did.", ["priority"],
                        registry=h.registry)
    return ServesClass(on_fallback=lambda priority: fallbacks.labels(priority_name(priority)).inc())


def _prefix_affinity(p: PrefixAffinity.Parameters, h: PluginHandle) -> PrefixAffinity:
    return PrefixAffinity(PrefixIndex(block_chars=p.block_chars, max_entries=p.index_entries),
                          max_inflight=h.settings.max_inflight_per_worker, balance_slack=p.balance_slack,
                          scopes=SharingGroups(h.settings.cache_sharing_groups))


BUILTIN_PLUGINS: Mapping[str, PluginSpec] = {spec.name: spec for spec in (
    PluginSpec("healthy", "filter", NoParameters, build=lambda p, h: Healthy()),
    PluginSpec("serves_model", "filter", NoParameters, build=lambda p, h: ServesModel()),
    PluginSpec("serves_class", "filter", NoParameters, build=_serves_class),
    PluginSpec("has_capacity", "filter", HasCapacity.Parameters, build=_has_capacity),
    PluginSpec("prefill_gate", "filter", PrefillGate.Parameters, build=_prefill_gate),
    PluginSpec("least_loaded", "scorer", LeastLoaded.Parameters,
               build=lambda p, h: LeastLoaded(kv_weight=p.kv_weight, queue_weight=p.queue_weight)),
    PluginSpec("predicted_finish", "scorer", PredictedFinish.Parameters,
               build=lambda p, h: PredictedFinish(default_output_tokens=p.default_output_tokens)),
    PluginSpec("least_prefill", "scorer", LeastPrefill.Parameters, build=lambda p, h: LeastPrefill(p.budget_tokens)),
    PluginSpec("prefix_affinity", "scorer", PrefixAffinity.Parameters, build=_prefix_affinity),
    PluginSpec("session_affinity", "scorer", SessionAffinity.Parameters,
               build=lambda p, h: SessionAffinity(max_entries=p.index_entries)),
    PluginSpec("max_score", "picker", NoParameters, build=lambda p, h: MaxScore(h.rng)),
    PluginSpec("round_robin", "picker", NoParameters, build=lambda p, h: RoundRobin()),
    PluginSpec("random", "picker", NoParameters, build=lambda p, h: RandomPick(h.rng)),
)}

DEFAULT_PROFILE: dict[str, Any] = {
    "filters": ["healthy", "serves_model", "serves_class", "has_capacity", "prefill_gate"],
    # scores in [0,1], weight = most a step moves a total: session (3) > full prefix match (2) > each load signal (1)
    "scorers": [{"name": "least_loaded", "weight": 1.0},
                {"name": "least_prefill", "weight": 1.0},
                {"name": "predicted_finish", "weight": 1.0},
                {"name": "prefix_affinity", "weight": 2.0},
                {"name": "session_affinity", "weight": 3.0}],
    "picker": "max_score",
}


def _step(entry: object, kind: StepKind) -> tuple[str, float, dict[str, Any] | None]:
    """(name, weight, parameters or None) of one profile entry: a name, or {"name", "weight", "parameters"}."""
    if isinstance(entry, str):
        return entry, 1.0, None
    if isinstance(entry, dict) and "name" in entry:
        params = entry.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"the parameters of {kind} {entry['name']!r} are an object")
        return str(entry["name"]), float(entry.get("weight", 1.0)), params
    shape = "{'name': ..., 'weight': ..., 'parameters': {...}}" if kind == "scorer" else \
        "a name or {'name': ..., 'parameters': {...}}"
    raise ValueError(f"bad {kind} entry {entry!r}: use {shape}")


@dataclass(frozen=True)
class Profile:
    """Which steps run, with which weights and parameters (``parameters`` by step name; a step listed twice has
    the same parameters both times)."""

    filters: tuple[str, ...] = tuple(DEFAULT_PROFILE["filters"])
    scorers: tuple[tuple[str, float], ...] = tuple((s["name"], s["weight"]) for s in DEFAULT_PROFILE["scorers"])
    picker: str = "max_score"
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Profile:
        """From settings: empty = default, JSON text, or the path of a .json/.yaml file."""
        text = text.strip()
        if not text:
            return cls.from_dict(DEFAULT_PROFILE)
        if not text.startswith("{"):
            path = Path(text)
            raw = path.read_text(encoding="utf-8")
            if path.suffix in (".yaml", ".yml"):
                import yaml  # lazy: only YAML profiles need it

                return cls.from_dict(yaml.safe_load(raw))
            text = raw
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, doc: Any) -> Profile:
        if not isinstance(doc, dict):
            raise ValueError("a placement profile is a JSON object")
        parameters: dict[str, dict[str, Any]] = {}

        def step(entry: object, kind: StepKind) -> tuple[str, float]:
            """(name, weight) of one entry; its parameters are kept by step name, the same wherever it is listed."""
            name, weight, params = _step(entry, kind)
            if params is not None and parameters.setdefault(name, dict(params)) != params:
                raise ValueError(f"{kind} {name!r} is listed twice with different parameters")
            return name, weight

        filters = tuple(step(entry, "filter")[0] for entry in doc.get("filters", DEFAULT_PROFILE["filters"]))
        scorers = tuple(step(entry, "scorer") for entry in doc.get("scorers", DEFAULT_PROFILE["scorers"]))
        picker, _ = step(doc.get("picker", "max_score"), "picker")
        profile = cls(filters=filters, scorers=scorers, picker=picker, parameters=parameters)
        profile.validate()
        return profile

    def validate(self, plugins: Mapping[str, PluginSpec] = BUILTIN_PLUGINS) -> None:
        def spec(name: str, kind: StepKind) -> PluginSpec:
            found = plugins.get(name)
            if found is None or found.kind != kind:
                known = sorted(n for n, s in plugins.items() if s.kind == kind)
                raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}")
            return found

        for f in self.filters:
            spec(f, "filter").parse_parameters(self.parameters.get(f, {}))
        for name, weight in self.scorers:
            spec(name, "scorer").parse_parameters(self.parameters.get(name, {}))
            if weight < 0:
                raise ValueError(f"scorer {name!r} has a negative weight")
        spec(self.picker, "picker").parse_parameters(self.parameters.get(self.picker, {}))


def build_pipeline(profile: Profile, settings: PlacementSettings, *, registry: CollectorRegistry | None = None,
                   rng: random.Random | None = None, guard: GuardSignals | None = None, clock: Clock | None = None,
                   plugins: Mapping[str, PluginSpec] | None = None) -> PlacementPipeline:
    """The pipeline a profile describes. ``guard`` (the latency guard) gives the P1/P2 limit per worker and whether
    P0 traffic is present; ``plugins`` adds steps of one's own to the built-in ones (:data:`BUILTIN_PLUGINS`)."""
    specs = {**BUILTIN_PLUGINS, **(plugins or {})}
    profile.validate(specs)
    rng = rng or random.Random()
    handle = PluginHandle(settings=settings, rng=rng, clock=clock or SystemClock(), guard=guard, registry=registry)

    def build(name: str) -> Any:
        spec = specs[name]
        return spec.build(spec.parse_parameters(profile.parameters.get(name, {})), handle)

    return PlacementPipeline(
        filters=[cast(Filter, build(name)) for name in profile.filters],
        scorers=[(weight, cast(Scorer, build(name))) for name, weight in profile.scorers],
        picker=cast(Picker, build(profile.picker)), registry=registry, rng=rng)
