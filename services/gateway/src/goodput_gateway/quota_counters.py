"""Where the quota counters live: one storage, Redis (shared by every replica) or this process's memory, and the
scopes (a tenant, an API key) it counts for; :mod:`goodput_gateway.quotas` admits and settles requests with them."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

from goodput_gateway.auth import Principal, Quota

__all__ = ["Backend", "Scope", "scopes_of"]

# Concurrency, every scope at once: drop expired members (Redis's clock), refuse naming the first full scope, or
# add the request to all. KEYS: one sorted set per scope. ARGV: ttl_s, member, then one limit per key.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= tonumber(ARGV[i + 2]) then return i end
end
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + ttl, ARGV[2])
  redis.call('EXPIRE', key, math.ceil(ttl) + 60)
end
return 0
"""


@dataclass(frozen=True)
class Scope:
    kind: str  # "tenant" | "key"
    name: str
    quota: Quota

    def id(self) -> tuple[str, str]:
        return (self.kind, self.name)

    def describe(self) -> str:
        return f"tenant {self.name!r}" if self.kind == "tenant" else f"API key {self.name!r}"


def scopes_of(principal: Principal) -> list[Scope]:
    scopes = []
    if principal.tenant_quota.limited:
        scopes.append(Scope("tenant", principal.tenant, principal.tenant_quota))
    if principal.key_id and principal.key_quota.limited:
        scopes.append(Scope("key", principal.key_id, principal.key_quota))
    return scopes


class Backend:
    """Counters in one storage: Redis (shared by every replica) or memory (this process)."""

    def __init__(self, storage: Storage, *, redis: aioredis.Redis | None, prefix: str, share: float = 1.0) -> None:
        self.storage = storage
        self.moving = MovingWindowRateLimiter(storage)
        self.fixed = FixedWindowRateLimiter(storage)
        self.redis = redis
        self.prefix = prefix
        self.share = share  # the fraction of each limit this backend enforces (the fail-open bound)
        self._acquire = redis.register_script(_ACQUIRE) if redis is not None else None
        self._local_inflight: defaultdict[tuple[str, str], set[str]] = defaultdict(set)

    def _bound(self, limit: int) -> int:
        return max(1, math.floor(limit * self.share)) if self.share < 1 else limit

    def rpm_item(self, scope: Scope) -> RateLimitItem:
        return RateLimitItemPerMinute(self._bound(scope.quota.rpm), namespace="rpm")

    def quantum_item(self, scope: Scope, quantum_s: int) -> RateLimitItem:
        """The requests limit pro rata over ``quantum_s`` seconds (at least one request), so a minute's worth
        cannot all arrive in its first seconds."""
        return RateLimitItemPerSecond(max(math.ceil(self._bound(scope.quota.rpm) * quantum_s / 60), 1), quantum_s,
                                      namespace="rpq")

    def tpm_item(self, scope: Scope) -> RateLimitItem:
        return RateLimitItemPerMinute(self._bound(scope.quota.tpm), namespace="tpm")

    def _inflight_key(self, scope: Scope) -> str:
        return f"{self.prefix}:inflight:{scope.kind}:{scope.name}"

    def budget_key(self, scope: Scope, month: str) -> str:
        return f"{self.prefix}:month:{scope.kind}:{scope.name}:{month}"

    # ---- concurrency ----
    async def acquire(self, scopes: list[Scope], member: str, ttl_s: float) -> Scope | None:
        """Adds ``member`` to every scope's in-flight set, or returns the first scope that is full."""
        bounded = [s for s in scopes if s.quota.max_concurrent]
        if not bounded:
            return None
        if self._acquire is not None:
            keys = [self._inflight_key(s) for s in bounded]
            limits = [self._bound(s.quota.max_concurrent) for s in bounded]
            full = int(await self._acquire(keys=keys, args=[ttl_s, member, *limits]))
            return bounded[full - 1] if full else None
        for s in bounded:
            if len(self._local_inflight[s.id()]) >= self._bound(s.quota.max_concurrent):
                return s
        for s in bounded:
            self._local_inflight[s.id()].add(member)
        return None

    async def release(self, scopes: list[Scope], member: str) -> None:
        bounded = [s for s in scopes if s.quota.max_concurrent]
        if not bounded:
            return
        if self.redis is not None:
            async with self.redis.pipeline(transaction=False) as pipe:
                for s in bounded:
                    pipe.zrem(self._inflight_key(s), member)
                await pipe.execute()
            return
        for s in bounded:
            self._local_inflight[s.id()].discard(member)

    # ---- monthly budget ----
    async def month_used(self, scopes: list[Scope], month: str) -> list[int]:
        if self.redis is None:
            return [0] * len(scopes)
        values = await self.redis.mget([self.budget_key(s, month) for s in scopes])
        return [int(v or 0) for v in values]

    async def add_month(self, scopes: list[Scope], month: str, tokens: int) -> list[int]:
        if self.redis is None or tokens <= 0:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for s in scopes:
                key = self.budget_key(s, month)
                pipe.incrby(key, tokens)
                pipe.expire(key, 40 * 86_400)
            results = await pipe.execute()
        return [int(v) for v in results[::2]]

    # ---- tokens per minute ----
    async def add_tokens(self, scope: Scope, tokens: int) -> None:
        """Counts ``tokens`` (a correction; negative gives back) in the scope's current window, unconditionally."""
        item = self.tpm_item(scope)
        key = item.key_for(*scope.id())
        if tokens < 0:
            current = await self.storage.get(key)
            tokens = -min(-tokens, current)  # never below zero, and never into a window that has expired
            if not tokens:
                return
        await self.storage.incr(key, item.get_expiry(), amount=tokens)
