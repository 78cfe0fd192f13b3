"""Measures the model cards and the evaluations report: ranking (nDCG@10, Recall@10, MRR@10) and pair verdicts
(precision, recall, ROC AUC, and the threshold that reaches a precision).

Example:
    >>> round(ndcg_at_10(["d3", "d1", "d2"], {"d1"}), 4)
    0.6309
    >>> threshold_for_precision(np.array([0.9, 0.8, 0.3, 0.2]), np.array([1, 1, 0, 1]), 0.95)
    0.8
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ndcg_at_10", "pair_metrics", "rank_metrics", "ranking_at_10", "threshold_for_precision"]


def ranking_at_10(ranked: Sequence[str], relevant: set[str]) -> tuple[float, float, float]:
    """(Recall@10, nDCG@10, MRR@10) of one ranking with binary relevance."""
    hits = [1 if d in relevant else 0 for d in list(ranked)[:10]]
    recall = sum(hits) / len(relevant) if relevant else 0.0
    dcg = sum(h / math.log2(i + 2) for i, h in enumerate(hits))
    idcg = sum(1 / math.log2(i + 2) for i in range(min(len(relevant), 10)))
    mrr = next((1 / (i + 1) for i, h in enumerate(hits) if h), 0.0)
    return recall, dcg / idcg if idcg else 0.0, mrr


def ndcg_at_10(ranked: Sequence[str], relevant: set[str]) -> float:
    return ranking_at_10(ranked, relevant)[1]


def rank_metrics(before: Sequence[float], after: Sequence[float]) -> dict[str, Any]:
    b, a = float(np.mean(before)) if before else 0.0, float(np.mean(after)) if after else 0.0
    return {"ndcg@10_first_stage": round(b, 4), "ndcg@10_reranked": round(a, 4), "ndcg@10_gain": round(a - b, 4)}


def threshold_for_precision(probs: np.ndarray, labels: np.ndarray, precision: float) -> float:
    """The lowest threshold t (one of the scores) at which ``probs >= t`` has at least ``precision``; 1.0 if none."""
    order = np.argsort(-probs, kind="stable")
    p, y = probs[order], labels[order]
    tp = np.cumsum(y)
    prec = tp / np.arange(1, len(y) + 1)
    best = 1.0
    for i in range(len(p)):
        if i + 1 < len(p) and p[i + 1] == p[i]:
            continue  # a threshold takes every pair with the same score
        if prec[i] >= precision:
            best = float(p[i])
    return best


def pair_metrics(probs: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, Any]:
    pred = probs >= threshold
    tp = int(np.sum(pred & (labels == 1)))
    fp = int(np.sum(pred & (labels == 0)))
    pos = int(np.sum(labels == 1))
    neg = len(labels) - pos
    # ROC AUC by ranks (Mann-Whitney U)
    ranks = np.empty(len(probs))
    ranks[np.argsort(probs, kind="stable")] = np.arange(1, len(probs) + 1)
    auc = (ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg) if pos and neg else float("nan")
    return {"pairs": len(labels), "positives": pos, "accepted": int(pred.sum()),
            "precision": round(tp / (tp + fp), 4) if tp + fp else None, "recall": round(tp / pos, 4) if pos else None,
            "accuracy": round(float(np.mean(pred == (labels == 1))), 4), "roc_auc": round(float(auc), 4)}
