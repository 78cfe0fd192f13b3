"""Placement as a pipeline of small steps: filters drop workers that cannot take the request, scorers rate the rest
(each in [0, 1], 1 = best; weighted), a picker chooses. New policies are new steps, not changes to the scheduler,
and which steps run with which weights and parameters is a declarative profile (``GOODPUT_SCHEDULER_PROFILE``), as
in llm-d's inference scheduler: typed protocols (:class:`Filter`, :class:`Scorer`, :class:`Picker`,
:class:`Observer`), a per-cycle :class:`CycleState`, and plugin parameters declared by each step and set in the
profile.

* :mod:`.plugins`: the contract (protocols, cycle state, parameters, plugin specs);
* :mod:`.filters`: ``healthy``, ``serves_model``, ``serves_class``, ``has_capacity``, ``prefill_gate``;
* :mod:`.scorers`: ``least_loaded``, ``least_prefill``, ``predicted_finish``, ``prefix_affinity``,
  ``session_affinity``;
* :mod:`.pickers`: ``max_score`` (random among equals), ``round_robin``, ``random``;
* :mod:`.pipeline`: one placement cycle, timed per step;
* :mod:`.profile`: the profile format and :func:`build_pipeline`.

Example:
    >>> from types import SimpleNamespace
    >>> from goodput_scheduler.config import SchedulerSettings
    >>> from goodput_scheduler.registry import Worker
    >>> profile = Profile.parse('{"scorers": [{"name": "least_loaded", "weight": 1}, '
    ...                         '{"name": "session_affinity", "weight": 3}]}')
    >>> pipeline = build_pipeline(profile, SchedulerSettings())
    >>> load = SimpleNamespace(max_num_seqs=8, waiting=0, kv_cache_usage=0.0, stalled_s=0.0)
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True, load=load)
    ...            for i in range(3)]
    >>> request = PlacementRequest("r1", "tenant", 2, "", 100, 10, session_id="chat-42")
    >>> decision = pipeline.place(request, workers)
    >>> pipeline.commit(request, decision)   # stateful scorers (affinity) learn from the decision
    >>> again = pipeline.place(PlacementRequest("r2", "tenant", 2, "", 100, 10, session_id="chat-42"), workers)
    >>> again.worker is decision.worker, again.reason
    (True, 'session_affinity')
"""

from goodput_scheduler.placement.filters import (
    DEFAULT_STEP_TOKENS,
    HasCapacity,
    Healthy,
    PrefillGate,
    ServesClass,
    ServesModel,
    step_budget,
)
from goodput_scheduler.placement.pickers import MaxScore, RandomPick, RoundRobin
from goodput_scheduler.placement.pipeline import STEP_BUCKETS, PlacementPipeline
from goodput_scheduler.placement.plugins import (
    CycleState,
    Decision,
    Filter,
    GuardSignals,
    Observer,
    Picker,
    PlacementRequest,
    PlacementSettings,
    PluginHandle,
    PluginSpec,
    ScoredWorker,
    Scorer,
    StepParameters,
)
from goodput_scheduler.placement.profile import BUILTIN_PLUGINS, DEFAULT_PROFILE, Profile, build_pipeline
from goodput_scheduler.placement.scorers import (
    LeastLoaded,
    LeastPrefill,
    PredictedFinish,
    PrefixAffinity,
    PrefixIndex,
    SessionAffinity,
)

__all__ = [
    "BUILTIN_PLUGINS", "DEFAULT_PROFILE", "DEFAULT_STEP_TOKENS", "STEP_BUCKETS", "CycleState", "Decision", "Filter",
    "GuardSignals", "HasCapacity", "Healthy", "LeastLoaded", "LeastPrefill", "MaxScore", "Observer", "Picker",
    "PlacementPipeline", "PlacementRequest", "PlacementSettings", "PluginHandle", "PluginSpec", "PredictedFinish",
    "PrefillGate", "PrefixAffinity", "PrefixIndex", "Profile", "RandomPick", "RoundRobin", "ScoredWorker", "Scorer",
    "ServesClass", "ServesModel", "SessionAffinity", "StepParameters", "build_pipeline", "step_budget",
]
