"""The L2 index stays within one memory budget across all its partitions: lazy partitions that grow by small steps,
one least-recently-used order over every partition, 100k partitions within the budget (the accountant's bytes held
against tracemalloc and the process's RSS), and a restart over a Redis holding more than the budget."""

from __future__ import annotations

import gc
import hashlib
import os
import time
import tracemalloc
from collections import Counter
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from goodput_cache.ann import AnnPartition
from goodput_cache.cache import Answer
from goodput_cache.exact import Entry
from goodput_cache.memory import PARTITION_BYTES
from goodput_cache.semantic import AnnConfig, NumpyIndex

from .conftest import ask

MiB = 1 << 20
DIM = 384


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def h(text: str, n: int = 64) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def counting(evictions: Counter[str]) -> Any:
    return lambda reason, n: evictions.update({reason: n})


def test_a_partition_costs_nothing_before_its_first_entry_grows_by_steps_and_goes_with_its_last() -> None:
    rng = np.random.default_rng(1)
    index = NumpyIndex(dim=DIM, max_per_partition=1000, max_bytes=8 * MiB)
    assert index.bytes_used() == 0 and index.search("p", unit(rng, 1)[0], k=4, min_similarity=0.0) == []
    assert index.partitions() == 0  # a search does not create one
    v = unit(rng, 40)
    index.add("p", "k0", v[0], question="q", expires=time.time() + 60)
    one = index.bytes_used()
    assert index.partitions() == 1 and one < PARTITION_BYTES + 3 * 1024  # one row, not a preallocated block
    for i in range(1, 40):
        index.add("p", f"k{i}", v[i], question="q", expires=time.time() + 60)
    assert 40 * 4 * DIM < index.bytes_used() < 1.6 * 40 * (4 * DIM + 500)  # spare rows: at most half while small
    assert index.remove([f"k{i}" for i in range(1, 40)]) == 39
    assert index.bytes_used() < 2 * one  # the rows went back as it shrank
    assert index.remove(["k0"]) == 1
    assert index.partitions() == 0 and index.bytes_used() == 0


def test_one_least_recently_used_order_over_all_partitions() -> None:
    rng = np.random.default_rng(2)
    evictions: Counter[str] = Counter()
    v = unit(rng, 200)
    probe = NumpyIndex(dim=DIM, max_per_partition=1000)
    for i in range(100):
        probe.add(f"p{i % 10}", f"k{i}", v[i], question="How do I reset my password?", expires=time.time() + 60)
    budget = probe.bytes_used()  # what 100 entries in 10 partitions cost
    index = NumpyIndex(dim=DIM, max_per_partition=1000, max_bytes=budget, on_evict=counting(evictions))
    now = time.time()
    for i in range(100):
        index.add(f"p{i % 10}", f"k{i}", v[i], question="How do I reset my password?",
                  expires=now + (-1 if i == 7 else 60))
    assert len(index) == 100 and not evictions
    index.touch("k0")  # served: the most recently used now
    for i in range(100, 150):  # a new partition fills up: the oldest entries of the others make room
        assert index.add("fresh", f"k{i}", v[i], question="How do I reset my password?", expires=now + 60)
        assert index.bytes_used() <= budget
    def held(i: int) -> bool:
        return bool(index.search("fresh" if i >= 100 else f"p{i % 10}", v[i], k=1, min_similarity=0.99))

    assert held(0) and not held(1)  # k0 was served lately; k1 was the least recently used
    assert all(held(i) for i in range(100, 150))
    assert len(index) == sum(held(i) for i in range(150) if i != 7)
    assert evictions["expired"] == 1 and evictions["budget"] >= 40  # k7 was past its TTL (and never served)


def test_a_cold_add_never_evicts_and_says_when_the_budget_is_full() -> None:
    rng = np.random.default_rng(3)
    evictions: Counter[str] = Counter()
    index = NumpyIndex(dim=DIM, max_per_partition=1000, max_bytes=64 * 1024, on_evict=counting(evictions))
    v = unit(rng, 100)
    held = 0
    for i in range(100):  # the most recent first, as a restart loads them
        if not index.add(f"p{i % 3}", f"k{i}", v[i], question="q", expires=time.time() + 60, cold=True):
            break
        held += 1
    assert 10 < held < 100 and index.bytes_used() <= 64 * 1024
    assert evictions["budget"] <= 3  # at most the spare rows of the last step, never everything then evicting
    assert index.search("p0", v[0], k=1, min_similarity=0.99)[0].key == "k0"  # the most recent is held
    # a normal add evicts the coldest (the last loaded) to make room
    assert index.add("p0", "new", v[99], question="q", expires=time.time() + 60)


def test_a_large_partition_gives_its_evicted_rows_back_and_stays_within_the_budget() -> None:
    rng = np.random.default_rng(4)
    small = AnnConfig(min_entries=200, m=16, ef_construction=40, ef_search=64, rebuild_fraction=0.1)
    evictions: Counter[str] = Counter()
    budget = 2 * MiB
    index = NumpyIndex(dim=64, max_per_partition=100_000, ann=small, max_bytes=budget, on_evict=counting(evictions))
    v = unit(rng, 12_000, 64)
    for i in range(len(v)):
        index.add("big", f"k{i}", v[i], question=f"question {i}", expires=time.time() + 60)
        assert index.bytes_used() - index._transient <= budget  # noqa: SLF001 - what the budget holds against
    assert evictions["budget"] > 0
    assert index.settle(120, complete=True)
    assert index.bytes_used() <= budget and index._transient == 0  # noqa: SLF001 - rebuilt: no tombstones left
    assert index.search("big", v[-1], k=1, min_similarity=0.99)[0].key == f"k{len(v) - 1}"
    assert index.search("big", v[0], k=1, min_similarity=0.99) == []


def test_a_large_partition_that_shrank_is_scanned_exactly_again() -> None:
    rng = np.random.default_rng(7)
    small = AnnConfig(min_entries=200, m=16, ef_construction=40, ef_search=64, rebuild_fraction=0.1)
    index = NumpyIndex(dim=64, max_per_partition=100_000, ann=small, max_bytes=8 * MiB)
    v = unit(rng, 300, 64)
    for i in range(300):
        index.add("p", f"k{i}", v[i], question="q", expires=time.time() + 60)
    assert index.settle(60, complete=True)
    big = index.bytes_used()
    assert isinstance(index._parts["p"], AnnPartition)  # noqa: SLF001
    assert index.remove([f"k{i}" for i in range(250)]) == 250  # below half of min_entries: packed rows, no graph
    assert not isinstance(index._parts["p"], AnnPartition)  # noqa: SLF001
    assert index.bytes_used() < big / 4 and index._transient == 0  # noqa: SLF001
    assert all(index.search("p", v[i], k=1, min_similarity=0.99)[0].key == f"k{i}" for i in range(250, 300))


@pytest.mark.slow
def test_100k_partitions_stay_within_the_budget() -> None:
    """100k partitions of 1-3 entries each (all-MiniLM's 384 dimensions): the accountant holds the index within the
    budget all along, tracemalloc sees what the accountant charges (give or take), the RSS grows by a bounded amount
    (the old index preallocated 16 rows, 24 KiB, per partition: 2.4 GB here) and the newest partitions answer."""
    budget = 32 * MiB
    rng = np.random.default_rng(5)
    pool = unit(rng, 1024)
    evictions: Counter[str] = Counter()
    index = NumpyIndex(dim=DIM, max_per_partition=100_000, ann=AnnConfig(), max_bytes=budget,
                       on_evict=counting(evictions))
    rss = _rss()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        expires = time.time() + 3600
        adds = 0
        for p in range(100_000):
            partition = h(f"partition {p}", 32)
            for e in range(p % 3 + 1):
                index.add(partition, h(f"{p}/{e}"), pool[adds % len(pool)],
                          question=f"How do I reset the password of account {p}, case {e}?", expires=expires)
                adds += 1
            if p % 5000 == 0:
                assert index.bytes_used() <= budget, p
        gc.collect()
        traced, peak = (x - base for x in tracemalloc.get_traced_memory())
    finally:
        tracemalloc.stop()
    after = _rss()
    grown = after - rss if after is not None and rss is not None else 0
    held = index.bytes_used()
    print(f"\n100k partitions, {adds} adds: {len(index)} entries in {index.partitions()} partitions held, "
          f"accounted {held / MiB:.1f} MiB of {budget / MiB:.0f}, traced {traced / MiB:.1f} MiB (peak "
          f"{peak / MiB:.1f}), RSS +{grown / MiB:.0f} MiB, evictions {dict(evictions)}")
    assert held <= budget and held > 0.9 * budget  # full, not over
    assert 0.8 * held <= traced <= 1.1 * held + MiB  # the accountant's estimate is what Python and numpy allocate
    assert peak <= 1.2 * budget + 4 * MiB
    assert grown <= 3 * budget + 64 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    assert evictions["budget"] == adds - len(index)
    last = h("partition 99999", 32)
    assert index.search(last, pool[(adds - 1) % len(pool)], k=1, min_similarity=0.99)[0].key == h("99999/0")
    assert index.search(h("partition 0", 32), pool[0], k=1, min_similarity=0.0) == []  # the oldest left
    assert index.partitions() <= len(index)  # no empty partition kept


def _rss() -> int | None:
    """The process's resident memory (Linux /proc; None elsewhere: tracemalloc's check still runs)."""
    gc.collect()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


PASSWORD = "How do I reset my password?"
ANSWER = Answer(text="Open Settings, then Security, then Reset password.", completion_tokens=12)


async def test_a_restart_over_more_than_the_budget_loads_the_most_recent_entries_up_to_it(make_cache: Any) -> None:
    budget = 2 * MiB
    first = make_cache(max_l2_bytes=budget)
    rng = np.random.default_rng(6)
    fillers = unit(rng, 3000)
    for i, vec in enumerate(fillers):  # older entries of other conversations, ~7 MiB of L2 in all
        entry = Entry(key=h(f"filler {i}"), tenant="acme", partition=h(f"filler partition {i % 1500}", 32),
                      model="smollm2", model_version="1", question=f"filler question {i}", text="an answer")
        await first.l1.put(entry, vector=vec, ttl_s=3600, max_entries=100_000)
    recent = [PASSWORD, "Where can I download my invoices?", "How do I delete my account?"]
    for question in recent:
        assert (await first.store(ask(question), ANSWER)).stored
    await first.stop()

    registry = CollectorRegistry()
    restarted = make_cache(registry, max_l2_bytes=budget)
    await restarted.start()
    try:
        sample = registry.get_sample_value
        held = restarted.index.bytes_used()
        assert held <= budget and sample("goodput_cache_semantic_bytes") == held
        assert sample("goodput_cache_semantic_budget_bytes") == budget
        assert 300 < len(restarted.index) < 3000  # up to the budget, not everything
        assert sample("goodput_cache_semantic_restored_total") == len(restarted.index)
        # the load stopped at the budget: it did not load everything and evict the excess
        assert (sample("goodput_cache_semantic_evictions_total", {"reason": "budget"}) or 0) <= 3
        for question, paraphrase in zip(recent, ["How can I reset my password?",
                                                 "Where do I download my invoices?",
                                                 "How can I delete my account?"], strict=True):
            hit = await restarted.lookup(ask(paraphrase))
            assert hit.hit and hit.layer == "l2" and hit.matched_query == question, paraphrase
        # the oldest entries stayed out of L2; Redis still has them for exact repeats
        assert restarted.index.search(h("filler partition 0", 32), fillers[0], k=1, min_similarity=0.99) == []
        assert await restarted.l1.get(h("filler 0")) is not None
    finally:
        await restarted.stop()
