"""Scorers, each giving every candidate a score in [0, 1] (1 = best) so that the profile's weights mean what they say:
a scorer of weight w moves a worker's total by at most w. ``least_loaded`` (leases held, engine queue, KV usage),
``least_prefill`` (prompt prefill pending on the worker), ``predicted_finish`` (the worker where the request is
predicted to finish first, from each worker's learned speed), ``prefix_affinity`` (the worker that recently served the
longest matching prompt prefix of the same tenant, from block hashes in a bounded LRU), ``session_affinity`` (the
worker that served the tenant's conversation).

Affinity never crosses tenants. The workers salt their prefix caches per tenant, so another tenant's cached prompt
would not be reused anyway, and steering a request to the worker that holds it would tell the sender, by where and
how fast it was served, that someone sent that prompt. A prefix is therefore hashed under its tenant's *scope* (the
tenant, or the cache sharing group it is in: the same ``cache_sharing_groups`` the workers are given), and a session
is remembered per tenant.

Example:
    >>> from goodput_scheduler.registry import Worker
    >>> from goodput_scheduler.placement import CycleState, PlacementRequest
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True) for i in range(2)]
    >>> sessions = SessionAffinity()
    >>> state = CycleState(PlacementRequest("r1", "t", 1, "", 10, 10, session_id="chat-42"), workers)
    >>> sessions.score(state, workers)
    [0.0, 0.0]
    >>> sessions.observe(state, workers[1])          # the request went to w1
    >>> sessions.score(state, workers)
    [0.0, 1.0]
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field

from goodput_contracts.sharing import SharingGroups
from goodput_contracts.speed import Prediction

from goodput_scheduler.placement.filters import step_budget
from goodput_scheduler.placement.plugins import CycleState, PlacementRequest, StepParameters
from goodput_scheduler.registry import Worker

__all__ = ["LeastLoaded", "LeastPrefill", "PredictedFinish", "PrefixAffinity", "PrefixIndex", "SessionAffinity",
           "bounded"]


def bounded(cost: float) -> float:
    """A cost (0 = none, growing without bound) as a score in (0, 1]: ``1 / (1 + cost)``, 1 for an idle worker.
    It keeps the order of the costs, does not depend on which other workers are candidates (unlike min-max over
    the cycle, which would make one lease's difference weigh as much as a full worker's), and keeps small costs
    near their own scale (a difference of 0.1 scores about 0.1 apart near idle), so load decides between workers
    about as strongly as it did when these scorers returned the negated cost.

    >>> [round(bounded(c), 3) for c in (0.0, 0.125, 1.0, 3.0, float("inf"))]
    [1.0, 0.889, 0.5, 0.25, 0.0]
    """
    if not cost > 0:  # also NaN: nothing known against the worker
        return 1.0
    return 1.0 / (1.0 + cost)


class LeastLoaded:
    """Fewer leases held (relative to the engine's batch size), a shorter engine queue and a freer KV cache
    score higher: :func:`bounded` of ``inflight / batch + queue_weight x waiting / batch + kv_weight x KV usage``."""

    name = "least_loaded"

    class Parameters(StepParameters):
        kv_weight: float = Field(0.1, ge=0, description="Weight of KV-cache usage (polled: a tie-break).")
        queue_weight: float = Field(0.25, ge=0, description="Weight of the engine's waiting queue (polled).")

    def __init__(self, *, kv_weight: float = 0.1, queue_weight: float = 0.25) -> None:
        self.kv_weight = kv_weight
        self.queue_weight = queue_weight

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]:
        return [bounded(w.inflight / w.capacity + self.queue_weight * w.load.waiting / w.capacity
                        + self.kv_weight * w.load.kv_cache_usage) for w in workers]


class LeastPrefill:
    """Less prompt prefill pending on the worker, in engine steps (:func:`step_budget`), scores higher: a new
    request's first token waits for the prefill ahead of it in the engine: :func:`bounded` of the pending engine
    steps (1 with none pending, 0.5 with one step's worth). (Short P0 prompts weigh little, so P0 requests arriving
    together share the worker kept free of batch prefill.)"""

    name = "least_prefill"

    class Parameters(StepParameters):
        budget_tokens: int = Field(0, ge=0, description="Tokens of one engine step; 0 = what the worker reports.")

    def __init__(self, budget_tokens: int = 0) -> None:
        self.budget_tokens = budget_tokens

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]:
        return [bounded((w.low_prefill_tokens + w.p0_prefill_tokens) / step_budget(w, self.budget_tokens))
                for w in workers]


class PredictedFinish:
    """Speculative load balancing: the worker where the request is predicted to finish first scores highest
    (``fastest / predicted``, 1 for the best). The prediction (:meth:`SpeedEstimate.predict`) uses each worker's own
    learned speed (``Worker.speed``: prefill per token, time per output token as a line in the batch size), the
    leases it holds and the prompt tokens still prefilling there, so a slower GPU, a worker with a long prompt ahead
    or one whose batch slows every step loses requests to a faster one holding as many or more leases. Until a
    worker has finished leases its speed is the prior, the same for all, and this scorer ranks by load alone.

    >>> from goodput_contracts.speed import SpeedEstimate
    >>> from goodput_scheduler.predict import WorkerSpeed
    >>> from goodput_scheduler.registry import Worker
    >>> from goodput_scheduler.placement import CycleState, PlacementRequest
    >>> fast = SpeedEstimate(prefill_s_per_token=0.0001, tpot_base_s=0.012, tpot_per_seq_s=0.0003)
    >>> workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True) for i in range(2)]
    >>> workers[0].speed, workers[1].speed = WorkerSpeed(fast.scaled(3.0)), WorkerSpeed(fast)  # as if learned
    >>> for _ in range(4): _ = workers[1].occupancy.hold(3, prompt_tokens=0)     # w1 is busier, but 3x faster
    >>> [round(s, 2) for s in PredictedFinish().score(CycleState(PlacementRequest("r", "t", 3, "", 200, 100),
    ...                                                           workers), workers)]
    [0.37, 1.0]
    """

    name = "predicted_finish"

    class Parameters(StepParameters):
        default_output_tokens: int = Field(128, ge=1, description="Output tokens assumed for a request that sets "
                                                                  "no max_tokens.")

    def __init__(self, *, default_output_tokens: int = 128) -> None:
        self.default_output_tokens = default_output_tokens

    def predict(self, req: PlacementRequest, w: Worker) -> Prediction:
        return w.speed.estimate().predict(
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens or self.default_output_tokens,
            batch=w.inflight, pending_prefill=w.p0_prefill_tokens + w.low_prefill_tokens)

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]:
        finish = [max(self.predict(state.request, w).total_s, 0.0) for w in workers]
        best = min(finish, default=0.0)
        return [best / f if f > best else 1.0 for f in finish]  # in [0, 1]: f > best >= 0


class PrefixIndex:
    """Which workers recently served which prompt prefixes, with bounded memory.

    A prefix is cut into blocks of ``block_chars`` characters; block *i*'s hash covers blocks 0..i (a chain), so one
    hash names a whole prefix. The chain starts from the ``scope`` (a tenant, or its sharing group): the same text
    of two scopes gives unrelated hashes, so one scope's prompts never match another's. The index maps hash ->
    workers that saw it, as an LRU of at most ``max_entries`` hashes (no trie, no unbounded growth); the longest
    match for a worker is the last block of the chain it holds. Each hash remembers its ``workers_per_entry`` most
    recent workers.

    >>> idx = PrefixIndex(block_chars=4, max_entries=8)
    >>> idx.record(idx.hashes("abcdefgh", scope="tenant:acme"), "w1")
    >>> idx.match(idx.hashes("abcdefXY", scope="tenant:acme"))
    {'w1': 1}
    >>> idx.match(idx.hashes("abcdefgh", scope="tenant:globex"))
    {}
    """

    def __init__(self, *, block_chars: int = 128, max_entries: int = 65536, workers_per_entry: int = 4) -> None:
        self.block_chars = block_chars
        self.max_entries = max_entries
        self.workers_per_entry = workers_per_entry
        self._lru: collections.OrderedDict[bytes, dict[str, int]] = collections.OrderedDict()
        self._recency = itertools.count()  # orders the records: which worker saw a hash last

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self, text: str, *, scope: str = "") -> list[bytes]:
        out: list[bytes] = []
        prev = hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=8).digest() if scope else b""
        for i in range(0, len(text) - self.block_chars + 1, self.block_chars):
            prev = hashlib.blake2b(prev + text[i:i + self.block_chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
            out.append(prev)
        return out

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Worker id -> blocks of the longest prefix it recently served."""
        best: dict[str, int] = {}
        for i, h in enumerate(hashes):
            entry = self._lru.get(h)
            if entry is None:
                break  # a chain: no later block can match if this one does not
            for worker_id in entry:
                best[worker_id] = i + 1
        return best

    def record(self, hashes: Sequence[bytes], worker_id: str) -> None:
        seen = next(self._recency)
        for h in hashes:
            entry = self._lru.get(h)
            if entry is None:
                entry = self._lru[h] = {}
            else:
                self._lru.move_to_end(h)
            entry[worker_id] = seen
            if len(entry) > self.workers_per_entry:
                del entry[min(entry, key=entry.__getitem__)]
        while len(self._lru) > self.max_entries:
            self._lru.popitem(last=False)


@dataclass(slots=True)
class _PrefixMatch:
    """One cycle's prefix hashes and the workers that served them (hashed once per cycle, not per worker)."""

    hashes: list[bytes]
    matches: dict[str, int]


class PrefixAffinity:
    """The fraction of the request's prefix blocks the worker recently served to the same tenant (or sharing
    group) (0 to 1), among workers whose load is within ``balance_slack`` (a share of the per-worker cap) of the
    least loaded candidate. A worker further ahead scores 0, so a hot prefix cannot pile onto one worker while others
    idle (the cache-aware policy of SGLang's router works the same way): affinity decides while load is balanced,
    load decides when it is not."""

    name = "prefix_affinity"

    class Parameters(StepParameters):
        block_chars: int = Field(128, ge=8, description="Characters per hashed block.")
        index_entries: int = Field(65536, ge=16, description="Block hashes remembered (LRU).")
        balance_slack: float = Field(0.1, ge=0, le=1, description="Counts only on workers holding at most this share "
                                     "of the cap more leases than the least loaded one (higher: more cache hits, less "
                                     "even load).")

    def __init__(self, index: PrefixIndex, *, max_inflight: int = 0, balance_slack: float = 0.1,
                 scopes: SharingGroups | None = None) -> None:
        self.index = index
        self.max_inflight = max_inflight
        self.balance_slack = balance_slack
        self.scopes = scopes or SharingGroups()

    def _match(self, state: CycleState) -> _PrefixMatch:
        found = state.read(self.name, _PrefixMatch)
        if found is None:
            hashes = self.index.hashes(state.request.prefix_hint, scope=self.scopes.scope(state.request.tenant))
            found = _PrefixMatch(hashes, self.index.match(hashes))
            state.write(self.name, found)
        return found

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]:
        if not state.request.prefix_hint:
            return [0.0] * len(workers)
        m = self._match(state)
        if not m.hashes:
            return [0.0] * len(workers)
        least = min((w.inflight for w in workers), default=0)
        return [0.0 if w.inflight - least > self._slack(w) else m.matches.get(w.worker_id, 0) / len(m.hashes)
                for w in workers]

    def _slack(self, w: Worker) -> float:
        return max(self.balance_slack * w.lease_cap(self.max_inflight), 1.0)

    def observe(self, state: CycleState, worker: Worker) -> None:
        if state.request.prefix_hint:
            self.index.record(self._match(state).hashes, worker.worker_id)


class SessionAffinity:
    """1 for the worker that last served the request's session (its KV cache likely holds the conversation), else
    0. Sessions are kept in a bounded LRU, per tenant: a session id is the client's choice, so another tenant's
    request with the same id is another conversation."""

    name = "session_affinity"

    class Parameters(StepParameters):
        index_entries: int = Field(65536, ge=16, description="Sessions remembered (LRU).")

    def __init__(self, *, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._lru: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def score(self, state: CycleState, workers: Sequence[Worker]) -> list[float]:
        session = (state.request.tenant, state.request.session_id)
        last = self._lru.get(session) if state.request.session_id else None
        return [1.0 if last is not None and last == w.worker_id else 0.0 for w in workers]

    def observe(self, state: CycleState, worker: Worker) -> None:
        session = (state.request.tenant, state.request.session_id)
        if state.request.session_id:
            self._lru[session] = worker.worker_id
            self._lru.move_to_end(session)
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)
