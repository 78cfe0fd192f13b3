"""The L2 index above the HNSW threshold: recall against the exact scan, tombstones (removal, expiry, capacity
eviction), background rebuilds, partition isolation and the same results as the exact index. No timing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from goodput_cache.ann import AnnPartition
from goodput_cache.semantic import AnnConfig, NumpyIndex

DIM = 64
SMALL = AnnConfig(min_entries=200, m=16, ef_construction=40, ef_search=64, rebuild_fraction=0.1, build_threads=1)


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def near(rng: np.random.Generator, v: np.ndarray, noise: float = 0.25) -> np.ndarray:
    """A paraphrase-like neighbour: cosine ~0.97 with ``v``."""
    return unit(v + noise * rng.standard_normal(v.shape).astype(np.float32) / np.sqrt(v.shape[-1]))


def fill(index: NumpyIndex, vectors: np.ndarray, partition: str = "p", *, ttl: float = 3600, tag: str = "k") -> None:
    for i, v in enumerate(vectors):
        index.add(partition, f"{tag}{i}", v, question=f"q{tag}{i}", expires=time.time() + ttl)


def clustered(rng: np.random.Generator, n: int, clusters: int = 40) -> np.ndarray:
    centres = unit(rng.standard_normal((clusters, DIM)))
    return unit(centres[rng.integers(0, clusters, n)] + 0.6 * rng.standard_normal((n, DIM)) / np.sqrt(DIM))


def graph_of(index: NumpyIndex, partition: str = "p") -> AnnPartition:
    part = index._parts[partition]
    assert isinstance(part, AnnPartition)
    return part


@pytest.mark.parametrize("kind", ["random", "clustered"])
def test_top1_agrees_with_the_exact_scan(kind: str) -> None:
    rng = np.random.default_rng(7)
    n = 3000
    vectors = unit(rng.standard_normal((n, DIM))) if kind == "random" else clustered(rng, n)
    ann, exact = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL), NumpyIndex(dim=DIM, max_per_partition=10_000)
    fill(ann, vectors)
    fill(exact, vectors)
    assert ann.settle(120, complete=True)
    part = graph_of(ann)
    assert part.graph is not None and part.graph_rows == n  # the whole partition is in the graph: no exact tail
    queries = [near(rng, vectors[i]) for i in rng.integers(0, n, 300)]
    agree = sum(a[0].key == b[0].key for q in queries
                if (a := ann.search("p", q, k=4, min_similarity=0.5)) and (b := exact.search("p", q, k=4,
                                                                                            min_similarity=0.5)))
    assert agree / len(queries) >= 0.98


def test_same_results_interface_and_exact_scores() -> None:
    rng = np.random.default_rng(1)
    vectors = clustered(rng, 1000)
    ann, exact = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL), NumpyIndex(dim=DIM, max_per_partition=10_000)
    fill(ann, vectors)
    fill(exact, vectors)
    assert ann.settle(60, complete=True)
    for i in range(0, 1000, 50):
        q = near(rng, vectors[i])
        a, b = ann.search("p", q, k=4, min_similarity=0.9), exact.search("p", q, k=4, min_similarity=0.9)
        assert [c.similarity for c in a] == sorted((c.similarity for c in a), reverse=True)
        assert all(c.similarity >= 0.9 for c in a)
        for c in a:  # every similarity is the exact cosine of the stored vector
            j = int(c.key[1:])
            assert c.similarity == pytest.approx(float(vectors[j] @ q), abs=1e-5)
            assert c.question == f"qk{j}"
        assert a[0] == b[0]
    assert len(ann) == len(exact) == 1000


def test_small_partitions_stay_exact_and_large_ones_are_promoted() -> None:
    rng = np.random.default_rng(2)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, unit(rng.standard_normal((SMALL.min_entries - 1, DIM))), "small", tag="s")
    fill(index, unit(rng.standard_normal((SMALL.min_entries, DIM))), "big", tag="b")
    assert index.settle(60, complete=True)
    assert not isinstance(index._parts["small"], AnnPartition)
    assert graph_of(index, "big").graph is not None
    assert NumpyIndex(dim=DIM, max_per_partition=10).ann is None  # without a config everything stays exact


def test_removed_entries_are_never_returned_and_tombstones_trigger_a_rebuild() -> None:
    rng = np.random.default_rng(3)
    vectors = clustered(rng, 1000)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, vectors)
    assert index.settle(60, complete=True)
    part = graph_of(index)
    builds = part.builds
    assert index.remove(["k5"]) == 1 and index.remove(["k5"]) == 0
    hits = index.search("p", vectors[5], k=4, min_similarity=0.0)
    assert hits and all(c.key != "k5" for c in hits)
    assert part.dead == 1  # a tombstone, still in the graph
    gone = [f"k{i}" for i in range(10, 300)]
    assert index.remove(gone) == len(gone)
    assert part.building or part.builds > builds  # over rebuild_fraction of the graph: a rebuild started by itself
    assert index.settle(60, complete=True)
    assert part.builds > builds and part.dead == 0 and part.graph_rows == len(index) == 1000 - 1 - len(gone)
    for i in [5, *range(10, 300, 7)]:
        assert all(c.key not in gone and c.key != "k5" for c in index.search("p", vectors[i], k=4,
                                                                            min_similarity=0.0))
    # the survivors are still found after the rebuild compacted the rows
    for i in range(300, 1000, 37):
        assert index.search("p", near(rng, vectors[i], 0.05), k=1, min_similarity=0.9)[0].key == f"k{i}"


def test_expired_entries_are_masked() -> None:
    rng = np.random.default_rng(4)
    vectors = clustered(rng, 600)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, vectors[:500])
    fill(index, vectors[500:], ttl=-1, tag="old")  # already expired
    assert index.settle(60, complete=True)
    for i in range(500, 600, 5):
        assert all(not c.key.startswith("old") for c in index.search("p", vectors[i], k=4, min_similarity=0.0))
    assert index.search("p", vectors[10], k=1, min_similarity=0.99)[0].key == "k10"


def test_entries_added_after_the_build_are_found_at_once_and_rebuilt_in() -> None:
    rng = np.random.default_rng(5)
    vectors = clustered(rng, 800)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, vectors[:600])
    assert index.settle(60, complete=True)
    part = graph_of(index)
    assert part.graph_rows == 600
    index.add("p", "new", vectors[700], question="new question", expires=time.time() + 60)
    assert part.n - part.graph_rows == 1  # in the exactly scanned tail until the next build
    assert index.search("p", vectors[700], k=1, min_similarity=0.99)[0].key == "new"
    # re-adding a key replaces its vector (the old row becomes a tombstone)
    index.add("p", "k3", vectors[701], question="moved", expires=time.time() + 60)
    assert index.search("p", vectors[701], k=1, min_similarity=0.99)[0].question == "moved"
    assert all(c.key != "k3" for c in index.search("p", vectors[3], k=4, min_similarity=0.99))
    for i in range(100):
        index.add("p", f"more{i}", vectors[600 + i], question="", expires=time.time() + 60)
    assert index.settle(60, complete=True)
    assert part.graph_rows == len(index) == 701 and part.n == 701
    assert index.search("p", vectors[701], k=1, min_similarity=0.99)[0].question == "moved"


def test_partitions_are_isolated() -> None:
    rng = np.random.default_rng(6)
    vectors = clustered(rng, 500)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, vectors, "acme", tag="a")
    fill(index, vectors, "globex", tag="g")
    assert index.settle(60, complete=True)
    assert index.partitions() == 2
    for i in range(0, 500, 25):
        assert {c.key[0] for c in index.search("acme", vectors[i], k=4, min_similarity=0.0)} == {"a"}
        assert {c.key[0] for c in index.search("globex", vectors[i], k=4, min_similarity=0.0)} == {"g"}
    assert index.search("initech", vectors[0], k=4, min_similarity=0.0) == []


def test_a_full_partition_evicts_the_oldest_expiring_entry() -> None:
    rng = np.random.default_rng(8)
    vectors = unit(rng.standard_normal((401, DIM)))
    index = NumpyIndex(dim=DIM, max_per_partition=400, ann=SMALL)
    now = time.time()
    for i in range(400):
        index.add("p", f"k{i}", vectors[i], question="", expires=now + 1000 + (0 if i == 123 else i + 10))
    index.add("p", "last", vectors[400], question="", expires=now + 5000)
    assert len(index) == 400
    assert index.search("p", vectors[123], k=1, min_similarity=0.99) == []
    assert index.search("p", vectors[400], k=1, min_similarity=0.99)[0].key == "last"
    assert index.settle(60, complete=True)
    assert index.search("p", vectors[124], k=1, min_similarity=0.99)[0].key == "k124"


def test_emptying_a_large_partition_drops_it() -> None:
    rng = np.random.default_rng(9)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, unit(rng.standard_normal((300, DIM))))
    assert index.settle(60, complete=True)
    assert index.remove([f"k{i}" for i in range(300)]) == 300
    assert len(index) == 0 and index.partitions() == 0
    assert index.settle(60, complete=True)
    assert index.search("p", unit(rng.standard_normal(DIM)), k=4, min_similarity=0.0) == []


def test_concurrent_searches_adds_and_removals() -> None:
    rng = np.random.default_rng(10)
    vectors = clustered(rng, 2000)
    index = NumpyIndex(dim=DIM, max_per_partition=10_000, ann=SMALL)
    fill(index, vectors[:1000])
    errors: list[BaseException] = []

    def searcher() -> None:
        try:
            for i in range(300):
                for c in index.search("p", vectors[i % 1000], k=4, min_similarity=0.0):
                    assert c.key.startswith("k")
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(1000, 2000):  # adds (and rebuilds they trigger) while searching
        index.add("p", f"k{i}", vectors[i], question="", expires=time.time() + 60)
        if i % 3 == 0:
            index.remove([f"k{i - 1000}"])
    for t in threads:
        t.join()
    assert not errors
    assert index.settle(60, complete=True)
    live = {f"k{i}" for i in range(2000) if not (i < 1000 and (i + 1000) % 3 == 0)}
    assert len(index) == len(live)
    for i in range(1000, 2000, 41):
        assert index.search("p", vectors[i], k=1, min_similarity=0.99)[0].key == f"k{i}"
