"""The cache's Prometheus metrics, and the per-tenant tally :meth:`ResponseCache.stats` reports."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["LOOKUP_BUCKETS", "CacheMetrics", "Tally"]

LOOKUP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


@dataclass
class Tally:
    hits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    misses: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens_saved: int = 0
    gpu_seconds_saved: float = 0.0
    degraded: int = 0


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.lookups = Counter("goodput_cache_lookups_total", "Lookups by layer, result and tenant "
                               "(result: hit, miss, error, guarded = an L2 candidate vetoed by the near-miss guard, "
                               "ambiguous = an L2 miss because two cached answers differ and match about equally).",
                               ["layer", "result", "tenant"], registry=registry)
        self.lookup_seconds = Histogram("goodput_cache_lookup_seconds", "Lookup latency by layer.", ["layer"],
                                        buckets=LOOKUP_BUCKETS, registry=registry)
        self.stores = Counter("goodput_cache_stores_total", "Store calls by result (stored or the reason not).",
                              ["result"], registry=registry)
        self.tokens_saved = Counter("goodput_cache_tokens_saved_total", "Completion tokens served from the cache.",
                                    ["tenant"], registry=registry)
        self.gpu_seconds_saved = Counter("goodput_cache_gpu_seconds_saved_total", "Estimated accelerator seconds "
                                         "the hits saved.", ["tenant"], registry=registry)
        self.degraded = Counter("goodput_cache_degraded_total", "Calls answered without a store that was down "
                                "(fail-open).", ["store"], registry=registry)
        self.evictions = Counter("goodput_cache_evictions_total", "Entries removed by reason.", ["reason"],
                                 registry=registry)
        self.embeddings = Counter("goodput_cache_embeddings_total", "Questions vectorised for L2, by source: "
                                  "model (embedded) or memo (the vector of a recent lookup or store reused).",
                                  ["source"], registry=registry)
        self.verifications = Counter("goodput_cache_verifications_total", "L2 lookups the verifier judged, by "
                                     "verdict: same (a verified hit), different (refused), skipped (over its time).",
                                     ["verdict", "tenant"], registry=registry)
        self.verifier_probability = Histogram("goodput_cache_verifier_probability", "The verifier's probability "
                                              "of the best candidate it read.", buckets=(
                                                  0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
                                              registry=registry)
        self.verifier_seconds = Histogram("goodput_cache_verifier_seconds", "Time of one verification (all the "
                                          "candidates of a lookup in one model call).", buckets=LOOKUP_BUCKETS,
                                          registry=registry)
        self.entries = Gauge("goodput_cache_semantic_entries", "Entries in the L2 index of this process.",
                             registry=registry)
        self.semantic_bytes = Gauge("goodput_cache_semantic_bytes", "Memory the L2 index holds (its accountant's "
                                    "estimate: rows, graphs, strings, bookkeeping; a graph rebuild in flight "
                                    "included).", registry=registry)
        self.semantic_budget = Gauge("goodput_cache_semantic_budget_bytes", "The L2 index's memory budget "
                                     "(MAX_L2_BYTES).", registry=registry)
        self.partitions = Gauge("goodput_cache_semantic_partitions", "L2 partitions holding at least one entry.",
                                registry=registry)
        self.semantic_evictions = Counter("goodput_cache_semantic_evictions_total", "Entries that left the L2 "
                                          "index only (Redis keeps them for L1), by reason: budget (least recently "
                                          "used, over MAX_L2_BYTES), expired (the same, past its TTL), "
                                          "partition_full (MAX_PARTITION_ENTRIES).", ["reason"], registry=registry)
        self.restored = Counter("goodput_cache_semantic_restored_total", "Entries a start loaded from Redis into "
                                "L2 (the most recently used first, up to MAX_L2_BYTES).", registry=registry)
