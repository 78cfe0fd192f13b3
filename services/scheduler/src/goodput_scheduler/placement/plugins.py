"""The placement plugin contract, after llm-d's inference scheduler: a :class:`Filter` drops workers that cannot take
the request, a :class:`Scorer` rates the rest (in [0, 1], 1 = best; the profile weights it), a :class:`Picker` chooses
among the scored workers, and an :class:`Observer` learns where a request went. The steps of one placement cycle
share a :class:`CycleState`. Each plugin declares its ``Parameters`` (a pydantic model: names, types, bounds,
defaults), which only the profile sets (one source per parameter: no setting stands in for one); a
:class:`PluginSpec` says how to build the plugin from them and the :class:`PluginHandle`.

Example (a filter of one's own)::

    class SameZone:
        name = "same_zone"

        class Parameters(StepParameters):
            zone: str = ""

        def __init__(self, params: SameZone.Parameters) -> None:
            self.zone = params.zone

        def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
            return [w for w in workers if w.address.startswith(self.zone)]

    spec = PluginSpec("same_zone", "filter", SameZone.Parameters, build=lambda params, handle: SameZone(params))
    build_pipeline(profile, settings, plugins={"same_zone": spec})
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict

from goodput_scheduler.clock import Clock
from goodput_scheduler.registry import Worker

__all__ = ["CycleState", "Decision", "Filter", "GuardSignals", "Observer", "Picker", "PlacementRequest",
           "PlacementSettings", "PluginHandle", "PluginSpec", "ScoredWorker", "Scorer", "StepKind",
           "StepParameters"]

T = TypeVar("T")


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    tenant: str
    priority: int
    model: str
    prompt_tokens: int
    max_tokens: int
    prefix_hint: str = ""
    session_id: str = ""
    tenant_weight: float = 1.0  # the tenant's weight in each bounded class queue's fair share (> 0)
    fixed_output: bool = False  # the answer runs to max_tokens (ignore_eos): its expected output is max_tokens
    slots: int = 1  # sequences it runs (OpenAI's n): the lease slots it holds on its worker and in its tenant's share
    resumable: bool = False  # the gateway can continue its answer on a new lease: preemptible past its first token
    resumed: bool = False  # admitted again to continue an answer its preempted lease began: always queued


class CycleState:
    """What the steps of one placement cycle share: the request, the whole fleet (a filter may need more than the
    survivors so far), and values a step computes once per cycle for later steps or for its observer.

    >>> from goodput_scheduler.placement import PlacementRequest
    >>> state = CycleState(PlacementRequest("r1", "t", 2, "", 10, 10), fleet=[])
    >>> state.write("prefix_affinity", [b"h1", b"h2"])
    >>> state.read("prefix_affinity", list)
    [b'h1', b'h2']
    >>> state.read("missing", list) is None
    True
    """

    __slots__ = ("request", "fleet", "_data")

    def __init__(self, request: PlacementRequest, fleet: Sequence[Worker]) -> None:
        self.request = request
        self.fleet = fleet
        self._data: dict[str, object] = {}

    def write(self, key: str, value: object) -> None:
        self._data[key] = value

    def read(self, key: str, kind: type[T]) -> T | None:
        """The value stored under ``key`` when it is a ``kind``, else None."""
        value = self._data.get(key)
        return value if isinstance(value, kind) else None


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str
    score: float
    state: CycleState | None = field(default=None, compare=False, repr=False)  # the cycle that decided


ScoredWorker = tuple[float, Worker]


class Filter(Protocol):
    """Keeps the workers that can take the request (in their order)."""

    @property
    def name(self) -> str: ...

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]: ...


class Scorer(Protocol):
    """One score per worker, in their order, each in [0, 1] (1 = best), so that a profile weight w is the most the
    step can move a worker's total (a test holds every built-in scorer to it)."""

    @property
    def name(self) -> str: ...

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one of the scored workers (their weighted sum of scores)."""

    @property
    def name(self) -> str: ...

    def pick(self, state: CycleState, scored: Sequence[ScoredWorker]) -> ScoredWorker: ...


@runtime_checkable
class Observer(Protocol):
    """A stateful step (affinity) learns from each decision once the request is granted."""

    def observe(self, state: CycleState, worker: Worker) -> None: ...


class StepParameters(BaseModel):
    """Base of a plugin's parameters: unknown names are refused, values are checked against their bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParameters(StepParameters):
    pass


class GuardSignals(Protocol):
    """What filters read from the latency guard."""

    def current(self) -> float: ...  # P1/P2 leases one worker may hold now

    def p0_reserve(self) -> int: ...  # workers to keep free of P1/P2 prefill for P0 now


class PlacementSettings(Protocol):
    """The scheduler settings placement reads: what it shares with the rest of the scheduler (the per-worker cap, the
    class shares, the queue policy) and the tenancy it must honour (cache sharing groups, the workers' own setting).
    A step's tuning is never here: it is the step's ``Parameters``, set in the profile."""

    max_inflight_per_worker: int
    p1_max_share: float
    p2_max_share: float
    cache_sharing_groups: dict[str, list[str]]

    @property
    def queue_policy(self) -> str: ...


@dataclass(frozen=True)
class PluginHandle:
    """What a plugin may use besides its parameters (llm-d's plugin handle): the settings shared with the rest of
    the scheduler (the per-worker cap, the class shares, the queue policy), the latency guard's live signals, the
    random source, the clock and the metrics registry."""

    settings: PlacementSettings
    rng: random.Random
    clock: Clock
    guard: GuardSignals | None = None
    registry: CollectorRegistry | None = None  # where a plugin's own metrics go (None: it keeps none)


StepKind = Literal["filter", "scorer", "picker"]


@dataclass(frozen=True)
class PluginSpec:
    """How to build one plugin: its kind, its parameters model and the factory."""

    name: str
    kind: StepKind
    parameters: type[StepParameters]
    build: Callable[[Any, PluginHandle], Any]

    def parse_parameters(self, given: Mapping[str, Any]) -> StepParameters:
        """The plugin's parameters: ``given`` (from the profile) over the model's defaults. A bad name or value is a
        ValueError that names the step."""
        try:
            return self.parameters.model_validate(dict(given))
        except ValueError as err:
            raise ValueError(f"bad parameters for {self.kind} {self.name!r}: {err}") from None
