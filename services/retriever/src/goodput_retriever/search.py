"""Hybrid search and the write side of the stores, with no gRPC server imports (the servicers are thin).

Search: validate → the dense leg (embed the query, then the vector store) and the lexical leg (BM25) run in
parallel, each under ``leg_timeout_s`` → fusion (RRF or weighted) → optional rerank (the fused top
``rerank_candidates`` through the cross-encoder, the best ``rerank_top_n`` kept) → top_k. A rerank that has no model,
would overrun the request's deadline or rerank budget, or fails is skipped: the fused order is served and
``SearchResult.rerank`` says why. One leg failing or
timing out gives the other's results with ``degraded`` set and a note; both failing is UNAVAILABLE. Every query
is scoped to the caller's tenant and knowledge base.

Example::

    retriever = Retriever(settings, vectors=QdrantStore(), lexical=TantivyIndex(":memory:"), embedder=emb)
    result = await retriever.search(SearchQuery(tenant="acme", kb="handbook", query="refund policy"))
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from goodput_core.errors import InvalidArgument, NotFound, Unavailable
from goodput_core.metrics import LATENCY_BUCKETS

from goodput_retriever.config import RetrieverSettings
from goodput_retriever.fusion import Hit, rrf, weighted
from goodput_retriever.rerank import DeadlineExceeded, Reranker
from goodput_retriever.stores import LexicalIndex, StoredChunk, VectorStore, new_generation

__all__ = ["LegTiming", "QueryEmbedder", "RerankInfo", "Retriever", "SearchQuery", "SearchResult", "validate_name"]

log = logging.getLogger("goodput.retriever")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FUSIONS = ("rrf", "weighted", "dense", "lexical")


def validate_name(value: str, param: str) -> str:
    if not value or not NAME_RE.match(value):
        raise InvalidArgument(f"'{param}' must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                              f"digit (got {value[:80]!r})", param=param, code="invalid_value")
    return value


class QueryEmbedder(Protocol):
    async def embed_query(self, text: str) -> Sequence[float]: ...


@dataclass(frozen=True)
class SearchQuery:
    tenant: str
    kb: str
    query: str
    top_k: int = 0
    fusion: str = ""  # "rrf", "weighted", "dense", "lexical"; empty = the default
    dense_weight: float | None = None
    recall_k: int = 0
    rerank: bool = False
    leg_budget_s: float = 0.0  # the caller's budget per leg; 0 = leg_timeout_s alone
    rerank_budget_s: float = 0.0  # the caller's budget for rerank; 0 = none but the deadline
    deadline: float | None = None  # time.monotonic() by which the caller needs the answer


@dataclass(frozen=True)
class LegTiming:
    leg: str
    seconds: float
    ok: bool


@dataclass
class RerankInfo:
    status: str = ""  # "applied", "skipped" (asked for, not done: see reason), "" (not asked for)
    reason: str = ""  # skipped: "no model", "deadline", "budget", "error"
    model: str = ""
    candidates: int = 0
    seconds: float = 0.0


@dataclass
class SearchResult:
    hits: list[Hit]
    degraded: bool = False
    notes: list[str] = field(default_factory=list)
    timings: list[LegTiming] = field(default_factory=list)
    kb_version: int = 0
    rerank: RerankInfo = field(default_factory=RerankInfo)


class RetrieverMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.leg_seconds = Histogram("goodput_retriever_leg_seconds", "Latency of a search leg or step.", ["leg"],
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.leg_failures = Counter("goodput_retriever_leg_failures_total", "Legs that failed or timed out.",
                                    ["leg", "reason"], registry=registry)
        self.degraded = Counter("goodput_retriever_degraded_total", "Searches answered by one leg only.",
                                registry=registry)
        self.rerank = Counter("goodput_retriever_rerank_total", "Searches that asked for rerank, by outcome: "
                              "applied, or skipped for want of a model, by the deadline or budget, by an error.",
                              ["outcome"], registry=registry)


class Retriever:
    def __init__(self, settings: RetrieverSettings, *, vectors: VectorStore, lexical: LexicalIndex,
                 embedder: QueryEmbedder, reranker: Reranker | None = None,
                 metrics: RetrieverMetrics | None = None, versions_file: Path | None = None) -> None:
        self.settings = settings
        self.vectors = vectors
        self.lexical = lexical
        self.embedder = embedder
        self.reranker = reranker
        self.metrics = metrics or RetrieverMetrics(None)
        self._versions_file = versions_file
        self._versions: dict[str, int] = {}
        if versions_file is not None and versions_file.exists():
            try:
                self._versions = {str(k): int(v) for k, v in json.loads(versions_file.read_text()).items()}
            except (OSError, ValueError):
                log.warning("ignoring an unreadable versions file", extra={"path": str(versions_file)})
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- versions --------------------------------------------------------------------------------------------
    def version(self, tenant: str, kb: str) -> int:
        return self._versions.get(f"{tenant}/{kb}", 0)

    def _set_version(self, tenant: str, kb: str, version: int) -> None:
        if version <= 0:
            return
        self._versions[f"{tenant}/{kb}"] = max(version, self.version(tenant, kb))
        if self._versions_file is not None:
            tmp = self._versions_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._versions))
            tmp.replace(self._versions_file)

    def _lock(self, tenant: str, kb: str) -> asyncio.Lock:
        return self._locks.setdefault(f"{tenant}/{kb}", asyncio.Lock())

    # ---- search ----------------------------------------------------------------------------------------------
    def _validate(self, q: SearchQuery) -> tuple[str, int, int, float]:
        s = self.settings
        validate_name(q.tenant, "tenant")
        validate_name(q.kb, "knowledge_base")
        if not q.query.strip():
            raise InvalidArgument("'query' must not be empty", param="query", code="invalid_value")
        if len(q.query) > s.max_query_chars:
            raise InvalidArgument(f"the query has {len(q.query)} characters; the limit is {s.max_query_chars}",
                                  param="query", code="invalid_value")
        fusion = q.fusion or s.default_fusion
        if fusion not in FUSIONS:
            raise InvalidArgument(f"'fusion' must be one of {', '.join(FUSIONS)}", param="fusion", code="invalid_value")
        top_k = q.top_k or s.default_top_k
        if not 1 <= top_k <= s.max_top_k:
            raise InvalidArgument(f"'top_k' must be between 1 and {s.max_top_k}", param="top_k", code="invalid_value")
        recall_k = max(q.recall_k or s.default_recall_k, top_k)
        if recall_k > s.max_recall_k:
            raise InvalidArgument(f"'recall_k' must be at most {s.max_recall_k}", param="recall_k",
                                  code="invalid_value")
        w = s.default_dense_weight if q.dense_weight is None else q.dense_weight
        if not (math.isfinite(w) and 0.0 <= w <= 1.0):
            raise InvalidArgument("'dense_weight' must be between 0 and 1", param="dense_weight", code="invalid_value")
        return fusion, top_k, recall_k, w

    async def exists(self, tenant: str, kb: str) -> bool:
        v, lx = await asyncio.gather(asyncio.to_thread(self.vectors.exists, tenant, kb),
                                     asyncio.to_thread(self.lexical.exists, tenant, kb), return_exceptions=True)
        return v is True or lx is True

    def _leg_timeout(self, q: SearchQuery) -> float:
        """A leg's time: min(leg_timeout_s, the caller's leg budget, the time the call has left)."""
        limit = self.settings.leg_timeout_s
        if q.leg_budget_s > 0:
            limit = min(limit, q.leg_budget_s)
        if q.deadline is not None:
            limit = min(limit, max(q.deadline - time.monotonic(), 0.001))
        return limit

    async def _leg(self, name: str, run: Callable[[], Awaitable[list[Hit]]],
                   timeout_s: float) -> tuple[list[Hit] | None, LegTiming, str | None]:
        started = time.perf_counter()
        note = None
        hits: list[Hit] | None = None
        try:
            hits = await asyncio.wait_for(run(), timeout_s)
        except asyncio.TimeoutError:
            note = f"{name} leg timed out after {timeout_s:g} s"
            self.metrics.leg_failures.labels(name, "timeout").inc()
        except Exception as err:  # noqa: BLE001 - a failed leg degrades the search, it does not fail it
            note = f"{name} leg failed: {type(err).__name__}: {str(err)[:200]}"
            self.metrics.leg_failures.labels(name, "error").inc()
            log.warning("search leg failed", extra={"leg": name, "error": str(err)[:500]})
        elapsed = time.perf_counter() - started
        self.metrics.leg_seconds.labels(name).observe(elapsed)
        return hits, LegTiming(name, elapsed, hits is not None), note

    async def search(self, q: SearchQuery) -> SearchResult:
        fusion, top_k, recall_k, w = self._validate(q)
        if not await self.exists(q.tenant, q.kb):
            raise NotFound(f"knowledge base {q.kb!r} does not exist", param="knowledge_base",
                           code="knowledge_base_not_found")

        async def dense() -> list[Hit]:
            vector = await self.embedder.embed_query(q.query)
            return await asyncio.to_thread(self.vectors.search, q.tenant, q.kb, vector, recall_k)

        async def lexical() -> list[Hit]:
            return await asyncio.to_thread(self.lexical.search, q.tenant, q.kb, q.query, recall_k)

        legs: list[tuple[str, Callable[[], Awaitable[list[Hit]]]]] = []
        if fusion != "lexical":
            legs.append(("dense", dense))
        if fusion != "dense":
            legs.append(("lexical", lexical))
        leg_timeout = self._leg_timeout(q)
        outcomes = await asyncio.gather(*(self._leg(name, run, leg_timeout) for name, run in legs))
        result = SearchResult(hits=[], kb_version=self.version(q.tenant, q.kb))
        lists: dict[str, list[Hit]] = {}
        for (name, _), (hits, timing, note) in zip(legs, outcomes, strict=True):
            result.timings.append(timing)
            if hits is not None:
                lists[name] = hits
            if note:
                result.notes.append(note)
        if not lists:
            raise Unavailable("search failed: " + "; ".join(result.notes))
        if len(lists) < len(legs):
            result.degraded = True
            self.metrics.degraded.inc()
        started = time.perf_counter()
        if len(lists) == 1:
            fused = next(iter(lists.values()))
        elif fusion == "weighted":
            fused = weighted(lists["dense"], lists["lexical"], dense_weight=w)
        else:
            fused = rrf([lists["dense"], lists["lexical"]], k=self.settings.rrf_k)
        fuse_s = time.perf_counter() - started
        result.timings.append(LegTiming("fusion", fuse_s, True))
        self.metrics.leg_seconds.labels("fusion").observe(fuse_s)
        if q.rerank:
            fused = await self._rerank(q, fused, top_k, result)
        result.hits = fused[:top_k]
        return result

    async def _rerank(self, q: SearchQuery, fused: list[Hit], top_k: int, result: SearchResult) -> list[Hit]:
        """The cross-encoder over the fused top ``rerank_candidates``, under min(the caller's rerank budget, the
        time left). The model refuses work it cannot finish in time (judged from its measured cost) and stops
        between batches when late; either way the fused order stands, with a note, rather than the search failing."""
        info = result.rerank
        info.status = "skipped"
        if self.reranker is None:
            info.reason = "no model"
            result.notes.append("rerank skipped: no reranker model configured")
            self.metrics.rerank.labels("skipped_no_model").inc()
            return fused
        info.model = self.reranker.name
        candidates = fused[:self.settings.rerank_candidates]
        info.candidates = len(candidates)
        now = time.monotonic()
        deadline = now + q.rerank_budget_s if q.rerank_budget_s > 0 else None
        why = "budget"
        if q.deadline is not None and (deadline is None or q.deadline < deadline):
            deadline, why = q.deadline, "deadline"
        started = time.perf_counter()
        top_n = min(top_k, self.settings.rerank_top_n)
        try:
            limit = None if deadline is None else max(deadline - now, 0.0) + 0.05  # the model stops itself first
            reranked = await asyncio.wait_for(asyncio.to_thread(
                self.reranker.rerank, q.query, candidates, top_n, deadline=deadline), limit)
        except Exception as err:  # noqa: BLE001 - a late or failed rerank serves the fused order
            late = isinstance(err, (DeadlineExceeded, asyncio.TimeoutError))
            info.reason = why if late else "error"
            info.seconds = time.perf_counter() - started
            result.notes.append(f"rerank skipped: over its {why} ({str(err) or 'over time'})" if late
                                else f"rerank skipped: {type(err).__name__}: {str(err)[:200]}")
            result.timings.append(LegTiming("rerank", info.seconds, False))
            self.metrics.leg_failures.labels("rerank", "timeout" if late else "error").inc()
            self.metrics.rerank.labels(f"skipped_{info.reason}").inc()
            if not late:
                log.warning("rerank failed", extra={"error": str(err)[:500]})
            return fused
        info.status, info.seconds = "applied", time.perf_counter() - started
        result.timings.append(LegTiming("rerank", info.seconds, True))
        self.metrics.leg_seconds.labels("rerank").observe(info.seconds)
        self.metrics.rerank.labels("applied").inc()
        return list(reranked)

    # ---- write side (IndexStore) -----------------------------------------------------------------------------
    async def open(self, tenant: str, kb: str) -> tuple[bool, int]:
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        async with self._lock(tenant, kb):
            v = await asyncio.to_thread(self.vectors.ensure, tenant, kb)
            lx = await asyncio.to_thread(self.lexical.ensure, tenant, kb)
        return v or lx, self.version(tenant, kb)

    async def write(self, tenant: str, kb: str, *, upserts: Sequence[StoredChunk], delete_chunk_ids: Sequence[str],
                    delete_document_ids: Sequence[str], generation: str, kb_version: int) -> int:
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        if len(upserts) > self.settings.max_write_chunks:
            raise InvalidArgument(f"{len(upserts)} chunks in one write; the limit is "
                                  f"{self.settings.max_write_chunks}", param="upserts")
        for c in upserts:
            if not c.chunk_id or not c.document_id:
                raise InvalidArgument("every chunk needs a chunk_id and a document_id", param="upserts")
            if len(c.vector) != getattr(self.vectors, "dim", len(c.vector)):
                raise InvalidArgument(f"chunk {c.chunk_id!r} has a {len(c.vector)}-dimensional vector", param="upserts")
        if not generation and not await self.exists(tenant, kb):
            raise NotFound(f"knowledge base {kb!r} does not exist (Open it first)", param="knowledge_base")
        async with self._lock(tenant, kb):
            try:
                for store in (self.vectors, self.lexical):
                    await asyncio.to_thread(store.upsert, tenant, kb, upserts, generation=generation)
                    await asyncio.to_thread(store.delete, tenant, kb, chunk_ids=delete_chunk_ids,
                                            document_ids=delete_document_ids, generation=generation)
            except KeyError as err:
                raise NotFound(f"no such index or rebuild: {err}", param="rebuild_id") from None
            self._set_version(tenant, kb, kb_version)
        return len(upserts)

    async def begin_rebuild(self, tenant: str, kb: str) -> str:
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        generation = new_generation()
        async with self._lock(tenant, kb):
            for store in (self.vectors, self.lexical):
                await asyncio.to_thread(store.begin_rebuild, tenant, kb, generation)
        return generation

    async def commit_rebuild(self, tenant: str, kb: str, generation: str, kb_version: int) -> None:
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        if not generation:
            raise InvalidArgument("'rebuild_id' must not be empty", param="rebuild_id")
        async with self._lock(tenant, kb):
            try:
                for store in (self.vectors, self.lexical):
                    await asyncio.to_thread(store.commit_rebuild, tenant, kb, generation)
            except (KeyError, ValueError) as err:
                raise NotFound(f"no rebuild {generation!r}: {err}", param="rebuild_id") from None
            self._set_version(tenant, kb, kb_version)

    def close(self) -> None:
        for store in (self.vectors, self.lexical):
            try:
                store.close()
            except Exception:  # noqa: BLE001
                log.warning("closing a store failed", exc_info=True)


def chunk_from(obj: Any) -> StoredChunk:
    return StoredChunk(chunk_id=obj.chunk_id, document_id=obj.document_id, text=obj.text, vector=list(obj.vector),
                       metadata=dict(obj.metadata))
