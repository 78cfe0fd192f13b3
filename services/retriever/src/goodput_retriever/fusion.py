"""Fusion of the dense and lexical result lists (pure functions, no I/O).

- :func:`rrf`: reciprocal rank fusion, ``score(d) = sum over legs of 1 / (k + rank(d))`` (rank from 1).
- :func:`weighted`: ``w * norm(dense) + (1 - w) * norm(lexical)`` with scores min-max normalised per leg
  (a result missing from a leg gets 0 from it).

Example (``b`` is in both legs, so it ranks first):
    >>> dense = [Hit("a-0", "a", 0.91), Hit("b-0", "b", 0.84)]
    >>> lexical = [Hit("b-0", "b", 7.1), Hit("c-0", "c", 3.2)]
    >>> [(h.chunk_id, round(h.score, 4)) for h in rrf([dense, lexical], k=60)]
    [('b-0', 0.0325), ('a-0', 0.0164), ('c-0', 0.0161)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = ["Hit", "normalise", "rrf", "weighted"]


@dataclass(frozen=True)
class Hit:
    chunk_id: str
    document_id: str
    score: float
    text: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


def _merge(lists: Sequence[Sequence[Hit]], scores: dict[str, float]) -> list[Hit]:
    first: dict[str, Hit] = {}
    for hits in lists:
        for h in hits:
            first.setdefault(h.chunk_id, h)
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    return [replace(first[cid], score=s) for cid, s in ranked]


def rrf(lists: Sequence[Sequence[Hit]], *, k: float = 60.0) -> list[Hit]:
    scores: dict[str, float] = {}
    for hits in lists:
        for rank, h in enumerate(hits, 1):
            scores[h.chunk_id] = scores.get(h.chunk_id, 0.0) + 1.0 / (k + rank)
    return _merge(lists, scores)


def normalise(hits: Sequence[Hit]) -> dict[str, float]:
    if not hits:
        return {}
    values = [h.score for h in hits]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return {h.chunk_id: 1.0 for h in hits}
    return {h.chunk_id: (h.score - lo) / (hi - lo) for h in hits}


def weighted(dense: Sequence[Hit], lexical: Sequence[Hit], *, dense_weight: float) -> list[Hit]:
    nd, nl = normalise(dense), normalise(lexical)
    scores = {cid: dense_weight * nd.get(cid, 0.0) + (1 - dense_weight) * nl.get(cid, 0.0) for cid in {*nd, *nl}}
    return _merge([dense, lexical], scores)
