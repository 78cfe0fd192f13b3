"""What the response cache answers: a cached :class:`Answer`, and the outcome of a lookup or a store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer", "LookupResult", "StoreResult"]


@dataclass
class Answer:
    text: str
    finish_reason: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # RAG: the chunks the answer was grounded on ({chunk_id, document_id, score, text}), replayed with a hit.
    sources: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LookupResult:
    hit: bool = False
    layer: str = ""
    similarity: float = 0.0
    answer: Answer | None = None
    degraded: bool = False
    key: str = ""
    reason: str = ""
    matched_query: str = ""
    # With a verifier: "same" (a verified hit), "different" (every candidate read was refused), "skipped" (over its
    # time), "" (no verification); and the probability of the candidate served or, on a refusal, the best refused.
    verdict: str = ""
    verifier_probability: float = 0.0
    # RAG: the knowledge-base version the lookup was answered at (what the Store that follows should carry).
    kb_version: int = 0


@dataclass
class StoreResult:
    stored: bool
    reason: str = ""
    key: str = ""
    ttl_s: int = 0
