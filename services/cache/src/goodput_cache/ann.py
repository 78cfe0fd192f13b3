"""L2 for large partitions: an HNSW graph (faiss ``IndexHNSWFlat``, inner product on L2-normalised vectors) over
an append-only row store, with tombstones and background rebuilds.

Why: one exact scan of 100k x 384 float32 costs 20-60 ms on a busy 2-core machine, over the 20 ms lookup goal; an
HNSW search costs well under a millisecond at the same size.

How it stays correct:

- **Rows never move** until a rebuild: a row's number is its graph label. Removing an entry only clears its ``alive``
  flag (a tombstone); searches pass ``alive & unexpired`` to faiss as an ID selector, so removed and expired entries
  are never returned.
- **Rows added since the last build** (the *tail*) are not in the graph yet: they are scanned exactly, so a new
  entry is found at once.
- **Exact re-scoring**: every candidate, from the graph or the tail, is re-scored with its exact cosine before the
  threshold. Approximate search can only *miss* a neighbour (a lost hit, never a wrong one).
- **Rebuilds** run in a background thread when the tail or the tombstones exceed ``rebuild_fraction`` of the graph:
  the live rows are copied and a new graph is built without the lock, then swapped in (rows added or removed during
  the build are carried over under the lock). Until a partition's first graph exists, it is searched exactly.

Memory: the graph keeps its own copy of the vectors plus ``2 * M`` links per entry: ~1.8 KiB per entry with M=32,
on top of the row store's ~1.5 KiB. Rows grow by ``memory.grow_step`` (an eighth of the partition when large) and a
rebuild keeps the same spare, so the row store holds at most an eighth more than its entries; :meth:`charge` is what
the index's budget counts, tombstones (given back by the next rebuild, also below ``min_entries``) and a build in
flight as transient. Not thread-safe by itself: :class:`~goodput_cache.semantic.NumpyIndex` calls
every method under its lock, and :meth:`AnnPartition.rebuild` takes that lock for its two short critical sections.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from goodput_cache.memory import ENTRY_BYTES, PARTITION_BYTES, graph_row_bytes, grow_step, str_bytes

__all__ = ["AnnConfig", "AnnPartition"]

log = logging.getLogger("goodput.cache")


@dataclass(frozen=True)
class AnnConfig:
    min_entries: int = 4096       # partitions smaller than this are scanned exactly
    m: int = 32                   # HNSW links per node
    ef_construction: int = 40
    ef_search: int = 64
    rebuild_fraction: float = 0.1  # rebuild when the tail or the tombstones reach this share of the graph
    build_threads: int = 1        # OpenMP threads of one background build


class AnnPartition:
    """One partition: rows (vectors, expiry, key, question, alive) plus an HNSW graph over rows ``[0, graph_rows)``."""

    def __init__(self, dim: int, config: AnnConfig, lock: threading.RLock, *, name: str = "") -> None:
        self.dim = dim
        self.config = config
        self.name = name
        self._lock = lock
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.expires = np.zeros(0, dtype=np.float64)
        self.alive = np.zeros(0, dtype=bool)
        self.keys: list[str] = []
        self.questions: list[str] = []
        self.row_of: dict[str, int] = {}
        self.graph: Any = None
        self.graph_rows = 0
        self.dead = 0  # rows in [0, n) whose entry was removed
        self.dead_graph = 0  # of which rows in the graph
        self.text_bytes = 0  # of the keys and questions of rows [0, n)
        self.dead_text = 0   # of which those of removed rows
        self.building = False
        self.builds = 0
        self.reserved = 0    # the copy a build in flight holds (its estimate)
        self.charged = 0     # what the index last charged for it (NumpyIndex's accountant)
        self.transient = 0

    # ---- rows ---------------------------------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow(self, need: int) -> None:
        cap = len(self.vectors)
        if need <= cap:
            return
        while cap < need:
            cap += grow_step(cap)
        for name in ("vectors", "expires", "alive"):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def add(self, key: str, vector: np.ndarray, question: str, expires: float) -> None:
        i = self.n
        self._grow(i + 1)
        self.vectors[i] = vector
        self.expires[i] = expires
        self.alive[i] = True
        self.keys.append(key)
        self.questions.append(question)
        self.row_of[key] = i
        self.text_bytes += str_bytes(key) + str_bytes(question)

    def remove(self, key: str) -> bool:
        i = self.row_of.pop(key, None)
        if i is None:
            return False
        self.alive[i] = False
        self.dead += 1
        self.dead_graph += self.graph is not None and i < self.graph_rows
        self.dead_text += str_bytes(key) + str_bytes(self.questions[i])
        return True

    def expiry(self, key: str) -> float:
        return float(self.expires[self.row_of[key]])

    # ---- memory -------------------------------------------------------------------------------------------------

    def _row_bytes(self) -> int:
        return 4 * self.dim + 8 + 1  # vector, expiry, alive

    def charge(self) -> tuple[int, int]:
        """(bytes held, of which transient): rows by capacity, the graph, strings and bookkeeping; transient: what
        the next rebuild gives back (tombstones) and the copy a build in flight holds."""
        graph = graph_row_bytes(self.dim, self.config.m)
        held = (PARTITION_BYTES + len(self.vectors) * self._row_bytes() + self.n * 16
                + len(self) * (ENTRY_BYTES - 16) + self.text_bytes + self.graph_rows * graph + self.reserved)
        transient = self.dead * (self._row_bytes() + 16) + self.dead_text + self.dead_graph * graph + self.reserved
        return held, transient

    def build_bytes(self) -> int:
        """What a rebuild allocates before it swaps in: the live rows (with spare) and, when large enough, a graph."""
        live = len(self)
        graph = graph_row_bytes(self.dim, self.config.m) * live if live >= self.config.min_entries else 0
        return (live + grow_step(live)) * 4 * self.dim + live * 16 + graph

    def oldest(self) -> str:
        """The key of the live entry that expires first (evicted when the partition is full)."""
        n = self.n
        return self.keys[int(np.argmin(np.where(self.alive[:n], self.expires[:n], np.inf)))]

    # ---- search -------------------------------------------------------------------------------------------------

    def search(self, vector: np.ndarray, k: int, now: float) -> list[tuple[float, int]]:
        """Up to ``k`` (exact similarity, row) of live, unexpired rows, best first: graph candidates plus the tail."""
        n = self.n
        ok = self.alive[:n] & (self.expires[:n] >= now)
        g = self.graph_rows if self.graph is not None else 0
        rows: list[int] = []
        if g:
            bits = np.packbits(ok[:g], bitorder="little")
            selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
            params = faiss.SearchParametersHNSW(  # type: ignore[attr-defined]  # missing from its stubs
                sel=selector, efSearch=max(self.config.ef_search, k))
            _, labels = self.graph.search(vector.reshape(1, -1), k, params=params)
            rows.extend(int(i) for i in labels[0] if i >= 0)
        if n > g:
            sims = self.vectors[g:n] @ vector
            sims[~ok[g:n]] = -np.inf
            top = np.argpartition(-sims, k)[:k] if n - g > k else np.arange(n - g)
            rows.extend(int(g + i) for i in top if sims[i] > -np.inf)
        if not rows:
            return []
        picked = np.asarray(rows, dtype=np.int64)
        exact = self.vectors[picked] @ vector  # the exact cosine decides, never the graph's score
        order = np.argsort(-exact)[:k]
        return [(float(exact[j]), int(picked[j])) for j in order]

    # ---- rebuilds -----------------------------------------------------------------------------------------------

    def needs_build(self, *, complete: bool = False) -> bool:
        """Due for a (re)build; ``complete``: as soon as anything is outside the graph or a tombstone in it. Below
        ``min_entries`` a rebuild only compacts (gives the tombstones' rows back), without a graph."""
        if self.building:
            return False
        limit = 1 if complete else self.config.rebuild_fraction * max(self.graph_rows, len(self), 1)
        if len(self) < self.config.min_entries:
            return self.dead >= max(limit, 1)
        if self.graph is None:
            return True
        return self.n - self.graph_rows >= limit or self.dead >= limit

    def rebuild(self) -> None:
        """Builds a graph over the live rows and swaps it in (called in a background thread, ``building`` set)."""
        try:
            with self._lock:
                n0, vectors0, keys0, questions0 = self.n, self.vectors, self.keys, self.questions
                idx = np.flatnonzero(self.alive[:n0])
            # rows < n0 never change in place (appends go past n0, a growth copies into a new array), so the
            # snapshot is read without the lock
            cap = len(idx) + grow_step(len(idx))
            vectors = np.zeros((cap, self.dim), dtype=np.float32)
            vectors[:len(idx)] = vectors0[idx]
            keys = [keys0[i] for i in idx]
            questions = [questions0[i] for i in idx]
            graph = None
            if len(idx) >= self.config.min_entries:
                graph = faiss.IndexHNSWFlat(self.dim, self.config.m, faiss.METRIC_INNER_PRODUCT)
                graph.hnsw.efConstruction = self.config.ef_construction
                graph.hnsw.efSearch = self.config.ef_search
                faiss.omp_set_num_threads(self.config.build_threads)  # this thread's builds only
                graph.add(vectors[:len(idx)])
            with self._lock:
                self._swap(n0, idx, vectors, keys, questions, graph)
        except Exception:  # noqa: BLE001 - the partition stays searchable (exactly or with the old graph)
            log.exception("semantic index rebuild failed")
        finally:
            with self._lock:
                self.building = False
                self.reserved = 0

    def _swap(self, n0: int, idx: np.ndarray, vectors: np.ndarray, keys: list[str], questions: list[str],
              graph: Any) -> None:
        g, n = len(idx), self.n
        alive = np.concatenate([self.alive[idx], self.alive[n0:n]])
        expires = np.concatenate([self.expires[idx], self.expires[n0:n]])
        row_of = {k: i for i, k in enumerate(keys)}
        for j in np.flatnonzero(~alive[:g]):  # removed while the graph was being built
            del row_of[keys[j]]
        for old in range(n0, n):  # added while the graph was being built (the tail)
            if self.alive[old]:
                row_of[self.keys[old]] = g + old - n0
        keys.extend(self.keys[n0:n])
        questions.extend(self.questions[n0:n])
        if len(vectors) < len(keys):
            grown = np.zeros((len(keys) + grow_step(len(keys)), self.dim), dtype=np.float32)
            grown[:g] = vectors[:g]
            vectors = grown
        vectors[g:len(keys)] = self.vectors[n0:n]
        cap = len(vectors)
        self.vectors = vectors
        self.expires = np.zeros(cap, dtype=np.float64)
        self.expires[:len(keys)] = expires
        self.alive = np.zeros(cap, dtype=bool)
        self.alive[:len(keys)] = alive
        self.keys, self.questions, self.row_of = keys, questions, row_of
        self.dead = int(len(keys) - alive.sum())
        self.dead_graph = int(g - alive[:g].sum()) if graph is not None else 0
        self.text_bytes = sum(str_bytes(k) + str_bytes(q) for k, q in zip(keys, questions, strict=True))
        self.dead_text = sum(str_bytes(keys[j]) + str_bytes(questions[j]) for j in np.flatnonzero(~alive))
        self.graph, self.graph_rows = graph, (g if graph is not None else 0)
        self.builds += 1

    def wait_until(self, deadline: float) -> bool:
        """Polls until no build is in flight or ``deadline`` (monotonic) passes; True when idle."""
        while time.monotonic() < deadline:
            with self._lock:
                if not self.building:
                    return True
            time.sleep(0.01)
        return False
