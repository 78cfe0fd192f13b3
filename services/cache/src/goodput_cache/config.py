"""Cache settings (env prefix GOODPUT_CACHE_)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from goodput_contracts import DEFAULT_CHANNEL, DEFAULT_KEY_PREFIX
from goodput_core.settings import ServiceSettings, service_config

from goodput_cache.ann import AnnConfig

# Chosen by the evaluation (loadtests/reports/cache_eval.md): the lowest threshold within 0.92-0.97 whose wrong-hit
# share on GPTCache's mock pairs is <= 1% with the guard and the ambiguity margin (0.92: 306 hits, 1 wrong of 500).
DEFAULT_THRESHOLD = 0.92
# A lookup whose two best candidates (with different answers) are within this much similarity is a miss. Chosen from
# the same evaluation (margins 0-0.03 swept): at 0.02 the mock pairs' near-tie confusions are gone (13 wrong hits of
# 410 -> 2 of 387 at 0.88) for 12 fewer correct hits; 0.03 removes no more.
DEFAULT_AMBIGUITY_MARGIN = 0.02
# With a verifier, L2 candidates from this cosine similarity up are read by the cross-encoder (chosen on the
# validation part of QQP, PAWS and MRPC: loadtests/reports/cache_eval.md, "verifier").
DEFAULT_VERIFY_MIN_SIMILARITY = 0.80


class CacheSettings(ServiceSettings):
    model_config = service_config("GOODPUT_CACHE_")

    grpc_port: int = 50055
    http_port: int = 9105
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the cache entries (they "
                                                                   "survive a restart of this service).")
    kb_redis_url: str = Field("", description="Redis of the indexer's knowledge-base versions (their keys and "
                              "the version channel) when the entries have a Redis of their own; empty = redis_url.")
    redis_timeout_s: float = Field(0.25, gt=0, description="Timeout of one Redis call; slower counts as down "
                                                           "and the request is served uncached.")
    breaker_s: float = Field(2.0, ge=0, description="After a Redis failure, lookups skip Redis (answer a "
                                                    "degraded miss) for this long before trying again.")
    key_prefix: str = Field("goodput:cache", description="Prefix of every Redis key this service writes.")
    kb_key_prefix: str = Field(DEFAULT_KEY_PREFIX, description="Key prefix of the indexer: the current version of a "
                                                      "knowledge base is `<prefix>:kb:<tenant>:<kb>:version`.")
    version_channel: str = Field(DEFAULT_CHANNEL, description="Redis pub/sub channel on which the indexer "
                                                                   "publishes knowledge-base versions.")
    embedder_addr: str = Field("", description="Embedding service (gRPC); empty = the same model in-process.")
    embedder_timeout_s: float = Field(1.0, gt=0, description="Embedding service: deadline of one call; a slower "
                                      "or failed call skips L2 for that lookup (or stores the entry for L1 only).")
    embedder_model_path: str = Field("", description="In-process model: an ONNX file; empty = the packaged "
                                                     "all-MiniLM-L6-v2 int8 model.")
    embedder_threads: int = Field(2, ge=1, description="In-process model: CPU threads of one embedding (one "
                                                       "question at a time). Embedding the question is most of an L2 "
                                                       "lookup's time on CPU; a second thread cuts its p99 by about "
                                                       "a quarter. Set it to the CPUs the cache pod is given.")
    embedder_spin: bool = Field(False, description="In-process model: idle onnxruntime threads busy-wait for the "
                                "next question instead of sleeping. Off by default: spinning threads keep the "
                                "cores from Redis and the event loop right after each embedding: on 2 cores the L2 "
                                "lookup's p99 was ~40% higher and the exact lookup's ~3x (cache_latency reports).")
    vector_memo_entries: int = Field(4096, ge=0, description="Questions whose vectors are remembered (~1.6 KiB "
                                     "each), so the store that follows a missed lookup does not embed the question "
                                     "again; 0 = off.")
    threshold: float = Field(DEFAULT_THRESHOLD, ge=0.5, le=1.0, description="L2 cosine-similarity threshold.")
    tenant_thresholds: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict, description='Per-tenant L2 thresholds, JSON: {"acme": 0.97}.')
    tenants: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Known tenants, comma-separated; empty = any well-formed tenant. "
                                          "A request for another tenant is refused.")
    guard: bool = Field(True, description="Near-miss guard on L2 hits (negation, numbers, dates, entities).")
    ambiguity_margin: float = Field(DEFAULT_AMBIGUITY_MARGIN, ge=0, le=0.2, description="An L2 lookup is a miss "
                                    "when a second entry with another answer is within this much similarity of "
                                    "the best one (the question fits both; the cache does not guess); 0 = off.")
    semantic: bool = Field(True, description="Enable the L2 semantic layer.")
    # ---- the verifier: a cross-encoder that reads the new and the cached question together ----
    verifier: Literal["auto", "cross-encoder", "none"] = Field(
        "auto", description="`auto`: verify L2 hits with the cross-encoder in `verifier_model` when that folder "
                            "exists, else the similarity rule alone; `cross-encoder`: required (start fails without "
                            "it); `none`: off.")
    verifier_model: str = Field("", description="A Hugging Face sequence-classification folder: what `goodput train "
                                                "verifier` writes (a paraphrase cross-encoder).")
    verifier_backend: Literal["auto", "onnx", "torch"] = Field(
        "auto", description="`auto`: the folder's int8 ONNX export on CPU, torch otherwise (GPU).")
    verifier_device: str = Field("cpu", description="torch device of the verifier.")
    verifier_threads: int = Field(1, ge=0, description="CPU threads of one verification (a few short pairs: one "
                                                       "thread is as fast and leaves the other cores alone); 0 = "
                                                       "onnxruntime's default.")
    verify_threshold: float = Field(0.0, ge=0, le=1, description="Probability from which the verifier's 'same "
                                    "question' is accepted; 0 = the threshold in the model's card (chosen on the "
                                    "validation pairs for 95% precision).")
    verify_min_similarity: float = Field(DEFAULT_VERIFY_MIN_SIMILARITY, ge=0.5, le=1.0, description="With a "
                                         "verifier: the lower similarity bound of the L2 candidates it reads (it "
                                         "replaces `threshold` and the per-tenant thresholds as the cosine cut; a "
                                         "lookup's own threshold still replaces it).")
    verify_with_guard: bool = Field(True, description="With a verifier: the near-miss guard still vetoes "
                                                      "candidates before the model reads them (when `guard` is on).")
    verify_timeout_s: float = Field(0.05, gt=0, description="Longest a verification may take; a slower one is a "
                                                            "miss (counted as verdict `skipped`).")
    max_entries: int = Field(100_000, ge=1, description="Entries kept (all tenants); the least recently used "
                                                        "are evicted beyond it.")
    max_partition_entries: int = Field(100_000, ge=1, description="L2 entries searched per partition.")
    max_l2_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024, description="Memory budget of the L2 index, all "
                              "partitions together (~2.3 KiB per entry of a small partition, ~4 KiB of one searched "
                              "through HNSW): beyond it the least recently used entries of any partition leave L2 "
                              "(L1 in Redis keeps them), and a restart loads the most recent entries up to it. The "
                              "default fits the chart's 1 GiB memory limit with the embedding model beside it.")
    ann_min_entries: int = Field(4096, ge=1, description="L2 partitions with at least this many entries are "
                                                         "searched through an HNSW graph (approximate, re-scored "
                                                         "exactly); smaller ones by an exact scan.")
    ann_m: int = Field(32, ge=4, le=256, description="HNSW links per entry (recall and memory grow with it).")
    ann_ef_construction: int = Field(40, ge=8, description="HNSW candidate list while building (build time and "
                                                           "graph quality grow with it).")
    ann_ef_search: int = Field(64, ge=4, description="HNSW candidate list per search (recall and latency grow "
                                                     "with it).")
    ann_rebuild_fraction: float = Field(0.1, gt=0, le=1.0, description="A partition's graph is rebuilt in the "
                                        "background when entries added since the last build (scanned exactly "
                                        "meanwhile) or removed ones reach this share of it.")
    ann_build_threads: int = Field(1, ge=1, description="CPU threads of one background graph build.")
    max_entry_bytes: int = Field(256 * 1024, ge=1024, description="Largest answer stored; larger is refused.")
    max_query_chars: int = Field(65_536, ge=1, description="Largest conversation (characters) accepted.")
    ttl_chat_s: int = Field(86_400, ge=1, description="TTL of chat/completion answers.")
    ttl_rag_s: int = Field(3_600, ge=1, description="TTL of RAG answers (also dropped on a KB version bump).")
    ttl_time_sensitive_s: int = Field(0, ge=0, description="TTL of time-sensitive questions ('today', 'latest', "
                                                           "prices); 0 = never cached. Never served from L2.")
    max_ttl_s: int = Field(7 * 86_400, ge=1, description="Largest TTL a caller may ask for.")
    gpu_seconds_per_token: float = Field(0.02, ge=0, description="Estimated accelerator seconds one generated "
                                                                 "token costs (for the saved-GPU-time metric).")

    @field_validator("tenant_thresholds", mode="before")
    @classmethod
    def _thresholds(cls, value: object) -> object:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if isinstance(value, dict):
            for tenant, t in value.items():
                if not 0.5 <= float(t) <= 1.0:
                    raise ValueError(f"threshold of tenant {tenant!r} must be within 0.5..1.0, got {t}")
        return value

    @field_validator("tenants", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    def ann_config(self) -> AnnConfig:
        return AnnConfig(min_entries=self.ann_min_entries, m=self.ann_m, ef_construction=self.ann_ef_construction,
                         ef_search=self.ann_ef_search, rebuild_fraction=self.ann_rebuild_fraction,
                         build_threads=self.ann_build_threads)

    def threshold_for(self, tenant: str) -> float:
        return float(self.tenant_thresholds.get(tenant, self.threshold))
