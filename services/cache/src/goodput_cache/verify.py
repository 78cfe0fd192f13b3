"""The verifier: a cross-encoder that reads a new question and a cached one together and says whether they ask the
same thing.

A sentence embedding puts "how do I learn Python fast?" and "how do I learn Python?" or "flights from Paris to Rome"
and "flights from Rome to Paris" close together; the similarity rule and the near-miss guard cannot tell all of them
apart (loadtests/reports/cache_eval.md). With a verifier, L2 candidates from ``verify_min_similarity`` up are read
in pairs with the question (one model call for all of them), and a candidate is served only when its probability
reaches ``verify_threshold`` (by default the threshold in the model's card, chosen on validation pairs for 95%
precision). The model is what ``goodput train verifier`` makes from MiniLM, or any paraphrase cross-encoder folder.

Example::

    verifier = load_verifier(CacheSettings(verifier_model="models/goodput-verifier-minilm"))
    verifier.judge("how can I reset my password?", ["how do I reset my password?"], deadline)  # array([0.98])
"""

from __future__ import annotations

import logging

import numpy as np

from goodput_crossencoder import CrossEncoder, DeadlineExceeded, load_configured

from goodput_cache.config import CacheSettings

__all__ = ["DeadlineExceeded", "Verifier", "load_verifier"]

log = logging.getLogger("goodput.cache.verify")


class Verifier:
    def __init__(self, model: CrossEncoder, *, threshold: float) -> None:
        self.model = model
        self.threshold = threshold
        self.name = model.name

    def judge(self, question: str, candidates: list[str], *, deadline: float | None = None) -> np.ndarray:
        """The probability that each candidate asks what ``question`` asks (raises :class:`DeadlineExceeded`)."""
        return self.model.score([(question, c) for c in candidates], deadline=deadline).probabilities


def load_verifier(settings: CacheSettings) -> Verifier | None:
    """The configured verifier, or None (``verifier=none``, the L2 layer off, or ``auto`` without a model)."""
    if not settings.semantic:
        return None
    loaded = load_configured(settings.verifier, settings.verifier_model, kind="verifier",
                             setting="GOODPUT_CACHE_VERIFIER_MODEL", backend=settings.verifier_backend,
                             device=settings.verifier_device, threads=settings.verifier_threads)
    if loaded is None:
        return None
    model, card = loaded
    threshold = settings.verify_threshold or (card.threshold if card and card.threshold else 0.5)
    log.info("verifier loaded", extra={"model": model.name, "threshold": threshold})
    return Verifier(model, threshold=threshold)
