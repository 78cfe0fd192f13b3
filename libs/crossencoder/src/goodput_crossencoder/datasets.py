"""The evaluation data the cross-encoders learn from, and the one split that keeps training and reports apart.

``../shared/data`` holds development splits only (the standard test splits are kept aside), so every set is cut
once more, deterministically: **train** (60%) for fitting, **validation** (10%) for choosing steps and thresholds and
for the model card, **test** (30%) for the reports (``loadtests.retrieval_eval``, ``loadtests.cache_eval``), which
never see a pair or query the models were trained or tuned on.

- Paraphrase pairs are split by connected component of their sentences (two pairs that share a sentence land in the
  same part): QQP's and PAWS's sentences recur across pairs, and a sentence seen in training would flatter the test.
- SciFact is split by query.
- GPTCache's mock pairs are not trained on at all: all 500 stay for the report.

Example:
    >>> split_of("a question about refunds")
    'train'
    >>> sorted({split_of(str(i)) for i in range(200)})
    ['test', 'train', 'validation']
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["PAIR_SETS", "Pair", "Split", "load_pairs", "load_scifact", "split_of", "split_pairs"]

Split = Literal["train", "validation", "test"]
PAIR_SETS = ("qqp", "paws", "mrpc", "gptcache_mock")
TRAINABLE_PAIR_SETS = ("qqp", "paws", "mrpc")
_SALT = "goodput-crossencoder-split-v1"


@dataclass(frozen=True)
class Pair:
    set: str
    a: str
    b: str
    label: int  # 1 = asks / says the same thing


def split_of(key: str) -> Split:
    """The part a key (a query id, a pair component) belongs to: 60% train, 10% validation, 30% test."""
    bucket = int.from_bytes(hashlib.sha256(f"{_SALT}:{key}".encode()).digest()[:4], "big") % 100
    return "train" if bucket < 60 else "validation" if bucket < 70 else "test"


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_pairs(data_dir: Path, name: str) -> list[Pair]:
    """One labelled pair set from the data folder, in file order."""
    base = Path(data_dir)
    if name == "qqp":
        return [Pair(name, r["text_a"], r["text_b"], int(r["label"])) for r in _jsonl(base / "qqp" / "pairs.jsonl.gz")]
    if name in ("paws", "mrpc"):
        return [Pair(name, r["sentence1"], r["sentence2"], int(r["label"]))
                for r in _jsonl(base / name / "pairs.jsonl")]
    if name == "gptcache_mock":
        return [Pair(name, r["origin"], r["similar"], 1) for r in _jsonl(base / "gptcache_mock" / "pairs.jsonl")]
    raise ValueError(f"unknown pair set {name!r} (one of {', '.join(PAIR_SETS)})")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def split_pairs(pairs: list[Pair]) -> dict[Split, list[Pair]]:
    """Pairs by part, by connected component of their (normalised) sentences; GPTCache's mock pairs all go to test."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        ra, rb = find(_norm(p.a)), find(_norm(p.b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[str, str] = {}
    for p in pairs:  # a component is named by its smallest sentence, whatever order the union happened in
        root = find(_norm(p.a))
        members[root] = min(members.get(root, _norm(p.a)), _norm(p.a), _norm(p.b))
    out: dict[Split, list[Pair]] = {"train": [], "validation": [], "test": []}
    for p in pairs:
        part: Split = "test" if p.set not in TRAINABLE_PAIR_SETS else split_of(members[find(_norm(p.a))])
        out[part].append(p)
    return out


@dataclass
class SciFact:
    corpus: list[dict[str, Any]]  # {"_id", "title", "text"}
    queries: dict[str, str]
    qrels: dict[str, set[str]]  # query id -> relevant document ids

    def query_ids(self, part: Split | None = None) -> list[str]:
        """Judged queries (of one part), sorted."""
        return sorted(q for q in self.qrels if q in self.queries and (part is None or split_of(q) == part))


def load_scifact(data_dir: Path) -> SciFact:
    base = Path(data_dir) / "scifact"
    corpus = list(_jsonl(base / "corpus.jsonl.gz"))
    queries = {str(q["_id"]): str(q["text"]) for q in _jsonl(base / "queries.jsonl")}
    qrels: dict[str, set[str]] = defaultdict(set)
    with open(base / "qrels.tsv", encoding="utf-8") as f:
        next(f)
        for line in f:
            qid, did, score = line.rstrip("\n").split("\t")
            if int(score) > 0:
                qrels[qid].add(did)
    return SciFact(corpus, queries, dict(qrels))
