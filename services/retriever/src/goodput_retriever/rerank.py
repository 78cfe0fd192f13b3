"""The rerank step: the fused top candidates in, the best ``top_n`` out, by a cross-encoder that reads the query and
each passage together (BP-PERF-06: top 10-20 from hybrid search, a cross-encoder, the best 3-5 to the model).

The model is any Hugging Face sequence-classification folder (``GOODPUT_RETRIEVER_RERANKER_MODEL``): the one
``goodput train reranker`` makes from MiniLM, or a bge / ms-marco reranker in production, scored by
:class:`goodput_crossencoder.CrossEncoder` (int8 ONNX on CPU, torch on a GPU). With ``reranker=auto`` (the default) a
retriever without a model serves the fused order and says "rerank skipped: no reranker model".

Example::

    reranker = load_reranker(RetrieverSettings(reranker_model="models/goodput-reranker-minilm"))
    best = reranker.rerank("what lowers blood pressure?", hits[:20], top_n=5, deadline=time.monotonic() + 0.12)
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from goodput_crossencoder import CrossEncoder, DeadlineExceeded, load_configured
from goodput_crossencoder.model import BLEND_K, blend_ranks

from goodput_retriever.config import RetrieverSettings
from goodput_retriever.fusion import Hit

__all__ = ["CrossEncoderReranker", "DeadlineExceeded", "Reranker", "load_reranker"]

log = logging.getLogger("goodput.retriever.rerank")


class Reranker(Protocol):
    name: str

    def rerank(self, query: str, hits: list[Hit], top_n: int, *, deadline: float | None = None) -> list[Hit]:
        """The ``top_n`` best of ``hits`` for ``query``, best first; raises :class:`DeadlineExceeded` when the
        deadline (``time.monotonic()``) cannot be met."""
        ...


class CrossEncoderReranker:
    """Scores (query, passage) pairs with a cross-encoder and orders the candidates by a reciprocal-rank fusion of
    its ranking (share ``blend``) with the fused order they came in (``1 - blend``): a small model trained on little
    data knows things the first stage does not, and the other way round; ``blend`` 1 = the model alone. A hit's
    score becomes the model's probability that the passage is relevant (its fused score stays in
    ``metadata["fused_score"]``)."""

    def __init__(self, model: CrossEncoder, *, blend: float = 1.0, blend_k: float = BLEND_K) -> None:
        self.model = model
        self.name = model.name
        self.blend = blend
        self.blend_k = blend_k

    def rerank(self, query: str, hits: list[Hit], top_n: int, *, deadline: float | None = None) -> list[Hit]:
        if not hits:
            return []
        scores = self.model.score([(query, h.text) for h in hits], deadline=deadline)
        order = blend_ranks(len(hits), scores.logits, self.blend, self.blend_k)[:top_n]
        return [replace(hits[i], score=float(scores.probabilities[i]),
                        metadata={**hits[i].metadata, "fused_score": f"{hits[i].score:.6g}"}) for i in order]


def load_reranker(settings: RetrieverSettings) -> Reranker | None:
    """The configured reranker, or None (``reranker=none``, or ``auto`` without a model folder)."""
    loaded = load_configured(settings.reranker, settings.reranker_model, kind="reranker",
                             setting="GOODPUT_RETRIEVER_RERANKER_MODEL", backend=settings.reranker_backend,
                             device=settings.reranker_device, threads=settings.reranker_threads,
                             max_length=settings.reranker_max_length, truncation="only_second")
    if loaded is None:
        return None
    model, card = loaded
    extra = card.extra if card else {}
    blend = settings.rerank_blend if settings.rerank_blend >= 0 else float(extra.get("blend", 1.0))
    return CrossEncoderReranker(model, blend=blend, blend_k=float(extra.get("blend_k", BLEND_K)))
