"""Placement as a pipeline of small steps: filters drop workers that cannot take the request, scorers rate the rest
(higher is better, weighted), a picker chooses. New policies are new steps, not changes to the scheduler, and which
steps run with which weights is a declarative profile (``GOODPUT_SCHEDULER_PROFILE``), as in llm-d's inference
scheduler.

Steps shipped here:

* filters: ``healthy``, ``serves_model``, ``has_capacity`` (the per-worker cap, less the headroom kept for more
  urgent classes, and a KV cache that is not full), ``prefill_gate`` (P1/P2 prompts enter an engine a bounded
  number of tokens at a time, and not while it prefills a P0 prompt; P0 prompts go to a worker free of batch
  prefill when there is one);
* scorers: ``least_loaded`` (leases held, engine queue, KV usage), ``least_prefill`` (prompt prefill pending on
  the worker), ``prefix_affinity`` (the worker that recently
  served the longest matching prompt prefix, from block hashes in a bounded LRU), ``session_affinity``;
* pickers: ``max_score`` (random among equals), ``round_robin``, ``random``.

Example:
    >>> profile = Profile.parse('{"scorers": [{"name": "least_loaded", "weight": 1}, '
    ...                         '{"name": "prefix_affinity", "weight": 2}]}')
    >>> pipeline = build_pipeline(profile, settings, registry=CollectorRegistry())
    >>> decision = pipeline.place(request, registry.all())
    >>> pipeline.commit(request, decision)   # stateful scorers (affinity) learn from the decision
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry, Histogram

from goodput_scheduler.registry import Worker

__all__ = [
    "Decision", "PlacementPipeline", "PlacementRequest", "PrefixAffinity", "PrefixIndex", "Profile",
    "SessionAffinity", "build_pipeline", "has_capacity", "healthy", "least_loaded", "least_prefill", "PrefillGate",
    "serves_model",
]

_P0 = int(types_pb2.PRIORITY_P0)
STEP_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


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


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str
    score: float


Filter = Callable[[PlacementRequest, Worker], bool]
Scorer = Callable[[PlacementRequest, Worker], float]


class Picker(Protocol):
    def __call__(self, scored: Sequence[tuple[float, Worker]]) -> tuple[float, Worker]: ...


# ---- filters -------------------------------------------------------------------------------------------------


def healthy(_: PlacementRequest, w: Worker) -> bool:
    return w.healthy and not w.removed


def serves_model(req: PlacementRequest, w: Worker) -> bool:
    return not req.model or w.model is None or w.model.served_model_name == req.model


def has_capacity(max_inflight: int, *, shares: dict[int, float] | None = None, kv_full: float = 1.0,
                 low_limit: Callable[[], float] | None = None) -> Filter:
    """Room for one more lease: fewer than ``max_inflight * share`` leases held, where ``share`` (from
    ``shares`` by priority, 1.0 when absent) keeps headroom for more urgent classes, fewer P1/P2 leases than
    ``low_limit()`` (the latency guard's current limit), and a KV cache below ``kv_full``. Leases are counted by the
    scheduler itself, so they are never stale."""
    shares = dict(shares or {})

    def _filter(req: PlacementRequest, w: Worker) -> bool:
        limit = max_inflight * shares.get(req.priority, 1.0)
        if w.inflight >= max(limit, 1.0) or (w.inflight > 0 and w.load.kv_cache_usage >= kv_full):
            return False
        return low_limit is None or req.priority == _P0 or w.low_inflight < low_limit()
    _filter.__name__ = "has_capacity"
    return _filter


DEFAULT_STEP_TOKENS = 2048  # vLLM's max_num_batched_tokens for online serving, when a worker does not say


def step_budget(w: Worker, budget_tokens: int = 0) -> int:
    """``budget_tokens`` when set, else the worker's own per-step token budget (what its engine reports)."""
    if budget_tokens > 0:
        return budget_tokens
    reported = w.model.max_num_batched_tokens if w.model is not None else 0
    return reported if reported > 0 else DEFAULT_STEP_TOKENS


class PrefillGate:
    """P1/P2: no grant to a worker that is prefilling a P0 prompt (``p0_exclusive``), nor one whose pending
    P1/P2 prefill (granted leases without a first token) would exceed the budget (:func:`step_budget`) — one
    request always may — and none that would leave fewer than ``p0_reserve()`` healthy workers free of P1/P2
    prefill (never all of them; the reserve is 0 without recent P0 traffic). vLLM schedules the chunks of prompts
    it already holds before a newly arrived one, whatever its priority, so a P0 prompt otherwise waits behind every
    batch prompt granted before it; a worker that is only decoding starts it at its next step. P0 (while there is a
    reserve): only workers free of P1/P2 prefill when one of the candidates is."""

    __name__ = "prefill_gate"

    def __init__(self, budget_tokens: int = 0, *, enabled: bool = True, p0_exclusive: bool = True,
                 p0_reserve: Callable[[], int] | None = None) -> None:
        self.budget_tokens = budget_tokens
        self.enabled = enabled
        self.p0_exclusive = p0_exclusive
        self.p0_reserve = p0_reserve
        self._spare = 0  # workers free of P1/P2 prefill beyond the reserve, for the request being placed
        self._p0_ready = False  # a candidate free of P1/P2 prefill exists, for the P0 request being placed

    def prepare(self, req: PlacementRequest, workers: Sequence[Worker], candidates: Sequence[Worker] = ()) -> None:
        self._spare = len(workers)  # no reserve
        self._p0_ready = False
        reserve = self.p0_reserve() if self.enabled and self.p0_reserve is not None else 0
        if reserve <= 0:
            return
        if req.priority == _P0:
            # a P0 prompt granted to a worker with batch prompts still prefilling waits for their chunks (several
            # steps); one that is only decoding starts it at its next step, so P0 goes there when one can take it
            self._p0_ready = any(w.low_prefill_tokens == 0 for w in candidates)
            return
        up = [w for w in workers if w.healthy and not w.removed]
        ready = sum(1 for w in up if w.low_prefill_tokens == 0)
        self._spare = ready - min(reserve, max(len(up) - 1, 0))

    def __call__(self, req: PlacementRequest, w: Worker) -> bool:
        if not self.enabled:
            return True
        if req.priority == _P0:
            return not self._p0_ready or w.low_prefill_tokens == 0
        if self.p0_exclusive and w.p0_prefilling > 0:
            return False
        if w.low_prefill_tokens > 0:
            return w.low_prefill_tokens + req.prompt_tokens <= step_budget(w, self.budget_tokens)
        return self._spare > 0  # starting a batch prefill here must leave the reserve of ready workers


# ---- scorers -------------------------------------------------------------------------------------------------


def least_loaded(*, kv_weight: float = 1.0, queue_weight: float = 1.0) -> Scorer:
    """Fewer leases held (relative to the engine's batch size), a shorter engine queue and a freer KV cache
    score higher."""

    def _score(_: PlacementRequest, w: Worker) -> float:
        cap = w.capacity
        return -(w.inflight / cap + queue_weight * w.load.waiting / cap + kv_weight * w.load.kv_cache_usage)
    _score.__name__ = "least_loaded"
    return _score


def least_prefill(budget_tokens: int = 0) -> Scorer:
    """Less prompt prefill pending on the worker, in engine steps (:func:`step_budget`), scores higher: a new
    request's first token waits for the prefill ahead of it in the engine. (Short P0 prompts weigh little, so P0
    requests arriving together share the worker kept free of batch prefill.)"""

    def _score(_: PlacementRequest, w: Worker) -> float:
        return -(w.low_prefill_tokens + w.p0_prefill_tokens) / step_budget(w, budget_tokens)
    _score.__name__ = "least_prefill"
    return _score


class PrefixIndex:
    """Which workers recently served which prompt prefixes, with bounded memory.

    A prefix is cut into blocks of ``block_chars`` characters; block *i*'s hash covers blocks 0..i (a chain), so one
    hash names a whole prefix. The index maps hash -> workers that saw it, as an LRU of at most ``max_entries``
    hashes (no trie, no unbounded growth); the longest match for a worker is the last block of the chain it holds.

    >>> idx = PrefixIndex(block_chars=4, max_entries=8)
    >>> idx.record(idx.hashes("abcdefgh"), "w1")
    >>> idx.match(idx.hashes("abcdefXY"))
    {'w1': 1}
    """

    def __init__(self, *, block_chars: int = 128, max_entries: int = 65536, workers_per_entry: int = 4) -> None:
        self.block_chars = block_chars
        self.max_entries = max_entries
        self.workers_per_entry = workers_per_entry
        self._lru: collections.OrderedDict[bytes, dict[str, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        prev = b""
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
        now = time.monotonic()
        for h in hashes:
            entry = self._lru.get(h)
            if entry is None:
                entry = self._lru[h] = {}
            else:
                self._lru.move_to_end(h)
            entry[worker_id] = now
            if len(entry) > self.workers_per_entry:
                del entry[min(entry, key=entry.__getitem__)]
        while len(self._lru) > self.max_entries:
            self._lru.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for entry in self._lru.values():
            entry.pop(worker_id, None)


class PrefixAffinity:
    """Scorer: the fraction of the request's prefix blocks the worker recently served (0 to 1), among workers whose
    load is within ``balance_slack`` (a share of the per-worker cap) of the least loaded candidate. A worker further
    ahead scores 0, so a hot prefix cannot pile onto one worker while others idle (the cache-aware policy of
    SGLang's router works the same way): affinity decides while load is balanced, load decides when it is not."""

    __name__ = "prefix_affinity"

    def __init__(self, index: PrefixIndex, *, max_inflight: int = 64, balance_slack: float = 0.1) -> None:
        self.index = index
        self.slack = max(balance_slack * max_inflight, 1.0)
        self._memo: tuple[str, list[bytes], dict[str, int]] = ("", [], {})
        self._min_inflight = 0

    def prepare(self, req: PlacementRequest, candidates: Sequence[Worker]) -> None:
        self._min_inflight = min((w.inflight for w in candidates), default=0)
        if req.prefix_hint and self._memo[0] != req.request_id:  # hash once per request, not per worker
            hashes = self.index.hashes(req.prefix_hint)
            self._memo = (req.request_id, hashes, self.index.match(hashes))

    def __call__(self, req: PlacementRequest, w: Worker) -> float:
        if not req.prefix_hint or w.inflight - self._min_inflight > self.slack:
            return 0.0
        if self._memo[0] != req.request_id:
            self.prepare(req, [w])
        _, hashes, matches = self._memo
        return matches.get(w.worker_id, 0) / len(hashes) if hashes else 0.0

    def observe(self, req: PlacementRequest, worker: Worker) -> None:
        if req.prefix_hint:
            hashes = self._memo[1] if self._memo[0] == req.request_id else self.index.hashes(req.prefix_hint)
            self.index.record(hashes, worker.worker_id)


class SessionAffinity:
    """Scorer: 1 for the worker that last served the request's session (its KV cache likely holds the
    conversation), else 0. Sessions are kept in a bounded LRU."""

    __name__ = "session_affinity"

    def __init__(self, *, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._lru: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __call__(self, req: PlacementRequest, w: Worker) -> float:
        return 1.0 if req.session_id and self._lru.get(req.session_id) == w.worker_id else 0.0

    def observe(self, req: PlacementRequest, worker: Worker) -> None:
        if req.session_id:
            self._lru[req.session_id] = worker.worker_id
            self._lru.move_to_end(req.session_id)
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)


# ---- pickers -------------------------------------------------------------------------------------------------


def max_score(rng: random.Random) -> Picker:
    def _pick(scored: Sequence[tuple[float, Worker]]) -> tuple[float, Worker]:
        best = max(score for score, _ in scored)
        ties = [(s, w) for s, w in scored if s >= best - 1e-9]
        return rng.choice(ties)  # random among equals spreads an idle fleet evenly
    _pick.__name__ = "max_score"
    return _pick


def round_robin() -> Picker:
    counter = itertools.count()

    def _pick(scored: Sequence[tuple[float, Worker]]) -> tuple[float, Worker]:
        ordered = sorted(scored, key=lambda sw: sw[1].worker_id)
        return ordered[next(counter) % len(ordered)]
    _pick.__name__ = "round_robin"
    return _pick


def random_pick(rng: random.Random) -> Picker:
    def _pick(scored: Sequence[tuple[float, Worker]]) -> tuple[float, Worker]:
        return rng.choice(list(scored))
    _pick.__name__ = "random"
    return _pick


# ---- the pipeline --------------------------------------------------------------------------------------------


class PlacementPipeline:
    def __init__(self, *, filters: Sequence[Filter], scorers: Sequence[tuple[float, Scorer]],
                 picker: Picker | None = None, registry: CollectorRegistry | None = None,
                 rng: random.Random | None = None) -> None:
        self.filters = list(filters)
        self.scorers = list(scorers)
        self._rng = rng or random.Random()
        self.picker = picker or max_score(self._rng)
        self._step_seconds = Histogram(
            "goodput_scheduler_placement_step_seconds", "Time spent in each placement step.",
            ["step"], buckets=STEP_BUCKETS, registry=registry) if registry else None

    def _timed(self, step: str, start: float) -> None:
        if self._step_seconds is not None:
            self._step_seconds.labels(step).observe(time.perf_counter() - start)

    def candidates(self, req: PlacementRequest, workers: Sequence[Worker]) -> tuple[list[Worker], str]:
        """The workers that pass every filter, and the name of the last filter that turned one away."""
        out = list(workers)
        narrowed_by = ""
        for f in self.filters:
            start = time.perf_counter()
            prepare = getattr(f, "prepare", None)
            if prepare is not None:  # a filter that looks at the whole fleet (a reserve) or at the survivors so far
                prepare(req, workers, out)
            kept = [w for w in out if f(req, w)]
            if len(kept) < len(out):
                narrowed_by = getattr(f, "__name__", "filter")
            out = kept
            self._timed(f"filter:{getattr(f, '__name__', 'filter')}", start)
            if not out:
                break
        return out, narrowed_by

    def place(self, req: PlacementRequest, workers: Sequence[Worker]) -> Decision | None:
        """The best worker for the request, or None when no worker passes the filters. The decision's reason is
        the scorer that most set the worker apart, or the filter that left it the only candidate."""
        candidates, narrowed_by = self.candidates(req, workers)
        if not candidates:
            return None
        if len(candidates) == 1 and narrowed_by:
            return Decision(worker=candidates[0], reason=narrowed_by, score=0.0)
        per_scorer: list[list[float]] = []
        for weight, scorer in self.scorers:
            start = time.perf_counter()
            prepare = getattr(scorer, "prepare", None)
            if prepare is not None:
                prepare(req, candidates)
            per_scorer.append([weight * scorer(req, w) for w in candidates])
            self._timed(f"score:{getattr(scorer, '__name__', 'scorer')}", start)
        totals = [sum(col) for col in zip(*per_scorer, strict=True)] if per_scorer else [0.0] * len(candidates)
        start = time.perf_counter()
        score, chosen = self.picker(list(zip(totals, candidates, strict=True)))
        self._timed(f"pick:{getattr(self.picker, '__name__', 'pick')}", start)
        return Decision(worker=chosen, reason=self._reason(per_scorer, candidates.index(chosen)), score=score)

    def _reason(self, per_scorer: list[list[float]], chosen: int) -> str:
        """The scorer that most set the chosen worker apart from the mean of the candidates."""
        name = getattr(self.picker, "__name__", "")
        if name in ("round_robin", "random"):
            return name
        best, reason = 1e-9, ""
        for (_, scorer), col in zip(self.scorers, per_scorer, strict=True):
            margin = col[chosen] - sum(col) / len(col)
            if margin > best:
                best, reason = margin, getattr(scorer, "__name__", "scorer")
        if not reason:
            reason = getattr(self.scorers[0][1], "__name__", "first_fit") if self.scorers else "first_fit"
        return reason

    def commit(self, req: PlacementRequest, decision: Decision) -> None:
        """Tells stateful scorers (affinity) where the request went."""
        for _, scorer in self.scorers:
            observe = getattr(scorer, "observe", None)
            if observe is not None:
                observe(req, decision.worker)


# ---- the declarative profile ---------------------------------------------------------------------------------

DEFAULT_PROFILE: dict[str, Any] = {
    "filters": ["healthy", "serves_model", "has_capacity", "prefill_gate"],
    "scorers": [{"name": "least_loaded", "weight": 1.0},
                {"name": "least_prefill", "weight": 1.0},
                {"name": "prefix_affinity", "weight": 2.0},
                {"name": "session_affinity", "weight": 3.0}],
    "picker": "max_score",
}


@dataclass(frozen=True)
class Profile:
    """Which steps run and with which weights. JSON (or YAML) shape::

        {"filters": ["healthy", "serves_model", "has_capacity"],
         "scorers": [{"name": "least_loaded", "weight": 1.0}, {"name": "prefix_affinity", "weight": 2.0}],
         "picker": "max_score"}
    """

    filters: tuple[str, ...] = tuple(DEFAULT_PROFILE["filters"])
    scorers: tuple[tuple[str, float], ...] = tuple((s["name"], s["weight"]) for s in DEFAULT_PROFILE["scorers"])
    picker: str = "max_score"
    extra: dict[str, Any] = field(default_factory=dict)

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
        filters = tuple(doc.get("filters", DEFAULT_PROFILE["filters"]))
        scorers_raw = doc.get("scorers", DEFAULT_PROFILE["scorers"])
        scorers: list[tuple[str, float]] = []
        for s in scorers_raw:
            if isinstance(s, str):
                scorers.append((s, 1.0))
            elif isinstance(s, dict) and "name" in s:
                scorers.append((str(s["name"]), float(s.get("weight", 1.0))))
            else:
                raise ValueError(f"bad scorer entry {s!r}: use {{'name': ..., 'weight': ...}}")
        picker = str(doc.get("picker", "max_score"))
        profile = cls(filters=filters, scorers=tuple(scorers), picker=picker)
        profile.validate()
        return profile

    def validate(self) -> None:
        for f in self.filters:
            if f not in _FILTERS:
                raise ValueError(f"unknown filter {f!r}; known: {', '.join(sorted(_FILTERS))}")
        for name, weight in self.scorers:
            if name not in _SCORERS:
                raise ValueError(f"unknown scorer {name!r}; known: {', '.join(sorted(_SCORERS))}")
            if weight < 0:
                raise ValueError(f"scorer {name!r} has a negative weight")
        if self.picker not in _PICKERS:
            raise ValueError(f"unknown picker {self.picker!r}; known: {', '.join(sorted(_PICKERS))}")


class _Settings(Protocol):
    max_inflight_per_worker: int
    p1_max_share: float
    p2_max_share: float
    kv_full: float
    kv_weight: float
    queue_weight: float
    prefix_block_chars: int
    prefix_index_entries: int
    prefix_balance_slack: float
    session_index_entries: int
    prefill_gate: bool
    low_prefill_budget_tokens: int
    p0_prefill_exclusive: bool

    @property
    def queue_policy(self) -> str: ...


class GuardSignals(Protocol):
    """What filters read from the latency guard."""

    def current(self) -> float: ...  # P1/P2 leases one worker may hold now

    def p0_reserve(self) -> int: ...  # workers to keep free of P1/P2 prefill for P0 now


_FILTERS: dict[str, Callable[[_Settings, GuardSignals | None], Filter]] = {
    "healthy": lambda s, _: healthy,
    "serves_model": lambda s, _: serves_model,
    "has_capacity": lambda s, guard: has_capacity(
        s.max_inflight_per_worker, kv_full=s.kv_full, low_limit=guard.current if guard is not None else None,
        shares={types_pb2.PRIORITY_P1: s.p1_max_share, types_pb2.PRIORITY_P2: s.p2_max_share}),
    # the fifo baseline has no classes, so no gate between them
    "prefill_gate": lambda s, guard: PrefillGate(s.low_prefill_budget_tokens,
                                                 enabled=s.prefill_gate and s.queue_policy == "priority",
                                                 p0_exclusive=s.p0_prefill_exclusive,
                                                 p0_reserve=guard.p0_reserve if guard is not None else None),
}
_SCORERS: dict[str, Callable[[_Settings], Scorer]] = {
    "least_loaded": lambda s: least_loaded(kv_weight=s.kv_weight, queue_weight=s.queue_weight),
    "least_prefill": lambda s: least_prefill(s.low_prefill_budget_tokens),
    "prefix_affinity": lambda s: PrefixAffinity(PrefixIndex(block_chars=s.prefix_block_chars,
                                                            max_entries=s.prefix_index_entries),
                                                max_inflight=s.max_inflight_per_worker,
                                                balance_slack=s.prefix_balance_slack),
    "session_affinity": lambda s: SessionAffinity(max_entries=s.session_index_entries),
}
_PICKERS: dict[str, Callable[[random.Random], Picker]] = {
    "max_score": max_score,
    "round_robin": lambda rng: round_robin(),
    "random": random_pick,
}


def build_pipeline(profile: Profile, settings: _Settings, *, registry: CollectorRegistry | None = None,
                   rng: random.Random | None = None,
                   guard: GuardSignals | None = None) -> PlacementPipeline:
    """The pipeline a profile describes. ``guard`` (the latency guard) gives the P1/P2 limit per worker and whether
    P0 traffic is present."""
    rng = rng or random.Random()
    return PlacementPipeline(
        filters=[_FILTERS[name](settings, guard) for name in profile.filters],
        scorers=[(weight, _SCORERS[name](settings)) for name, weight in profile.scorers],
        picker=_PICKERS[profile.picker](rng), registry=registry, rng=rng)
