"""The response cache behind the gRPC API (no gRPC imports): lookup, store, invalidation, KB-version events.

Lookup: exact (L1) first, then, for requests that allow it, semantic (L2) inside the request's partition, each
candidate checked by the near-miss guard. When a second entry with another answer matches almost as well as the best
(within ``ambiguity_margin``), the lookup is a miss: the question fits two cached answers and the cache does not
guess between them. With a verifier (``goodput_cache.verify``), the candidates from a lower similarity bound up are
read by a cross-encoder instead, and only one it judges to ask the same thing is served. Fail-open: a Redis or
embedder failure answers a *degraded miss* (the request is generated as if uncached) and is counted; after a Redis
failure, lookups skip Redis for ``breaker_s`` so a dead Redis costs no latency. Store: only reusable answers
(greedy sampling or an explicit opt-in), with a TTL per content type; time-sensitive questions get a short TTL (or
none) and are never served from L2.

Example::

    cache = ResponseCache(settings, redis=Redis.from_url(url), vectoriser=LocalVectoriser(), metrics=m)
    await cache.store(req, Answer(text="Paris.", completion_tokens=3))
    (await cache.lookup(req)).layer   # 'l1'
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from contextlib import aclosing
from dataclasses import replace

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from goodput_contracts import VersionChange, version_key
from goodput_core.errors import InvalidArgument, Unavailable

from goodput_cache.config import CacheSettings
from goodput_cache.embedding import Vectoriser, VectorMemo
from goodput_cache.exact import Entry, ExactStore
from goodput_cache.guard import is_time_sensitive, near_miss
from goodput_cache.keys import CacheRequest, check_request, derive, greedy, normalise, validate_key, validate_name
from goodput_cache.metrics import CacheMetrics, Tally
from goodput_cache.results import Answer, LookupResult, StoreResult
from goodput_cache.semantic import Candidate, NumpyIndex, VectorIndex
from goodput_cache.verify import DeadlineExceeded, Verifier

__all__ = ["Answer", "CacheMetrics", "LookupResult", "ResponseCache", "StoreResult"]

log = logging.getLogger("goodput.cache")
_STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
STALE = "stale knowledge base"
CANDIDATES = 4


class ResponseCache:
    def __init__(self, settings: CacheSettings, *, redis: Redis, vectoriser: Vectoriser | None,
                 metrics: CacheMetrics, index: VectorIndex | None = None, verifier: Verifier | None = None,
                 versions: Redis | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.versions = versions or redis  # the indexer's KB versions (keys and channel): KB_REDIS_URL or this one
        self.l1 = ExactStore(redis, prefix=settings.key_prefix)
        self.vectoriser = vectoriser
        self.index: VectorIndex = index or NumpyIndex(
            dim=vectoriser.dim if vectoriser else 384, max_per_partition=settings.max_partition_entries,
            ann=settings.ann_config(), max_bytes=settings.max_l2_bytes,
            on_evict=lambda reason, n: metrics.semantic_evictions.labels(reason).inc(n))
        self.metrics = metrics
        metrics.semantic_budget.set(settings.max_l2_bytes)
        metrics.semantic_bytes.set_function(lambda: self.index.bytes_used())
        metrics.partitions.set_function(lambda: self.index.partitions())
        self.verifier = verifier
        self._memo = VectorMemo(settings.vector_memo_entries)
        self._tally: dict[str, Tally] = defaultdict(Tally)
        self._broken_until = 0.0
        self._watch: asyncio.Task[None] | None = None

    # ---- fail-open ----------------------------------------------------------------------------------------------

    def _redis_down(self) -> bool:
        return time.monotonic() < self._broken_until

    def _trip(self, err: BaseException) -> None:
        if not self._redis_down():
            log.warning("redis unavailable, serving uncached", extra={"error": repr(err)[:200]})
        self._broken_until = time.monotonic() + self.settings.breaker_s
        self.metrics.degraded.labels("redis").inc()

    async def _kb_version(self, req: CacheRequest) -> tuple[CacheRequest, str]:
        """RAG: the request at its knowledge base's current version (when it said 0), or why it cannot be served or
        stored at the version it names: an older one ("stale knowledge base"), or one not published yet."""
        if not req.rag:
            return req, ""
        raw = await self.versions.get(version_key(req.tenant, req.knowledge_base, prefix=self.settings.kb_key_prefix))
        current = int(raw) if raw is not None else 0
        if not req.kb_version:
            return replace(req, kb_version=current), ""
        if req.kb_version < current:
            return req, STALE
        if req.kb_version > current:
            return req, "unknown knowledge-base version"
        return req, ""

    # ---- lookup -------------------------------------------------------------------------------------------------

    async def lookup(self, req: CacheRequest, *, allow_semantic: bool = True, threshold: float = 0.0) -> LookupResult:
        check_request(req, max_chars=self.settings.max_query_chars, tenants=self.settings.tenants)
        if threshold and not 0.5 <= threshold <= 1.0:
            raise InvalidArgument(f"threshold must be within 0.5..1.0, got {threshold}", param="threshold")
        tally = self._tally[req.tenant]
        if self._redis_down():
            return self._degraded(req, tally, "store unavailable")
        started = time.perf_counter()
        try:
            req, stale = await self._kb_version(req)
            keys = derive(req)
            entry = await self.l1.get(keys.exact) if not stale else None
        except _STORE_ERRORS as err:
            self._trip(err)
            return self._degraded(req, tally, "store unavailable")
        self.metrics.lookup_seconds.labels("l1").observe(time.perf_counter() - started)
        if entry is not None and _answers(entry, req):
            self.index.touch(keys.exact)
            self._count("l1", "hit", req.tenant, tally, entry)
            return LookupResult(hit=True, layer="l1", similarity=1.0, answer=_answer(entry), key=keys.exact,
                                kb_version=req.kb_version)
        self._count("l1", "miss", req.tenant, tally)
        if stale:  # an answer of another version than the current one is never served
            return LookupResult(key=keys.exact, reason=stale, kb_version=req.kb_version)
        if not (allow_semantic and self.settings.semantic and self.vectoriser is not None and keys.question):
            return LookupResult(key=keys.exact, reason="exact only", kb_version=req.kb_version)
        if is_time_sensitive(keys.question):
            return LookupResult(key=keys.exact, reason="time-sensitive", kb_version=req.kb_version)
        started = time.perf_counter()
        vector = await self._vector_or_none(req, keys.question, tally)
        if vector is None:
            result = LookupResult(degraded=True, reason="embedder unavailable")
        elif self.verifier is not None:
            result = await self._verified(req, keys.partition, keys.question, vector,
                                          threshold or self.settings.verify_min_similarity, tally, self.verifier)
        else:
            result = await self._semantic(req, keys.partition, keys.question, vector,
                                          threshold or self.settings.threshold_for(req.tenant), tally)
        self.metrics.lookup_seconds.labels("l2").observe(time.perf_counter() - started)
        result.key, result.kb_version = keys.exact, req.kb_version
        return result

    async def _semantic(self, req: CacheRequest, partition: str, question: str, vector: np.ndarray,
                        threshold: float, tally: Tally) -> LookupResult:
        margin = self.settings.ambiguity_margin
        candidates = await asyncio.to_thread(self.index.search, partition, vector, k=CANDIDATES,
                                             min_similarity=max(0.0, threshold - margin))
        guarded = ""
        best: tuple[Candidate, Entry] | None = None  # the closest entry that may answer
        for cand in candidates:
            if best is None and cand.similarity < threshold:
                break  # only a runner-up may sit below the threshold
            if best is not None and best[0].similarity - cand.similarity >= margin:
                break
            if self.settings.guard:
                why = near_miss(question, cand.question)
                if why:
                    if best is None:
                        self.metrics.lookups.labels("l2", "guarded", req.tenant).inc()
                        guarded = guarded or why
                    continue
            try:
                entry = await self.l1.get(cand.key, touch=best is None)
            except _STORE_ERRORS as err:
                self._trip(err)
                return self._degraded(req, tally, "store unavailable")
            if entry is None:  # expired or evicted in Redis: the index catches up
                self.index.remove([cand.key])
                continue
            if not _answers(entry, req) or entry.partition != partition:
                continue
            if best is None:
                best = (cand, entry)
                continue
            if normalise(entry.text) != normalise(best[1].text):  # a runner-up within the margin, answering otherwise
                self.metrics.lookups.labels("l2", "ambiguous", req.tenant).inc()
                self._count("l2", "miss", req.tenant, tally)
                return LookupResult(reason=f"ambiguous: two cached answers differ and match within {margin:g} "
                                           f"({best[0].similarity:.3f} vs {cand.similarity:.3f})")
            break  # the runner-up gives the same answer
        if best is not None:
            return self._l2_hit(req, tally, *best)
        self._count("l2", "miss", req.tenant, tally)
        return LookupResult(reason=f"near miss: {guarded}" if guarded else "")

    async def _verified(self, req: CacheRequest, partition: str, question: str, vector: np.ndarray,
                        min_similarity: float, tally: Tally, verifier: Verifier) -> LookupResult:
        """L2 with a verifier: the candidates from ``min_similarity`` up (after the guard, when on) are read by the
        cross-encoder in one call; the most probable one at or above its threshold is served."""
        candidates = await asyncio.to_thread(self.index.search, partition, vector, k=CANDIDATES,
                                             min_similarity=min_similarity)
        guarded = ""
        if self.settings.guard and self.settings.verify_with_guard:
            kept = []
            for cand in candidates:
                why = near_miss(question, cand.question)
                if why:
                    self.metrics.lookups.labels("l2", "guarded", req.tenant).inc()
                    guarded = guarded or why
                else:
                    kept.append(cand)
            candidates = kept
        if not candidates:
            self._count("l2", "miss", req.tenant, tally)
            return LookupResult(reason=f"near miss: {guarded}" if guarded else "")
        started = time.perf_counter()
        timeout = self.settings.verify_timeout_s
        try:
            probs = await asyncio.wait_for(asyncio.to_thread(
                verifier.judge, question, [c.question for c in candidates], deadline=time.monotonic() + timeout),
                timeout + 0.02)
        except (DeadlineExceeded, asyncio.TimeoutError):
            self.metrics.verifications.labels("skipped", req.tenant).inc()
            self._count("l2", "miss", req.tenant, tally)
            return LookupResult(reason=f"verifier over its {timeout * 1000:g} ms", verdict="skipped")
        self.metrics.verifier_seconds.observe(time.perf_counter() - started)
        self.metrics.verifier_probability.observe(float(probs.max()))
        for i in sorted(range(len(candidates)), key=lambda j: -probs[j]):
            if probs[i] < verifier.threshold:
                break
            cand = candidates[i]
            try:
                entry = await self.l1.get(cand.key, touch=True)
            except _STORE_ERRORS as err:
                self._trip(err)
                return self._degraded(req, tally, "store unavailable")
            if entry is None:  # expired or evicted in Redis: the index catches up
                self.index.remove([cand.key])
                continue
            if not _answers(entry, req) or entry.partition != partition:
                continue
            self.metrics.verifications.labels("same", req.tenant).inc()
            return self._l2_hit(req, tally, cand, entry, verdict="same", verifier_probability=float(probs[i]))
        best = float(probs.max())
        self.metrics.verifications.labels("different", req.tenant).inc()
        self._count("l2", "miss", req.tenant, tally)
        return LookupResult(reason=f"verifier: not the same question (p={best:.3f} < {verifier.threshold:.3f})",
                            verdict="different", verifier_probability=best)

    def _l2_hit(self, req: CacheRequest, tally: Tally, cand: Candidate, entry: Entry, verdict: str = "",
                verifier_probability: float = 0.0) -> LookupResult:
        self.index.touch(cand.key)
        self._count("l2", "hit", req.tenant, tally, entry)
        return LookupResult(hit=True, layer="l2", similarity=cand.similarity, answer=_answer(entry),
                            matched_query=entry.question, verdict=verdict, verifier_probability=verifier_probability)

    async def _vector_or_none(self, req: CacheRequest, question: str, tally: Tally) -> np.ndarray | None:
        """The question's vector, or None when the embedder failed (counted: the lookup is a degraded miss)."""
        try:
            return await self._vector(question)
        except Exception as err:  # noqa: BLE001 - any embedder failure is served uncached
            log.warning("embedding failed, L2 skipped", extra={"error": repr(err)[:200]})
            self.metrics.degraded.labels("embedder").inc()
            self.metrics.lookups.labels("l2", "error", req.tenant).inc()
            tally.degraded += 1
            return None

    async def _vector(self, question: str) -> np.ndarray:
        """The question's vector: from the memo when this process embedded it lately, else from the model."""
        assert self.vectoriser is not None
        vector = self._memo.get(question)
        if vector is not None:
            self.metrics.embeddings.labels("memo").inc()
            return vector
        vector = (await self.vectoriser.embed([question]))[0]
        self.metrics.embeddings.labels("model").inc()
        self._memo.put(question, vector)
        return vector

    def _degraded(self, req: CacheRequest, tally: Tally, reason: str) -> LookupResult:
        self.metrics.lookups.labels("l1", "error", req.tenant).inc()
        tally.degraded += 1
        return LookupResult(degraded=True, reason=reason)

    def _count(self, layer: str, result: str, tenant: str, tally: Tally, entry: Entry | None = None) -> None:
        self.metrics.lookups.labels(layer, result, tenant).inc()
        if result == "hit" and entry is not None:
            tally.hits[layer] += 1
            tally.tokens_saved += entry.completion_tokens
            gpu_s = entry.completion_tokens * self.settings.gpu_seconds_per_token
            tally.gpu_seconds_saved += gpu_s
            self.metrics.tokens_saved.labels(tenant).inc(entry.completion_tokens)
            self.metrics.gpu_seconds_saved.labels(tenant).inc(gpu_s)
        elif result == "miss":
            tally.misses[layer] += 1

    # ---- store --------------------------------------------------------------------------------------------------

    async def store(self, req: CacheRequest, answer: Answer, *, opt_in: bool = False, ttl_s: int = 0) -> StoreResult:
        check_request(req, max_chars=self.settings.max_query_chars, tenants=self.settings.tenants)
        size = len(answer.text.encode())
        if size > self.settings.max_entry_bytes:
            raise InvalidArgument(f"the answer is {size} bytes; the cache stores at most "
                                  f"{self.settings.max_entry_bytes}", param="text", code="entry_too_large")
        if ttl_s < 0 or ttl_s > self.settings.max_ttl_s:
            raise InvalidArgument(f"ttl_s must be within 0..{self.settings.max_ttl_s}", param="ttl_s")
        if not answer.text:
            return self._not_stored("empty answer")
        if answer.finish_reason == 3:  # FINISH_REASON_ABORT: an incomplete answer
            return self._not_stored("incomplete")
        if not (greedy(req.sampling) or opt_in):
            return self._not_stored("not reusable")
        sensitive = is_time_sensitive(req.last_user())
        if sensitive:
            ttl = min(ttl_s or self.settings.ttl_time_sensitive_s, self.settings.ttl_time_sensitive_s)
            if ttl <= 0:
                return self._not_stored("time-sensitive")
        else:
            ttl = ttl_s or (self.settings.ttl_rag_s if req.rag else self.settings.ttl_chat_s)
        if self._redis_down():
            return self._not_stored("store unavailable")
        try:
            req, stale = await self._kb_version(req)
            if stale:
                return self._not_stored(stale)
            keys = derive(req)
            vector = None
            if self.settings.semantic and self.vectoriser is not None and not sensitive and keys.question:
                try:
                    vector = await self._vector(keys.question)
                except Exception as err:  # noqa: BLE001 - stored for L1 only
                    log.warning("embedding failed, stored for L1 only", extra={"error": repr(err)[:200]})
                    self.metrics.degraded.labels("embedder").inc()
            entry = Entry(key=keys.exact, tenant=req.tenant, partition=keys.partition, model=req.model,
                          model_version=req.model_version, question=keys.question, text=answer.text,
                          finish_reason=answer.finish_reason, prompt_tokens=answer.prompt_tokens,
                          completion_tokens=answer.completion_tokens, knowledge_base=req.knowledge_base,
                          kb_version=req.kb_version, sources=answer.sources)
            evicted = await self.l1.put(entry, vector=vector, ttl_s=ttl, max_entries=self.settings.max_entries)
            if evicted:
                self.index.remove(evicted)
                self.metrics.evictions.labels("capacity").inc(len(evicted))
            if req.rag and (await self._kb_version(req))[1]:
                # The knowledge base moved on while the entry was written: its bump may have listed the knowledge
                # base's entries before this one was among them, so the entry goes now.
                await self.l1.delete([keys.exact])
                return self._not_stored(STALE)
        except _STORE_ERRORS as err:
            self._trip(err)
            return self._not_stored("store unavailable")
        if vector is not None:
            self.index.add(keys.partition, keys.exact, vector, question=keys.question, expires=entry.expires)
            self.metrics.entries.set(len(self.index))
        self.metrics.stores.labels("stored").inc()
        return StoreResult(stored=True, key=keys.exact, ttl_s=ttl)

    def _not_stored(self, reason: str) -> StoreResult:
        self.metrics.stores.labels(reason).inc()
        return StoreResult(stored=False, reason=reason)

    # ---- invalidation -------------------------------------------------------------------------------------------

    async def invalidate(self, *, tenant: str = "", knowledge_base: str = "", key: str = "", model: str = "") -> int:
        """Drops one key, every entry of a tenant's knowledge base, of a tenant, or of a model; returns the count."""
        if tenant:
            validate_name(tenant, "tenant")
        if knowledge_base:
            validate_name(knowledge_base, "knowledge_base")
            if not tenant:
                raise InvalidArgument("knowledge_base needs its tenant", param="tenant")
        if model:
            validate_name(model.replace("/", "-"), "model")
        try:
            if key:
                validate_key(key)
                if tenant:
                    meta = (await self.l1.metas([key])).get(key)
                    if meta is not None and meta.tenant != tenant:
                        return 0
                keys = [key]
            elif knowledge_base:
                keys = await self.l1.keys_of_kb(tenant, knowledge_base)
            elif tenant:
                keys = await self.l1.keys_of_tenant(tenant)
            elif model:
                keys = await self.l1.keys_of_model(model)
            else:
                raise InvalidArgument("say what to invalidate: key, tenant, tenant + knowledge_base, or model",
                                      param="key")
            removed = await self.l1.delete(keys)
            if not key:
                await self.l1.forget_set(tenant=tenant, kb=knowledge_base, model=model)
        except _STORE_ERRORS as err:
            raise Unavailable(f"the cache store is unavailable; nothing was invalidated ({err!r:.120})") from None
        self.index.remove(keys)
        self.metrics.evictions.labels("invalidate").inc(removed)
        self.metrics.entries.set(len(self.index))
        return removed

    async def on_kb_version(self, tenant: str, knowledge_base: str, version: int) -> int:
        """A knowledge base moved to ``version``: entries tied to an older version are dropped."""
        keys = await self.l1.keys_of_kb(tenant, knowledge_base)
        metas = await self.l1.metas(keys)
        stale = [k for k, e in metas.items() if e.kb_version < version]
        gone = [k for k in keys if k not in metas]
        removed = await self.l1.delete(stale)
        if stale or gone:
            await self.redis.srem(f"{self.settings.key_prefix}:kb:{tenant}:{knowledge_base}", *(stale + gone))
        self.index.remove(stale + gone)
        self.metrics.evictions.labels("kb_version").inc(removed)
        self.metrics.entries.set(len(self.index))
        if removed:
            log.info("kb version bump dropped entries", extra={"tenant": tenant, "kb": knowledge_base,
                                                                "version": version, "removed": removed})
        return removed

    async def watch_kb_versions(self) -> None:
        """Follows the indexer's version channel until cancelled (reconnecting after Redis failures)."""
        while True:
            try:
                pubsub = self.versions.pubsub()
                await pubsub.subscribe(self.settings.version_channel)
                try:
                    while True:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if msg is None or msg.get("type") != "message":
                            continue
                        try:
                            change = VersionChange.decode(msg["data"])
                        except ValueError as err:
                            log.warning("bad kb-version message", extra={"error": repr(err)[:200]})
                            continue
                        await self.on_kb_version(change.tenant, change.knowledge_base, change.version)
                finally:
                    await pubsub.aclose()
            except _STORE_ERRORS as err:  # (a cancellation is no store error: it ends the loop)
                self.metrics.degraded.labels("redis").inc()
                log.warning("kb-version subscription lost, retrying", extra={"error": repr(err)[:200]})
                await asyncio.sleep(1.0)

    # ---- lifecycle and stats ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuilds the L2 index from Redis and follows KB versions. A Redis that is down does not stop the start."""
        if self.settings.semantic and self.vectoriser is not None:
            try:
                await self._restore(self.vectoriser.dim)
            except _STORE_ERRORS as err:
                self._trip(err)
        self._watch = asyncio.get_running_loop().create_task(self.watch_kb_versions())

    async def _restore(self, dim: int) -> None:
        """Loads the entries L2 may serve, the most recently used first, each as colder than the ones before, and
        stops at the first one the budget cannot hold: never everything first and the excess evicted after."""
        now, loaded, full = time.time(), 0, False
        async with aclosing(self.l1.scan_recent()) as entries:
            async for entry, vec in entries:
                if entry.expires <= now or len(vec) != dim:
                    continue
                if not self.index.add(entry.partition, entry.key, vec, question=entry.question,
                                      expires=entry.expires, cold=True):
                    full = True
                    break
                loaded += 1
        self.metrics.restored.inc(loaded)
        self.metrics.entries.set(len(self.index))
        log.info("semantic index rebuilt", extra={"entries": len(self.index), "bytes": self.index.bytes_used(),
                                                  "budget_bytes": self.settings.max_l2_bytes, "budget_full": full})

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.redis.aclose()
        if self.versions is not self.redis:
            await self.versions.aclose()

    async def stats(self, tenant: str = "") -> dict[str, object]:
        tallies = [self._tally[tenant]] if tenant else list(self._tally.values())
        try:
            entries_l1 = await self.l1.count() if not self._redis_down() else -1
        except _STORE_ERRORS as err:
            self._trip(err)
            entries_l1 = -1
        return {
            "layers": [{"layer": layer, "hits": sum(t.hits[layer] for t in tallies),
                        "misses": sum(t.misses[layer] for t in tallies),
                        "entries": entries_l1 if layer == "l1" else len(self.index)} for layer in ("l1", "l2")],
            "tokens_saved": sum(t.tokens_saved for t in tallies),
            "gpu_seconds_saved": sum(t.gpu_seconds_saved for t in tallies),
            "degraded": sum(t.degraded for t in tallies),
        }


def _answers(entry: Entry, req: CacheRequest) -> bool:
    """The stored entry may answer the request: the same tenant and, for RAG, the same knowledge base and version
    (the key already says so; this holds even if two keys ever collided)."""
    return entry.tenant == req.tenant and (not req.rag or (entry.knowledge_base == req.knowledge_base
                                                           and entry.kb_version == req.kb_version))


def _answer(e: Entry) -> Answer:
    return Answer(text=e.text, finish_reason=e.finish_reason, prompt_tokens=e.prompt_tokens,
                  completion_tokens=e.completion_tokens, sources=e.sources)
