"""L2: the semantic index. One cosine index per partition, in memory, rebuilt from Redis at start.

Small partitions (below ``AnnConfig.min_entries``, 4096 by default) are searched exactly: a contiguous float32
matrix and one matrix-vector product (~1.5 KiB per entry). Larger ones get an HNSW graph (``ann.py``, faiss): an
exact scan of 100k x 384 costs 20-60 ms on a busy 2-core machine, over the 20 ms lookup goal; HNSW well under a
millisecond. Every candidate is re-scored with its exact cosine before the threshold, so the approximate search can
only miss a neighbour (a lost hit), never return a wrong one. Why not Redis or Qdrant: this Redis (7.0, no
RediSearch) has no vector search, and qdrant-client's local mode is brute force with ~18 ms per query at 10k points.
Partitions keep searches small and make cross-tenant hits impossible by construction: a search only ever sees the
vectors of its own partition. The :class:`VectorIndex` protocol lets a Qdrant server (filtered by partition)
replace it for fleets whose cache does not fit one process.

Example (3-dimensional vectors here; the cache's are all-MiniLM-L6-v2's 384):
    >>> index = NumpyIndex(dim=3, max_per_partition=100_000, ann=AnnConfig())
    >>> index.add("p1", "key1", np.array([1.0, 0.0, 0.0]), question="how do I reset my password?",
    ...           expires=time.time() + 3600)
    >>> [(round(c.similarity, 2), c.key) for c in index.search("p1", np.array([0.96, 0.28, 0.0]), k=4,
    ...                                                        min_similarity=0.9)]
    [(0.96, 'key1')]
    >>> index.search("p2", np.array([0.96, 0.28, 0.0]), k=4, min_similarity=0.9)   # another partition sees nothing
    []
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from goodput_cache.ann import AnnConfig, AnnPartition

__all__ = ["AnnConfig", "Candidate", "NumpyIndex", "VectorIndex"]


@dataclass(frozen=True)
class Candidate:
    similarity: float
    key: str
    question: str


class VectorIndex(Protocol):
    def add(self, partition: str, key: str, vector: np.ndarray, *, question: str, expires: float) -> None: ...

    def remove(self, keys: list[str]) -> int: ...

    def search(self, partition: str, vector: np.ndarray, *, k: int, min_similarity: float) -> list[Candidate]: ...

    def __len__(self) -> int: ...


@dataclass
class _Partition:
    """An exactly searched partition: rows packed at the front (a removal moves the last row into the hole)."""

    dim: int
    vectors: np.ndarray = field(init=False)
    expires: np.ndarray = field(init=False)
    keys: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    row_of: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vectors = np.zeros((16, self.dim), dtype=np.float32)
        self.expires = np.zeros(16, dtype=np.float64)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: str, vector: np.ndarray, question: str, expires: float) -> None:
        n = len(self.keys)
        if n == len(self.vectors):
            grown = np.zeros((2 * n, self.dim), dtype=np.float32)
            grown[:n] = self.vectors
            self.vectors = grown
            exp = np.zeros(2 * n, dtype=np.float64)
            exp[:n] = self.expires
            self.expires = exp
        self.vectors[n] = vector
        self.expires[n] = expires
        self.keys.append(key)
        self.questions.append(question)
        self.row_of[key] = n

    def remove(self, key: str) -> bool:
        i = self.row_of.pop(key, None)
        if i is None:
            return False
        last = len(self.keys) - 1
        if i != last:
            self.vectors[i] = self.vectors[last]
            self.expires[i] = self.expires[last]
            self.keys[i] = self.keys[last]
            self.questions[i] = self.questions[last]
            self.row_of[self.keys[i]] = i
        self.keys.pop()
        self.questions.pop()
        return True

    def oldest(self) -> str:
        return self.keys[int(np.argmin(self.expires[:len(self.keys)]))]

    def search(self, vector: np.ndarray, k: int, now: float) -> list[tuple[float, int]]:
        n = len(self.keys)
        sims = self.vectors[:n] @ vector
        sims[self.expires[:n] < now] = -np.inf
        top = np.argpartition(-sims, k)[:k] if n > k else np.arange(n)
        top = top[np.argsort(-sims[top])]
        return [(float(sims[i]), int(i)) for i in top if sims[i] > -np.inf]


class NumpyIndex:
    """Cosine search per partition over L2-normalised vectors: exact, or HNSW for partitions of at least
    ``ann.min_entries`` (``ann=None``: always exact). Thread-safe (searches run in a thread pool); graph builds run
    in background threads."""

    def __init__(self, *, dim: int, max_per_partition: int, ann: AnnConfig | None = None) -> None:
        self.dim = dim
        self.max_per_partition = max_per_partition
        self.ann = ann
        self._parts: dict[str, _Partition | AnnPartition] = {}
        self._where: dict[str, str] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._where)

    def partitions(self) -> int:
        return len(self._parts)

    def add(self, partition: str, key: str, vector: np.ndarray, *, question: str, expires: float) -> None:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise ValueError(f"vector has {v.shape[0]} dimensions, the index {self.dim}")
        with self._lock:
            self.remove([key])
            part = self._parts.get(partition)
            if part is None:
                part = self._parts[partition] = _Partition(self.dim)
            if len(part) >= self.max_per_partition:
                # the oldest-expiring entry of a full partition makes room
                self._remove(partition, part, part.oldest())
                part = self._parts.setdefault(partition, part)
            part.add(key, v, question, expires)
            self._where[key] = partition
            if self.ann is not None and isinstance(part, _Partition) and len(part) >= self.ann.min_entries:
                part = self._parts[partition] = self._promote(part, self.ann)
            if isinstance(part, AnnPartition):
                self._maybe_build(part)

    def _promote(self, small: _Partition, config: AnnConfig) -> AnnPartition:
        """An exact partition that reached ``min_entries`` becomes an HNSW one (searched exactly until built)."""
        big = AnnPartition(self.dim, config, self._lock)
        for i, key in enumerate(small.keys):
            big.add(key, small.vectors[i], small.questions[i], float(small.expires[i]))
        return big

    def _maybe_build(self, part: AnnPartition, *, complete: bool = False) -> None:
        if part.needs_build(complete=complete):
            part.building = True
            threading.Thread(target=self._build, args=(part,), name="l2-index-build", daemon=True).start()

    def _build(self, part: AnnPartition) -> None:
        part.rebuild()
        with self._lock:  # what arrived during the build may call for the next one
            if any(p is part for p in self._parts.values()):
                self._maybe_build(part)

    def _remove(self, partition: str, part: _Partition | AnnPartition, key: str) -> None:
        part.remove(key)
        del self._where[key]
        if not len(part):
            del self._parts[partition]

    def remove(self, keys: list[str]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                partition = self._where.get(key)
                if partition is None:
                    continue
                part = self._parts[partition]
                self._remove(partition, part, key)
                removed += 1
                if isinstance(part, AnnPartition) and len(part):
                    self._maybe_build(part)
        return removed

    def search(self, partition: str, vector: np.ndarray, *, k: int, min_similarity: float) -> list[Candidate]:
        """Up to ``k`` unexpired entries of ``partition`` with similarity >= ``min_similarity``, best first."""
        q = np.ascontiguousarray(np.asarray(vector, dtype=np.float32).reshape(-1))
        with self._lock:
            part = self._parts.get(partition)
            if part is None or not len(part):
                return []
            return [Candidate(sim, part.keys[i], part.questions[i]) for sim, i in part.search(q, k, time.time())
                    if sim >= min_similarity]

    def settle(self, timeout_s: float = 600.0, *, complete: bool = False) -> bool:
        """Waits until no partition's graph is being built or due for a build (benchmarks, tests); True if so.
        ``complete``: until every large partition's graph holds all its entries and no tombstone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                busy = [p for p in self._parts.values() if isinstance(p, AnnPartition) and p.building]
                for p in self._parts.values():
                    if isinstance(p, AnnPartition):
                        self._maybe_build(p, complete=complete)
                        if p.building and p not in busy:
                            busy.append(p)
            if not busy:
                return True
            for p in busy:
                p.wait_until(deadline)
        return False
