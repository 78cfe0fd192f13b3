"""Filters: ``healthy``, ``serves_model``, ``serves_class`` (a worker's model pool serves the request's priority
class), ``has_capacity`` (the per-worker cap, less the headroom kept for more
urgent classes, and a KV cache that is not full), ``prefill_gate`` (P1/P2 prompts enter an engine a bounded number of
tokens at a time, and not while it prefills a P0 prompt; P0 prompts go to a worker free of batch prefill when there
is one).

Example:
    >>> from goodput_scheduler.registry import Worker
    >>> from goodput_scheduler.placement import CycleState, PlacementRequest
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True) for i in range(2)]
    >>> _ = workers[0].occupancy.hold(1, prompt_tokens=10)      # w0 holds one P0 lease
    >>> cap = HasCapacity(max_inflight=1)
    >>> req = PlacementRequest("r1", "t", 1, "", 10, 10)
    >>> [w.worker_id for w in cap.filter(CycleState(req, workers), workers)]
    ['w1']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import Field

from goodput_scheduler.placement.plugins import CycleState, PlacementRequest, StepParameters
from goodput_scheduler.queues import P0, P1, P2
from goodput_scheduler.registry import Worker

__all__ = ["DEFAULT_STEP_TOKENS", "HasCapacity", "Healthy", "PrefillGate", "ServesClass", "ServesModel", "step_budget"]

DEFAULT_STEP_TOKENS = 2048  # vLLM's max_num_batched_tokens for online serving, when a worker does not say
_MORE_URGENT = {P1: (P0,), P2: (P0, P1)}


def step_budget(w: Worker, budget_tokens: int = 0) -> int:
    """``budget_tokens`` when set, else the worker's own per-step token budget (what its engine reports)."""
    if budget_tokens > 0:
        return budget_tokens
    reported = w.model.max_num_batched_tokens if w.model is not None else 0
    return reported if reported > 0 else DEFAULT_STEP_TOKENS


class Healthy:
    """Workers that pass their health checks, are still registered and are not draining (a terminating endpoint)."""

    name = "healthy"

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
        return [w for w in workers if w.placeable]


class ServesModel:
    """Workers serving the requested model, by its served name or one of its aliases (any worker, when the request
    names none or the worker has not said)."""

    name = "serves_model"

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
        model = state.request.model
        return [w for w in workers if not model or w.model is None or w.model.served_model_name == model
                or model in w.model.aliases]


def pool_serves(w: Worker, priority: int) -> bool:
    """Whether the worker's pool serves the class: it lists the class, lists none (every class), or has not said."""
    return w.model is None or not w.model.pool_classes or priority in w.model.pool_classes


class ServesClass:
    """Workers whose model pool serves the request's priority class (``ModelInfo.pool_classes``; a pool that lists
    none serves every class). When none of the workers left serves it — its pool is down, or no pool was given the
    class — the request falls back to every pool rather than wait for one that may never come, and the grant counts
    in ``goodput_scheduler_pool_fallback_total{priority}`` (``on_fallback``). A serving pool that is only full does
    not fall back: ``has_capacity`` runs after this filter, so the request waits in its queue for that pool.

    >>> from goodput.inference.v1 import inference_pb2
    >>> from goodput_scheduler.placement import CycleState, PlacementRequest
    >>> def worker(name: str, *classes: int) -> Worker:
    ...     info = inference_pb2.ModelInfo(pool=name, pool_classes=classes)
    ...     return Worker(worker_id=name, address=name, channel=None, healthy=True, model=info)
    >>> fleet = [worker("interactive", 1, 2), worker("batch", 3)]   # P0/P1, P2
    >>> f = ServesClass()
    >>> p0 = PlacementRequest("r1", "t", 1, "", 10, 10)
    >>> [w.worker_id for w in f.filter(CycleState(p0, fleet), fleet)]
    ['interactive']
    >>> state = CycleState(p0, fleet[1:])                  # the interactive pool is down: any pool serves P0
    >>> [w.worker_id for w in f.filter(state, fleet[1:])], state.read(FALLBACK_KEY, bool)
    (['batch'], True)
    """

    name = "serves_class"

    def __init__(self, *, on_fallback: Callable[[int], None] | None = None) -> None:
        self.on_fallback = on_fallback

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
        priority = state.request.priority
        kept = [w for w in workers if pool_serves(w, priority)]
        if kept or not workers:
            return kept
        state.write(FALLBACK_KEY, True)
        return list(workers)

    def observe(self, state: CycleState, worker: Worker) -> None:
        """Counts a grant that fell back to a pool not serving its class (once per grant, not per cycle)."""
        if self.on_fallback is not None and state.read(FALLBACK_KEY, bool):
            self.on_fallback(state.request.priority)


FALLBACK_KEY = "serves_class.fallback"


class HasCapacity:
    """Room for one more lease of ``n`` sequences: at most ``cap * share`` slots held with it, where ``cap`` is the
    worker's lease cap (``max_inflight`` when set, else the batch size its engine reports: :meth:`Worker.lease_cap`),
    ``share`` (from ``shares`` by priority, 1.0 when absent) keeps headroom for more urgent classes, fewer P1/P2
    leases than ``low_limit()`` (the latency guard's current limit), and a KV cache below ``kv_full``. Leases are
    counted by the scheduler itself, so they are never stale. On a worker whose model pool serves no more urgent class
    than the request's, no headroom is kept, and the guard (which protects P0) applies only where the pool serves
    P0."""

    name = "has_capacity"

    class Parameters(StepParameters):
        kv_full: float = Field(0.97, gt=0, le=1, description="KV-cache usage from which a worker takes no grant.")

    def __init__(self, *, max_inflight: int = 0, shares: dict[int, float] | None = None, kv_full: float = 1.0,
                 low_limit: Callable[[], float] | None = None) -> None:
        self.max_inflight = max_inflight
        self.shares = dict(shares or {})
        self.kv_full = kv_full
        self.low_limit = low_limit

    def admits(self, req: PlacementRequest, w: Worker) -> bool:
        # headroom is kept, and the guard applies, only where more urgent work can come: a worker whose model pool
        # serves no more urgent class (a batch pool) gives P2 every slot
        urgent = any(pool_serves(w, c) for c in _MORE_URGENT.get(req.priority, ()))
        limit = w.lease_cap(self.max_inflight) * (self.shares.get(req.priority, 1.0) if urgent else 1.0)
        # a request of n sequences needs n slots free; one larger than the whole limit runs alone on an empty worker
        if w.inflight + (req.slots - 1 if w.inflight else 0) >= max(limit, 1.0) \
                or (w.inflight > 0 and w.load.kv_cache_usage >= self.kv_full):
            return False
        return (self.low_limit is None or req.priority == P0 or not pool_serves(w, P0)
                or w.low_inflight < self.low_limit())

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
        return [w for w in workers if self.admits(state.request, w)]


class PrefillGate:
    """P1/P2: no grant to a worker that is prefilling a P0 prompt (``p0_exclusive``), nor one whose pending
    P1/P2 prefill (granted leases without a first token) would exceed the budget (:func:`step_budget`) — one
    request always may — and none that would leave fewer than ``p0_reserve()`` healthy workers free of P1/P2
    prefill (never all of them; the reserve is 0 without recent P0 traffic). vLLM schedules the chunks of prompts
    it already holds before a newly arrived one, whatever its priority, so a P0 prompt otherwise waits behind every
    batch prompt granted before it; a worker that is only decoding starts it at its next step. P0 (while there is a
    reserve): only workers free of P1/P2 prefill when one of the candidates is."""

    name = "prefill_gate"

    class Parameters(StepParameters):
        enabled: bool = Field(True, description="Off: only the lease caps gate grants.")
        budget_tokens: int = Field(0, ge=0, description="P1/P2 prompt tokens a worker may be prefilling at once; "
                                                        "0 = the worker's own per-step budget.")
        p0_exclusive: bool = Field(True, description="No P1/P2 grant while a P0 prompt is prefilled there.")

    def __init__(self, budget_tokens: int = 0, *, enabled: bool = True, p0_exclusive: bool = True,
                 p0_reserve: Callable[[], int] | None = None) -> None:
        self.budget_tokens = budget_tokens
        self.enabled = enabled
        self.p0_exclusive = p0_exclusive
        self.p0_reserve = p0_reserve

    def filter(self, state: CycleState, workers: Sequence[Worker]) -> list[Worker]:
        if not self.enabled:
            return list(workers)
        req = state.request
        reserve = self.p0_reserve() if self.p0_reserve is not None else 0
        if req.priority == P0:
            # a P0 prompt granted to a worker with batch prompts still prefilling waits for their chunks (several
            # steps); one that is only decoding starts it at its next step, so P0 goes there when one can take it
            if reserve > 0 and any(w.low_prefill_tokens == 0 for w in workers):
                return [w for w in workers if w.low_prefill_tokens == 0]
            return list(workers)
        spare = len(state.fleet)  # workers free of P1/P2 prefill beyond the reserve (no reserve: all of them)
        if reserve > 0:  # the reserve is kept among the workers whose pool serves P0
            up = [w for w in state.fleet if w.placeable and pool_serves(w, P0)]
            ready = sum(1 for w in up if w.low_prefill_tokens == 0)
            spare = ready - min(reserve, max(len(up) - 1, 0))
        return [w for w in workers if self._admits_low(req, w, spare)]

    def _admits_low(self, req: PlacementRequest, w: Worker, spare: int) -> bool:
        if self.p0_exclusive and w.p0_prefilling > 0:
            return False
        if w.low_prefill_tokens > 0:
            return w.low_prefill_tokens + req.prompt_tokens <= step_budget(w, self.budget_tokens)
        # starting a batch prefill here must leave the reserve of ready workers (a pool without P0 holds none of it)
        return spare > 0 or not pool_serves(w, P0)
