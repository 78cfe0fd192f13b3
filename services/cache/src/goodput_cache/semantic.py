"""L2: the semantic index. One exact (brute-force) cosine index per partition, in memory, rebuilt from Redis at start.

Why not Redis or Qdrant: this Redis (7.0, no RediSearch) has no vector search, and qdrant-client's local mode is
brute force too, with ~18 ms per query at 10k points (too slow for a 20 ms p99 at 100k). A contiguous float32 matrix
per partition searched with one matrix-vector product is exact (no recall loss: a missed neighbour would be a missed
hit, an approximate neighbour a possible wrong one), takes ~1.5 KiB per entry and scans 100k entries in a few
milliseconds. Partitions keep searches small and make cross-tenant hits impossible by construction: a search only
ever sees the vectors of its own partition. The :class:`VectorIndex` protocol lets a Qdrant server (filtered by
partition) replace it for fleets whose cache does not fit one process.

Example:
    >>> index = NumpyIndex(dim=384, max_per_partition=100_000)
    >>> index.add("p1", "key1", vector, question="how do I reset my password?", expires=time.time() + 3600)
    >>> index.search("p1", query_vector, k=4)     # [(0.97, "key1", "how do I reset my password?")]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["Candidate", "NumpyIndex", "VectorIndex"]


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
    dim: int
    vectors: np.ndarray = field(init=False)
    expires: np.ndarray = field(init=False)
    keys: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.vectors = np.zeros((16, self.dim), dtype=np.float32)
        self.expires = np.zeros(16, dtype=np.float64)

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, key: str, vector: np.ndarray, question: str, expires: float) -> int:
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
        return n

    def pop(self, i: int) -> str | None:
        """Removes row i by moving the last row into it; returns the key that moved into i (or None)."""
        last = len(self.keys) - 1
        moved = None
        if i != last:
            self.vectors[i] = self.vectors[last]
            self.expires[i] = self.expires[last]
            self.keys[i] = self.keys[last]
            self.questions[i] = self.questions[last]
            moved = self.keys[i]
        self.keys.pop()
        self.questions.pop()
        return moved


class NumpyIndex:
    """Exact cosine search per partition over L2-normalised vectors. Thread-safe (searches run in a thread pool)."""

    def __init__(self, *, dim: int, max_per_partition: int) -> None:
        self.dim = dim
        self.max_per_partition = max_per_partition
        self._parts: dict[str, _Partition] = {}
        self._where: dict[str, tuple[str, int]] = {}
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
                self._remove_at(partition, part, int(np.argmin(part.expires[:len(part)])))
            self._where[key] = (partition, part.append(key, v, question, expires))

    def _remove_at(self, partition: str, part: _Partition, i: int) -> None:
        key = part.keys[i]
        moved = part.pop(i)
        del self._where[key]
        if moved is not None:
            self._where[moved] = (partition, i)
        if not part.keys:
            del self._parts[partition]

    def remove(self, keys: list[str]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                where = self._where.get(key)
                if where is None:
                    continue
                partition, i = where
                self._remove_at(partition, self._parts[partition], i)
                removed += 1
        return removed

    def search(self, partition: str, vector: np.ndarray, *, k: int, min_similarity: float) -> list[Candidate]:
        """Up to ``k`` unexpired entries of ``partition`` with similarity >= ``min_similarity``, best first."""
        with self._lock:
            part = self._parts.get(partition)
            if part is None or not part.keys:
                return []
            n = len(part)
            sims = part.vectors[:n] @ np.asarray(vector, dtype=np.float32).reshape(-1)
            sims[part.expires[:n] < time.time()] = -1.0
            if n > k:
                top = np.argpartition(-sims, k)[:k]
            else:
                top = np.arange(n)
            top = top[np.argsort(-sims[top])]
            return [Candidate(float(sims[i]), part.keys[i], part.questions[i]) for i in top
                    if sims[i] >= min_similarity]
