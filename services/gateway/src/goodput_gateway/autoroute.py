"""``model: "auto"``: the cheapest model pool predicted to meet the request's SLO.

**Candidates.** Every model in ``AUTO_MODELS`` (empty: every model served) whose prompt and requested output fit its
context window. A model's pools are told apart by ``ModelInfo.pool``; only pools serving the request's class count
(every pool of the model when none does, as the scheduler's ``serves_class`` falls back).

**The predictor** (features: prompt tokens, requested output tokens, class). For each pool, on the worker the
scheduler would pick (its ``predicted_finish`` scorer: the earliest predicted finish among workers with room):

* the worker's speed as the scheduler learned it from its finished leases (``ListWorkers``:
  :class:`goodput_contracts.speed.SpeedEstimate`: prefill per prompt token, time per output token as a line in the
  batch size), applied to the leases it holds and the prompt tokens still prefilling there;
* plus the wait for a worker: the queue waits this gateway measured for the model and class recently (an
  exponentially weighted mean that decays to nothing within ``QUEUE_MEMORY_S`` of silence), and, when every worker
  of the pool is full, the time for one of its leases to end (its predicted service over its batch).

    ttft = queue wait + prefill_s_per_token x (pending + prompt) + tpot(batch + 1)
    tpot = tpot_base + tpot_per_seq x (batch + 1)

The worker list is the gateway's cached ``ListWorkers`` (``MODELS_CACHE_S``, 2 s): a prediction is at most that
stale. What it does not model: the engine's own queue (the scheduler keeps it empty by capping leases at the batch
size), prefix-cache hits (a cached prompt is faster than predicted), and answers that end before ``max_tokens``
(the cost is an upper bound, alike for every candidate). Its error is measured on every auto request
(``goodput_gateway_auto_prediction_ratio{quantity}``: actual / predicted TTFT and TPOT) and in
``python -m loadtests.routing``.

**The choice.** A pool *meets the SLO* when its predicted TTFT and TPOT are within the class's (the latency
profile's ``slo``). Its cost is the request's share of a full batch's engine-seconds at the pool's price:
``cost_per_hour / 3600 x predicted service seconds / lease cap`` (``POOL_COST_PER_HOUR`` of its workers; a pool that
gives none ranks after every priced one). The cheapest pool that meets the SLO wins (ties: the faster); when none
does, the fastest. Quality is not predicted: list in ``AUTO_MODELS`` only models whose answers are acceptable for
the requests sent as auto.

Example:
    >>> from goodput_contracts.speed import SpeedEstimate
    >>> fast = SpeedEstimate(prefill_s_per_token=0.0001, tpot_base_s=0.012, tpot_per_seq_s=0.0003)
    >>> big = PoolView(model="llama-70b", pool="a100x4", cost_per_hour=16.0, max_model_len=8192,
    ...                workers=(WorkerView(inflight=2, lease_cap=64, pending_prefill=0, speed=fast.scaled(3)),))
    >>> small = PoolView(model="llama-8b", pool="l4", cost_per_hour=0.8, max_model_len=8192,
    ...                  workers=(WorkerView(inflight=10, lease_cap=64, pending_prefill=0, speed=fast),))
    >>> choice = choose([big, small], prompt_tokens=300, output_tokens=200, ttft_slo_s=1.0, tpot_slo_s=0.05)
    >>> choice.model, choice.reason, choice.meets_slo
    ('llama-8b', 'cheapest_meeting_slo', True)
    >>> choose([big, small], prompt_tokens=300, output_tokens=200, ttft_slo_s=1.0, tpot_slo_s=0.01).reason
    'none_meets_slo'
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from goodput.scheduler.v1 import scheduler_pb2

from goodput_contracts.speed import Prediction, SpeedEstimate

__all__ = ["AUTO_MODEL", "AutoChoice", "PoolView", "QueueWaits", "WorkerView", "choose", "pools_from"]

AUTO_MODEL = "auto"
QUEUE_MEMORY_S = 30.0  # a measured queue wait fades to nothing over this much silence


@dataclass(frozen=True)
class WorkerView:
    inflight: int
    lease_cap: int
    pending_prefill: int
    speed: SpeedEstimate

    def predict(self, prompt_tokens: int, output_tokens: int) -> Prediction:
        """On this worker now; when it is full, after one of its leases ends."""
        p = self.speed.predict(prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                               batch=min(self.inflight, max(self.lease_cap - 1, 0)),
                               pending_prefill=self.pending_prefill)
        if self.inflight < self.lease_cap:
            return p
        wait = p.total_s / max(self.lease_cap, 1)  # on a full worker a lease ends about this often
        return Prediction(ttft_s=p.ttft_s + wait, tpot_s=p.tpot_s, total_s=p.total_s + wait)


@dataclass(frozen=True)
class PoolView:
    model: str
    pool: str
    cost_per_hour: float
    max_model_len: int
    workers: tuple[WorkerView, ...]

    def best(self, prompt_tokens: int, output_tokens: int) -> tuple[Prediction, WorkerView] | None:
        """The earliest predicted finish among its workers (where the scheduler would place the request)."""
        found = [(w.predict(prompt_tokens, output_tokens), w) for w in self.workers]
        return min(found, key=lambda pw: pw[0].total_s, default=None)


@dataclass(frozen=True)
class AutoChoice:
    model: str
    pool: str
    prediction: Prediction
    cost: float  # price units for this request (inf: the pool gives no price)
    meets_slo: bool
    reason: str  # cheapest_meeting_slo | none_meets_slo

    def header(self) -> str:
        """``X-Goodput-Route``: what auto chose, and what it predicted."""
        return (f"auto; model={self.model}; pool={self.pool}; reason={self.reason}; "
                f"predicted_ttft_ms={self.prediction.ttft_s * 1000:.0f}; "
                f"predicted_tpot_ms={self.prediction.tpot_s * 1000:.1f}")


def pools_from(workers: Iterable[scheduler_pb2.WorkerStatus], *, priority: int,
               models: Sequence[str] = ()) -> list[PoolView]:
    """The placeable workers of ``ListWorkers``, grouped by (model, pool), keeping the pools that serve the class
    (a model none of whose pools serves it keeps them all). ``models`` limits the candidates (empty: every one)."""
    grouped: dict[tuple[str, str], list[scheduler_pb2.WorkerStatus]] = {}
    for w in workers:
        name = w.model.served_model_name
        if not w.healthy or w.draining or not name or (models and name not in models):
            continue
        grouped.setdefault((name, w.model.pool or "default"), []).append(w)
    serving = {key for key, ws in grouped.items()
               if not ws[0].model.pool_classes or priority in ws[0].model.pool_classes}
    served_models = {model for model, _ in serving}
    pools = []
    for (model, pool), ws in sorted(grouped.items()):
        if (model, pool) not in serving and model in served_models:
            continue
        views = tuple(WorkerView(inflight=w.inflight, lease_cap=w.lease_cap or w.load.max_num_seqs or 64,
                                 pending_prefill=w.pending_prefill_tokens,
                                 speed=SpeedEstimate(prefill_s_per_token=w.speed.prefill_s_per_token,
                                                     tpot_base_s=w.speed.tpot_base_s,
                                                     tpot_per_seq_s=w.speed.tpot_per_seq_s,
                                                     samples=w.speed.samples)) for w in ws)
        pools.append(PoolView(model=model, pool=pool, cost_per_hour=max(w.model.cost_per_hour for w in ws),
                              max_model_len=min(w.model.max_model_len for w in ws), workers=views))
    return pools


def choose(pools: Iterable[PoolView], *, prompt_tokens: int, output_tokens: int, ttft_slo_s: float,
           tpot_slo_s: float, queue_wait: Callable[[str], float] = lambda model: 0.0) -> AutoChoice | None:
    """The cheapest pool predicted to meet the SLO, else the fastest; None when no pool can take the request (none
    left, or the prompt and output fit no candidate's window)."""
    options: list[AutoChoice] = []
    for pool in pools:
        if pool.max_model_len and prompt_tokens + output_tokens > pool.max_model_len:
            continue
        found = pool.best(prompt_tokens, output_tokens)
        if found is None:
            continue
        p, worker = found
        wait = queue_wait(pool.model)
        p = Prediction(ttft_s=p.ttft_s + wait, tpot_s=p.tpot_s, total_s=p.total_s + wait)
        service = p.total_s - wait
        cost = pool.cost_per_hour / 3600 * service / max(worker.lease_cap, 1) if pool.cost_per_hour > 0 \
            else math.inf
        meets = p.ttft_s <= ttft_slo_s and p.tpot_s <= tpot_slo_s
        options.append(AutoChoice(model=pool.model, pool=pool.pool, prediction=p, cost=cost, meets_slo=meets,
                                  reason="cheapest_meeting_slo" if meets else "none_meets_slo"))
    meeting = [o for o in options if o.meets_slo]
    if meeting:
        return min(meeting, key=lambda o: (o.cost, o.prediction.total_s))
    return min(options, key=lambda o: o.prediction.total_s, default=None)


class QueueWaits:
    """The queue waits this gateway measured, per (model, class): an exponentially weighted mean that fades to
    nothing over ``memory_s`` of silence (a pool auto stopped choosing because it was queueing is tried again).

    >>> t = [0.0]
    >>> waits = QueueWaits(now=lambda: t[0])
    >>> waits.observe("m", 1, 2.0); round(waits.get("m", 1), 2)
    2.0
    >>> t[0] = 30.0; round(waits.get("m", 1), 2)
    0.74
    """

    def __init__(self, *, alpha: float = 0.3, memory_s: float = QUEUE_MEMORY_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self.memory_s = memory_s
        self._now = now
        self._waits: dict[tuple[str, int], tuple[float, float]] = {}  # -> (mean, when)

    def get(self, model: str, priority: int) -> float:
        mean, when = self._waits.get((model, priority), (0.0, 0.0))
        return mean * math.exp(-(self._now() - when) / self.memory_s)

    def observe(self, model: str, priority: int, wait_s: float) -> None:
        key = (model, priority)
        now = self._now()
        previous = self.get(model, priority) if key in self._waits else wait_s
        self._waits[key] = (previous + self.alpha * (wait_s - previous), now)
        if len(self._waits) > 4096:  # bounded: the oldest go first
            for stale in sorted(self._waits, key=lambda k: self._waits[k][1])[:1024]:
                del self._waits[stale]
