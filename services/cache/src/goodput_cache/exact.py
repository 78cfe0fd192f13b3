"""L1: the exact-match store in Redis. Every entry (answer, metadata and, for L2, its question's vector) lives here,
so the cache survives a restart of the service and the semantic index is rebuilt from it.

Keys (``<prefix>`` is ``GOODPUT_CACHE_KEY_PREFIX``):

- ``<prefix>:e:<key>``: a hash, ``meta`` (JSON) and ``vec`` (float32 bytes, only for entries L2 may serve); it
  carries the entry's TTL.
- ``<prefix>:lru``: a sorted set of keys by last use; beyond ``max_entries`` the least recently used are evicted. A
  restart reads it from the most recent end to load the semantic index up to its memory budget.
- ``<prefix>:t:<tenant>``, ``<prefix>:kb:<tenant>:<kb>``, ``<prefix>:m:<model>``: sets of keys, for invalidation.
  They may list expired keys; invalidation simply deletes what is still there.

Example::

    store = ExactStore(redis_client, prefix="goodput:cache")
    await store.put(entry, vector=None, ttl_s=3600, max_entries=100_000)
    (await store.get(entry.key)).text
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from redis.asyncio import Redis

__all__ = ["Entry", "ExactStore"]


@dataclass
class Entry:
    key: str
    tenant: str
    partition: str
    model: str
    model_version: str
    question: str
    text: str
    finish_reason: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    knowledge_base: str = ""
    kb_version: int = 0
    created: float = 0.0
    expires: float = 0.0
    semantic: bool = False
    sources: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Entry:
        return cls(**json.loads(raw))


class ExactStore:
    def __init__(self, redis: Redis, *, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix

    def _e(self, key: str) -> str:
        return f"{self.prefix}:e:{key}"

    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}:t:{tenant}"

    def _kb(self, tenant: str, kb: str) -> str:
        return f"{self.prefix}:kb:{tenant}:{kb}"

    def _model(self, model: str) -> str:
        return f"{self.prefix}:m:{model}"

    @property
    def _lru(self) -> str:
        return f"{self.prefix}:lru"

    async def get(self, key: str, *, touch: bool = True) -> Entry | None:
        if not touch:
            raw = await self.redis.hget(self._e(key), "meta")
        else:
            # one round trip: read, and mark as recently used only if the key is still tracked (XX)
            pipe = self.redis.pipeline(transaction=False)
            pipe.hget(self._e(key), "meta")
            pipe.zadd(self._lru, {key: time.time()}, xx=True)
            raw, _ = await pipe.execute()
        return None if raw is None else Entry.from_json(raw)

    async def put(self, entry: Entry, *, vector: np.ndarray | None, ttl_s: int, max_entries: int) -> list[str]:
        """Writes the entry with its TTL and indexes; returns the keys evicted to stay within ``max_entries``."""
        now = time.time()
        entry.created, entry.expires, entry.semantic = now, now + ttl_s, vector is not None
        mapping: dict[str | bytes, str | bytes] = {"meta": entry.to_json()}
        if vector is not None:
            mapping["vec"] = np.asarray(vector, dtype=np.float32).tobytes()
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._e(entry.key))
        pipe.hset(self._e(entry.key), mapping=mapping)  # type: ignore[arg-type]
        pipe.expire(self._e(entry.key), ttl_s)
        pipe.zadd(self._lru, {entry.key: now})
        pipe.sadd(self._tenant(entry.tenant), entry.key)
        pipe.sadd(self._model(entry.model), entry.key)
        if entry.knowledge_base:
            pipe.sadd(self._kb(entry.tenant, entry.knowledge_base), entry.key)
        pipe.zcard(self._lru)
        results = await pipe.execute()
        over = int(results[-1]) - max_entries
        if over <= 0:
            return []
        popped = await self.redis.zpopmin(self._lru, over)
        evicted = [k.decode() if isinstance(k, bytes) else str(k) for k, _ in popped]  # type: ignore[str-unpack]
        if evicted:
            await self.redis.delete(*[self._e(k) for k in evicted])
        return evicted

    async def delete(self, keys: list[str]) -> int:
        """Deletes entries; returns how many still existed."""
        if not keys:
            return 0
        removed = 0
        for i in range(0, len(keys), 500):
            part = keys[i:i + 500]
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(*[self._e(k) for k in part])
            pipe.zrem(self._lru, *part)
            removed += int((await pipe.execute())[0])
        return removed

    async def _members(self, set_key: str) -> list[str]:
        return [m.decode() if isinstance(m, bytes) else str(m) for m in await self.redis.smembers(set_key)]

    async def keys_of_tenant(self, tenant: str) -> list[str]:
        return await self._members(self._tenant(tenant))

    async def keys_of_kb(self, tenant: str, kb: str) -> list[str]:
        return await self._members(self._kb(tenant, kb))

    async def keys_of_model(self, model: str) -> list[str]:
        return await self._members(self._model(model))

    async def forget_set(self, *, tenant: str = "", kb: str = "", model: str = "") -> None:
        if tenant and kb:
            await self.redis.delete(self._kb(tenant, kb))
        elif tenant:
            await self.redis.delete(self._tenant(tenant))
        elif model:
            await self.redis.delete(self._model(model))

    async def metas(self, keys: list[str]) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for i in range(0, len(keys), 500):
            part = keys[i:i + 500]
            pipe = self.redis.pipeline(transaction=False)
            for k in part:
                pipe.hget(self._e(k), "meta")
            for k, raw in zip(part, await pipe.execute(), strict=True):
                if raw is not None:
                    out[k] = Entry.from_json(raw)
        return out

    async def scan_recent(self, batch: int = 500) -> AsyncGenerator[tuple[Entry, np.ndarray], None]:
        """Every stored entry L2 may serve, with its vector, the most recently used first (what a restart loads
        into the semantic index, up to its budget: the caller stops reading when it is full)."""
        start = 0
        while keys := await self.redis.zrevrange(self._lru, start, start + batch - 1):
            start += len(keys)
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.hmget(self._e(k.decode() if isinstance(k, bytes) else str(k)), "meta", "vec")
            for meta, vec in await pipe.execute():
                if meta is not None and vec is not None:
                    yield Entry.from_json(meta), np.frombuffer(vec, dtype=np.float32)

    async def count(self) -> int:
        return int(await self.redis.zcard(self._lru))
