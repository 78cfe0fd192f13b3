"""L2: the semantic index. One cosine index per partition, in memory, within one memory budget for all of them;
rebuilt from Redis at start (the most recently used entries first, up to the budget).

Small partitions (below ``AnnConfig.min_entries``, 4096 by default) are searched exactly: a contiguous float32
matrix and one matrix-vector product (~1.5 KiB per entry). Larger ones get an HNSW graph (``ann.py``, faiss): an
exact scan of 100k x 384 costs 20-60 ms on a busy 2-core machine, over the 20 ms lookup goal; HNSW well under a
millisecond. Every candidate is re-scored with its exact cosine before the threshold, so the approximate search can
only miss a neighbour (a lost hit), never return a wrong one. Why not Redis or Qdrant: this Redis (7.0, no
RediSearch) has no vector search, and qdrant-client's local mode is brute force with ~18 ms per query at 10k points.
Partitions keep searches small and make cross-tenant hits impossible by construction: a search only ever sees the
vectors of its own partition. The :class:`VectorIndex` protocol lets a Qdrant server (filtered by partition)
replace it for fleets whose cache does not fit one process.

Memory: one budget (``max_bytes``) for every partition together. One least-recently-used order runs over all the
entries of all the partitions (storing an entry or serving it moves it to the recent end); beyond the budget, the
least recently used entries go, whichever partition holds them. A partition costs nothing until its first entry,
grows by small steps (``memory.grow_step``: a partition of three entries holds three or four rows, never a
preallocation), gives rows back as it shrinks and is dropped with its last entry, so 100k partitions of a few entries
cost what their entries cost. What is charged is an estimate of what is allocated (``memory.py``): the rows' capacity,
graphs, strings and bookkeeping. Tombstones of a large partition (given back by its next rebuild) and the copy a
rebuild in flight holds are charged but not held against the budget: they go by themselves. An entry evicted here
stays in Redis, where L1 still serves its exact repeats.

Example (3-dimensional vectors here; the cache's are all-MiniLM-L6-v2's 384):
    >>> index = NumpyIndex(dim=3, max_per_partition=100_000, ann=AnnConfig(), max_bytes=1 << 20)
    >>> index.add("p1", "key1", np.array([1.0, 0.0, 0.0]), question="how do I reset my password?",
    ...           expires=time.time() + 3600)
    True
    >>> [(round(c.similarity, 2), c.key) for c in index.search("p1", np.array([0.96, 0.28, 0.0]), k=4,
    ...                                                        min_similarity=0.9)]
    [(0.96, 'key1')]
    >>> index.search("p2", np.array([0.96, 0.28, 0.0]), k=4, min_similarity=0.9)   # another partition sees nothing
    []
    >>> 0 < index.bytes_used() <= index.max_bytes
    True
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from goodput_cache.ann import AnnConfig, AnnPartition
from goodput_cache.memory import ENTRY_BYTES, PARTITION_BYTES, grow_step, str_bytes, trimmer

__all__ = ["AnnConfig", "Candidate", "NumpyIndex", "VectorIndex"]

P = TypeVar("P", "_Partition", AnnPartition)


@dataclass(frozen=True)
class Candidate:
    similarity: float
    key: str
    question: str


class VectorIndex(Protocol):
    def add(self, partition: str, key: str, vector: np.ndarray, *, question: str, expires: float,
            cold: bool = False) -> bool:
        """Adds (or replaces) an entry; False when it is not held (over the budget). ``cold``: as the least
        recently used entry (what a restart loads, most recent first); it never evicts another one."""
        ...

    def remove(self, keys: list[str]) -> int: ...

    def touch(self, key: str) -> None:
        """The entry was served: it becomes the most recently used."""
        ...

    def search(self, partition: str, vector: np.ndarray, *, k: int, min_similarity: float) -> list[Candidate]: ...

    def bytes_used(self) -> int:
        """Memory the index holds (its estimate), for the metrics."""
        ...

    def partitions(self) -> int: ...

    def __len__(self) -> int: ...


class _Partition:
    """An exactly searched partition: rows packed at the front (a removal moves the last row into the hole). It
    starts with no rows, grows by ``grow_step`` rows when full and gives rows back once twice a step is unused."""

    __slots__ = ("charged", "dim", "expires", "keys", "questions", "row_of", "text_bytes", "transient", "vectors")

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.vectors = np.empty((0, dim), dtype=np.float32)
        self.expires = np.empty(0, dtype=np.float64)
        self.keys: list[str] = []
        self.questions: list[str] = []
        self.row_of: dict[str, int] = {}
        self.text_bytes = 0  # of the keys and questions
        self.charged = 0     # what the index last charged for it (NumpyIndex's accountant)
        self.transient = 0

    def __len__(self) -> int:
        return len(self.keys)

    def _resize(self, cap: int) -> None:
        n = len(self.keys)
        vectors = np.empty((cap, self.dim), dtype=np.float32)
        vectors[:n] = self.vectors[:n]
        expires = np.empty(cap, dtype=np.float64)
        expires[:n] = self.expires[:n]
        self.vectors, self.expires = vectors, expires

    def charge(self) -> tuple[int, int]:
        """(bytes held, of which transient): rows by capacity, strings, bookkeeping."""
        rows = len(self.vectors) * (4 * self.dim + 8)
        return PARTITION_BYTES + rows + len(self.keys) * ENTRY_BYTES + self.text_bytes, 0

    def add(self, key: str, vector: np.ndarray, question: str, expires: float) -> None:
        n = len(self.keys)
        if n == len(self.vectors):
            self._resize(n + grow_step(n))
        self.vectors[n] = vector
        self.expires[n] = expires
        self.keys.append(key)
        self.questions.append(question)
        self.row_of[key] = n
        self.text_bytes += str_bytes(key) + str_bytes(question)

    def remove(self, key: str) -> bool:
        i = self.row_of.pop(key, None)
        if i is None:
            return False
        self.text_bytes -= str_bytes(key) + str_bytes(self.questions[i])
        last = len(self.keys) - 1
        if i != last:
            self.vectors[i] = self.vectors[last]
            self.expires[i] = self.expires[last]
            self.keys[i] = self.keys[last]
            self.questions[i] = self.questions[last]
            self.row_of[self.keys[i]] = i
        self.keys.pop()
        self.questions.pop()
        n = len(self.keys)
        if n and len(self.vectors) - n >= 2 * grow_step(n):
            self._resize(n + grow_step(n))
        return True

    def expiry(self, key: str) -> float:
        return float(self.expires[self.row_of[key]])

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
    ``ann.min_entries`` (``ann=None``: always exact), within ``max_bytes`` for all partitions together (0 = no
    budget). Thread-safe (searches run in a thread pool); graph builds run in background threads.
    ``on_evict(reason, count)`` hears of every eviction: ``budget`` (the least recently used entry, over the
    budget), ``expired`` (the same, an entry past its TTL), ``partition_full`` (``max_per_partition``)."""

    def __init__(self, *, dim: int, max_per_partition: int, ann: AnnConfig | None = None, max_bytes: int = 0,
                 on_evict: Callable[[str, int], None] | None = None) -> None:
        self.dim = dim
        self.max_per_partition = max_per_partition
        self.ann = ann
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._parts: dict[str, _Partition | AnnPartition] = {}
        self._where: OrderedDict[str, str] = OrderedDict()  # key -> partition, least recently used first
        self._bytes = 0      # charged by all partitions
        self._transient = 0  # of which tombstones and builds in flight (not held against the budget)
        self._lock = threading.RLock()
        self._trim = trimmer()
        self._builds = 0  # build threads not yet done (a graph swapped in, then its memory charged and enforced)

    def __len__(self) -> int:
        return len(self._where)

    def partitions(self) -> int:
        return len(self._parts)

    def bytes_used(self) -> int:
        return self._bytes

    # ---- the accountant -----------------------------------------------------------------------------------------

    def _recharge(self, part: _Partition | AnnPartition) -> None:
        held, transient = part.charge()
        self._bytes += held - part.charged
        self._transient += transient - part.transient
        part.charged, part.transient = held, transient

    def _drop(self, partition: str, part: _Partition | AnnPartition) -> None:
        self._bytes -= part.charged
        self._transient -= part.transient
        part.charged = part.transient = 0
        del self._parts[partition]

    def _over(self) -> bool:
        return bool(self.max_bytes) and self._bytes - self._transient > self.max_bytes

    def _enforce(self, *, uncounted: str = "") -> None:
        """Evicts the least recently used entries, of any partition, until the index is within its budget."""
        now = time.time()
        evicted: dict[str, int] = {}
        while self._over() and self._where:
            key, partition = next(iter(self._where.items()))
            part = self._parts[partition]
            reason = "expired" if part.expiry(key) < now else "budget"
            self._remove(partition, part, key)
            if key != uncounted:
                evicted[reason] = evicted.get(reason, 0) + 1
        for reason, count in evicted.items():
            self._evicted(reason, count)

    def _evicted(self, reason: str, count: int) -> None:
        if self.on_evict is not None and count:
            self.on_evict(reason, count)

    # ---- entries ------------------------------------------------------------------------------------------------

    def add(self, partition: str, key: str, vector: np.ndarray, *, question: str, expires: float,
            cold: bool = False) -> bool:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise ValueError(f"vector has {v.shape[0]} dimensions, the index {self.dim}")
        with self._lock:
            self.remove([key])
            part = self._parts.get(partition)
            if part is None:  # created with its first entry
                part = self._parts[partition] = _Partition(self.dim)
            if len(part) >= self.max_per_partition:
                # the oldest-expiring entry of a full partition makes room
                self._remove(partition, part, part.oldest())
                self._evicted("partition_full", 1)
                part = self._parts.setdefault(partition, part)
            part.add(key, v, question, expires)
            self._where[key] = partition
            if cold:
                self._where.move_to_end(key, last=False)
            if self.ann is not None and isinstance(part, _Partition) and len(part) >= self.ann.min_entries:
                part = self._replace(partition, part, AnnPartition(self.dim, self.ann, self._lock, name=partition))
            self._recharge(part)
            if isinstance(part, AnnPartition):
                self._maybe_build(part)
            self._enforce(uncounted=key if cold else "")
            return key in self._where

    def touch(self, key: str) -> None:
        with self._lock:
            if key in self._where:
                self._where.move_to_end(key)

    def _replace(self, partition: str, old: _Partition | AnnPartition, new: P) -> P:
        """``new`` takes over ``old``'s entries, in row order: an exact partition that reached ``min_entries`` becomes
        an HNSW one (searched exactly until built), a large one that fell below half of it is scanned exactly again
        (its rows packed, its tombstones and graph gone)."""
        for key, i in sorted(old.row_of.items(), key=lambda item: item[1]):
            new.add(key, old.vectors[i], old.questions[i], float(old.expires[i]))
        self._drop(partition, old)
        self._parts[partition] = new
        return new

    def _maybe_build(self, part: AnnPartition, *, complete: bool = False) -> None:
        if part.needs_build(complete=complete):
            part.building = True
            part.reserved = part.build_bytes()
            self._recharge(part)
            self._builds += 1
            threading.Thread(target=self._build, args=(part,), name="l2-index-build", daemon=True).start()

    def _build(self, part: AnnPartition) -> None:
        try:
            part.rebuild()
            with self._lock:  # what arrived during the build may call for the next one
                if self._parts.get(part.name) is part:
                    self._recharge(part)
                    self._maybe_build(part)
                    self._enforce()
        finally:
            with self._lock:  # done only once its memory is charged (settle() waits for this, not for the swap)
                self._builds -= 1
        self._trim()  # the old rows and graph go back to the OS, so the RSS follows the budget

    def _remove(self, partition: str, part: _Partition | AnnPartition, key: str) -> None:
        part.remove(key)
        del self._where[key]
        if not len(part):
            self._drop(partition, part)
        elif isinstance(part, AnnPartition) and self.ann is not None and len(part) < self.ann.min_entries // 2:
            self._recharge(self._replace(partition, part, _Partition(self.dim)))
        else:
            self._recharge(part)

    def remove(self, keys: list[str]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                partition = self._where.get(key)
                if partition is None:
                    continue
                self._remove(partition, self._parts[partition], key)
                removed += 1
                part = self._parts.get(partition)
                if isinstance(part, AnnPartition):
                    self._maybe_build(part)
            self._enforce()  # a rebuild that swapped in since the last charge may have grown its partition's spare
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
        """Waits until no partition's graph is being built or due for a build, and every finished build's memory is
        charged (benchmarks, tests); True if so. ``complete``: until every large partition's graph holds all its
        entries and no tombstone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                busy = [p for p in self._parts.values() if isinstance(p, AnnPartition) and p.building]
                for p in self._parts.values():
                    if isinstance(p, AnnPartition):
                        self._maybe_build(p, complete=complete)
                        if p.building and p not in busy:
                            busy.append(p)
                settled = not busy and not self._builds
            if settled:
                return True
            for p in busy:
                p.wait_until(deadline)
            if not busy:  # a build swapped its graph in and is charging its memory
                time.sleep(0.001)
        return False
