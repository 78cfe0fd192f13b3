"""Where the quota counters live, and the one step that checks and reserves all of a request's limits at once.

A request's scopes (its tenant, its API key) each have up to five counters: the month's tokens, the requests in
flight (a sorted set, each member expiring with its request's deadline), and three **sliding-window counters**
(requests per minute, requests per quantum, tokens per minute). A sliding-window counter keeps the count of the
current and the previous window and estimates the last ``period`` as ``previous * (1 - elapsed share) + current``:
constant work and memory per admission whatever the limit, where a moving window's list grows with it.

:meth:`Counters.admit` reads every counter of every scope, refuses naming the first limit passed, or else counts the
request in all of them; :meth:`Counters.settle` corrects the reservation to what was really used and gives back the
concurrency place. On Redis both are one Lua script each (atomic across replicas, on Redis's clock), flagged
``allow-oom`` (Redis 7): the counters are small, and a store that filled a Redis it shares with them (one Redis for
every role, the chart's default) must not turn the quotas off; in memory
(:class:`MemoryCounters`: one replica without Redis, or the local bound while Redis is down) the same steps run in
Python.

    >>> import asyncio
    >>> from goodput_gateway.auth import Quota
    >>> counters, tenant = MemoryCounters(), Scope("tenant", "acme", Quota(rpm=2, monthly_tokens=1000))
    >>> def admit(cost: int) -> Reading:
    ...     return asyncio.run(counters.admit([tenant], member="m", cost=cost, ttl_s=60, month="2026-12",
    ...                                       quantum_s=0, share=1.0))
    >>> [admit(600).refused for _ in range(3)]  # reserved: the second passes the budget, the third is refused
    [None, None, 'budget']
"""

from __future__ import annotations

import abc
import math
import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis

from goodput_contracts.quota_epoch import epoch_key, epoch_text

from goodput_gateway.auth import Principal, Quota

__all__ = ["Counters", "MemoryCounters", "Reading", "RedisCounters", "Scope", "Window", "scopes_of"]

# The limits of a scope in the order the scripts take them; a refusal names the first passed, budget first.
LIMITS = ("budget", "concurrent", "rpm", "rpq", "tpm")
_RATES = {"rpm": 2, "rpq": 3, "tpm": 4}  # the sliding windows' places in LIMITS
_MONTH_TTL_S = 40 * 86_400  # a month's counter outlives its month, for the usage that reads it

# KEYS: five per scope (month, inflight, rpm, rpq, tpm), then the store's epoch. ARGV: member, ttl_s, cost,
# quantum_s, then five limits per scope (0 = none), then the epoch the replica knows. Returns {-1, the epoch} when
# that is not the store's or the store has none (nothing counted), else {verdict (0 or the 1-based LIMITS index),
# scope (1-based), now, then per scope: month used, in flight, and current/previous counts of rpm, rpq, tpm} read
# before this request was counted.
_ADMIT = """#!lua flags=allow-oom
local epoch = redis.call('GET', KEYS[#KEYS]) or ''
if epoch == '' or epoch ~= ARGV[#ARGV] then return {-1, epoch} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl, cost, quantum = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local period = {0, 0, 60, quantum, 60}
local costs = {cost, 1, 1, 1, cost}
local n = (#KEYS - 1) / 5
local out, passed = {0, 0, tostring(now)}, {}
for i = 1, n do
  local k, lim = (i - 1) * 5, function(j) return tonumber(ARGV[4 + (i - 1) * 5 + j]) end
  local used = tonumber(redis.call('GET', KEYS[k + 1]) or '0')
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', now)
  local inflight = redis.call('ZCARD', KEYS[k + 2])
  out[#out + 1] = used
  out[#out + 1] = inflight
  if lim(1) > 0 and used >= lim(1) then passed[#passed + 1] = {1, i} end
  if lim(2) > 0 and inflight >= lim(2) then passed[#passed + 1] = {2, i} end
  for j = 3, 5 do
    local cur, prev = 0, 0
    if lim(j) > 0 then
      local w = math.floor(now / period[j])
      cur = tonumber(redis.call('HGET', KEYS[k + j], tostring(w)) or '0')
      prev = tonumber(redis.call('HGET', KEYS[k + j], tostring(w - 1)) or '0')
      if prev * (1 - (now / period[j] - w)) + cur + costs[j] > lim(j) then passed[#passed + 1] = {j, i} end
    end
    out[#out + 1] = cur
    out[#out + 1] = prev
  end
end
if #passed > 0 then
  table.sort(passed, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  out[1], out[2] = passed[1][1], passed[1][2]
  return out
end
for i = 1, n do
  local k, lim = (i - 1) * 5, function(j) return tonumber(ARGV[4 + (i - 1) * 5 + j]) end
  redis.call('INCRBY', KEYS[k + 1], cost)
  redis.call('EXPIRE', KEYS[k + 1], %(month_ttl)d)
  if lim(2) > 0 then
    redis.call('ZADD', KEYS[k + 2], now + ttl, ARGV[1])
    redis.call('EXPIRE', KEYS[k + 2], math.ceil(ttl) + 60)
  end
  for j = 3, 5 do
    if lim(j) > 0 then
      local w = math.floor(now / period[j])
      redis.call('HINCRBY', KEYS[k + j], tostring(w), costs[j])
      if redis.call('HLEN', KEYS[k + j]) > 2 then
        for _, f in ipairs(redis.call('HKEYS', KEYS[k + j])) do
          if tonumber(f) < w - 1 then redis.call('HDEL', KEYS[k + j], f) end
        end
      end
      redis.call('EXPIRE', KEYS[k + j], 2 * period[j] + 1)
    end
  end
end
return out
""".replace("%(month_ttl)d", str(_MONTH_TTL_S))

# Replaces the epoch only if it is still the one seen ("" = none: creates it; an operator's may have come meanwhile);
# returns the store's epoch.
_SWAP_EPOCH = """#!lua flags=allow-oom
local now = redis.call('GET', KEYS[1]) or ''
if now == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]); return ARGV[2] end
return now
"""

# KEYS: three per scope (month, inflight, tpm). ARGV: member, correction (tokens; negative gives back), the tpm
# window the reservation was counted in. A window's count never goes below zero, and one gone is left alone. Returns
# each scope's month as it now stands.
_SETTLE = """#!lua flags=allow-oom
local member, delta, w, out = ARGV[1], tonumber(ARGV[2]), ARGV[3], {}
for i = 1, #KEYS / 3 do
  local k = (i - 1) * 3
  redis.call('ZREM', KEYS[k + 2], member)
  if delta ~= 0 then
    if redis.call('EXISTS', KEYS[k + 1]) == 1 then redis.call('INCRBY', KEYS[k + 1], delta) end
    local cur = redis.call('HGET', KEYS[k + 3], w)
    if cur then redis.call('HSET', KEYS[k + 3], w, math.max(tonumber(cur) + delta, 0)) end
  end
  out[i] = tonumber(redis.call('GET', KEYS[k + 1]) or '0')
end
return out
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

    def limits(self, quantum_s: int, share: float) -> list[int]:
        """The five limits the scripts take (LIMITS' order); rates and concurrency scaled by ``share`` (the
        fail-open bound); the budget whole (the local bound shares out what is left of it: MemoryCounters)."""
        q = self.quota

        def bound(limit: int) -> int:
            return max(1, math.floor(limit * share)) if limit and share < 1 else limit

        rpq = max(math.ceil(bound(q.rpm) * quantum_s / 60), 1) if q.rpm and quantum_s else 0
        return [q.monthly_tokens, bound(q.max_concurrent), bound(q.rpm), rpq, bound(q.tpm)]


def scopes_of(principal: Principal) -> list[Scope]:
    scopes = []
    if principal.tenant_quota.limited:
        scopes.append(Scope("tenant", principal.tenant, principal.tenant_quota))
    if principal.key_id and principal.key_quota.limited:
        scopes.append(Scope("key", principal.key_id, principal.key_quota))
    return scopes


@dataclass(frozen=True)
class Window:
    """One sliding-window counter as an admission read it."""

    limit: int
    period: float
    current: float
    previous: float
    elapsed: float  # the share of the current window gone

    @property
    def count(self) -> float:
        """The estimate of the last ``period``'s count."""
        return self.previous * (1 - self.elapsed) + self.current

    def after(self, cost: int) -> Window:
        return Window(self.limit, self.period, self.current + cost, self.previous, self.elapsed)

    def remaining(self) -> int:
        return max(math.floor(self.limit - self.count + 1e-9), 0)

    def wait_s(self, room: float) -> float:
        """Seconds until the estimate falls to ``room`` (0 = every count aged out).

        >>> Window(limit=5, period=60, current=5, previous=0, elapsed=0.5).wait_s(4)  # next window, 1/5 in
        42.0
        """
        if self.current <= room:
            if self.count <= room:
                return 0.0
            return (1 - (room - self.current) / self.previous - self.elapsed) * self.period
        return (1 - self.elapsed + 1 - room / self.current) * self.period


@dataclass(frozen=True)
class Reading:
    """What :meth:`Counters.admit` saw (before counting the request) and decided."""

    refused: str | None  # the limit passed (one of LIMITS), None = admitted and counted
    scope: Scope | None  # whose limit
    month_used: list[int]  # per scope, this request not counted
    inflight: list[int]
    windows: list[dict[str, Window]]  # per scope, its limited rates by name
    window_index: int  # the tokens-per-minute window the request was counted in (for the settle)


def _reading(scopes: list[Scope], limits: list[list[int]], raw: list[object], quantum_s: int) -> Reading:
    verdict, at, now = int(raw[0]), int(raw[1]), float(raw[2])  # type: ignore[call-overload, arg-type]
    periods = {"rpm": 60.0, "rpq": float(quantum_s), "tpm": 60.0}
    used, inflight, windows = [], [], []
    for i, lim in enumerate(limits):
        row = [int(v) for v in raw[3 + i * 8: 3 + (i + 1) * 8]]  # type: ignore[call-overload]
        used.append(row[0])
        inflight.append(row[1])
        windows.append({name: Window(lim[j], periods[name], row[2 + 2 * (j - 2)], row[3 + 2 * (j - 2)],
                                     now / periods[name] - math.floor(now / periods[name]))
                        for name, j in _RATES.items() if lim[j]})
    return Reading(LIMITS[verdict - 1] if verdict else None, scopes[at - 1] if verdict else None, used, inflight,
                   windows, math.floor(now / 60))


class Counters(abc.ABC):
    """The counters of every scope in one storage."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    @abc.abstractmethod
    async def admit(self, scopes: list[Scope], *, member: str, cost: int, ttl_s: float, month: str,
                    quantum_s: int, share: float) -> Reading:
        """Refuses naming the first limit passed, or counts the request (``cost`` tokens) in every counter."""

    @abc.abstractmethod
    async def settle(self, scopes: list[Scope], *, member: str, month: str, window_index: int,
                     correction: int) -> list[int]:
        """Gives back the request's place and corrects its reservation by ``correction``; each scope's month."""

    def month_key(self, scope: Scope, month: str) -> str:
        return f"{self.prefix}:month:{scope.kind}:{scope.name}:{month}"


class EpochChanged(Exception):
    """The store's epoch is not the one the replica knows (``epoch``: the store's, "" = none): nothing was counted."""

    def __init__(self, epoch: str) -> None:
        super().__init__(f"the quota store's epoch is {epoch!r}")
        self.epoch = epoch


class RedisCounters(Counters):
    """The counters in Redis, shared by every replica: one script per admission and per settle. Every admission
    names the store's epoch (:mod:`goodput_gateway.quotas`): one that is not the store's counts nothing and raises
    :class:`EpochChanged`."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        super().__init__(prefix)
        self._redis = redis
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)
        self._swap = redis.register_script(_SWAP_EPOCH)
        self.epoch = ""  # the store's epoch as this replica knows it

    async def read_epoch(self) -> str:
        return epoch_text(await self._redis.get(epoch_key(self.prefix)))

    async def swap_epoch(self, seen: str, new: str) -> str:
        """Writes ``new`` if the store's epoch is still ``seen``; the store's epoch after."""
        return epoch_text(await self._swap(keys=[epoch_key(self.prefix)], args=[seen, new]))

    def _keys(self, scope: Scope, month: str) -> list[str]:
        base = f"{self.prefix}:{scope.kind}:{scope.name}"
        return [self.month_key(scope, month), f"{base}:inflight", f"{base}:rpm", f"{base}:rpq", f"{base}:tpm"]

    async def admit(self, scopes: list[Scope], *, member: str, cost: int, ttl_s: float, month: str,
                    quantum_s: int, share: float) -> Reading:
        limits = [s.limits(quantum_s, share) for s in scopes]
        raw = await self._admit(keys=[*(k for s in scopes for k in self._keys(s, month)), epoch_key(self.prefix)],
                                args=[member, ttl_s, cost, quantum_s, *(v for lim in limits for v in lim), self.epoch])
        if int(raw[0]) == -1:
            raise EpochChanged(epoch_text(raw[1]))
        return _reading(scopes, limits, raw, quantum_s)

    async def settle(self, scopes: list[Scope], *, member: str, month: str, window_index: int,
                     correction: int) -> list[int]:
        keys = [k for s in scopes for k in (self._keys(s, month)[i] for i in (0, 1, 4))]
        return [int(v) for v in await self._settle(keys=keys, args=[member, correction, window_index])]


class MemoryCounters(Counters):
    """The same counters in this process (the scripts' steps in Python): one replica without Redis, or the local
    bound while Redis is down. :meth:`floor` carries a month's use last seen in Redis into it; as the local bound
    (``share`` < 1) a replica may then spend only its share of what was left of the budget, so the replicas together
    spend at most replicas x share of the remainder while Redis is away (the remainder itself at 1 / replicas).

    >>> import asyncio
    >>> from goodput_gateway.auth import Quota
    >>> c, s = MemoryCounters(), Scope("tenant", "acme", Quota(monthly_tokens=1000))
    >>> c.floor(s, "2026-12", 600)  # Redis last said 600 of 1000 were used: 400 left, this replica's half is 200
    >>> [asyncio.run(c.admit([s], member=str(i), cost=100, ttl_s=60, month="2026-12", quantum_s=0, share=0.5)).refused
    ...  for i in range(3)]
    [None, None, 'budget']
    """

    def __init__(self, prefix: str = "local") -> None:
        super().__init__(prefix)
        self._month: defaultdict[str, int] = defaultdict(int)
        self._seen: defaultdict[str, int] = defaultdict(int)  # a month's use as Redis last said it
        self._inflight: defaultdict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        self._rates: defaultdict[tuple[str, str, str], dict[int, int]] = defaultdict(dict)

    def floor(self, scope: Scope, month: str, used: int) -> None:
        key = self.month_key(scope, month)
        self._month[key] = max(self._month[key], used)
        self._seen[key] = max(self._seen[key], used)

    async def admit(self, scopes: list[Scope], *, member: str, cost: int, ttl_s: float, month: str,
                    quantum_s: int, share: float) -> Reading:
        now = time.time()
        period = {"rpm": 60, "rpq": quantum_s, "tpm": 60}
        limits = [s.limits(quantum_s, share) for s in scopes]
        for s, lim in zip(scopes, limits, strict=True):
            if lim[0] and share < 1:  # the local bound: this replica's share of what Redis last said was left
                seen = min(self._seen[self.month_key(s, month)], lim[0])
                lim[0] = seen + math.floor((lim[0] - seen) * share)
        raw: list[object] = [0, 0, repr(now)]
        passed: list[tuple[int, int]] = []
        for i, (s, lim) in enumerate(zip(scopes, limits, strict=True), start=1):
            used = self._month[self.month_key(s, month)]
            flight = self._inflight[s.id()]
            for m in [m for m, until in flight.items() if until <= now]:
                del flight[m]
            raw += [used, len(flight)]
            passed += [(1, i)] if lim[0] and used >= lim[0] else []
            passed += [(2, i)] if lim[1] and len(flight) >= lim[1] else []
            for name, j in _RATES.items():
                cur = prev = 0
                if lim[j]:
                    w, counts = math.floor(now / period[name]), self._rates[(*s.id(), name)]
                    cur, prev = counts.get(w, 0), counts.get(w - 1, 0)
                    if prev * (1 - (now / period[name] - w)) + cur + (cost if name == "tpm" else 1) > lim[j]:
                        passed.append((j + 1, i))
                raw += [cur, prev]
        if passed:
            raw[0], raw[1] = min(passed)
            return _reading(scopes, limits, raw, quantum_s)
        for s, lim in zip(scopes, limits, strict=True):
            self._month[self.month_key(s, month)] += cost
            if lim[1]:
                self._inflight[s.id()][member] = now + ttl_s
            for name, j in _RATES.items():
                if lim[j]:
                    w, counts = math.floor(now / period[name]), self._rates[(*s.id(), name)]
                    counts[w] = counts.get(w, 0) + (cost if name == "tpm" else 1)
                    for old in [old for old in counts if old < w - 1]:
                        del counts[old]
        return _reading(scopes, limits, raw, quantum_s)

    async def settle(self, scopes: list[Scope], *, member: str, month: str, window_index: int,
                     correction: int) -> list[int]:
        for s in scopes:
            self._inflight[s.id()].pop(member, None)
            if correction:
                self._month[self.month_key(s, month)] += correction
                counts = self._rates[(*s.id(), "tpm")]
                if window_index in counts:
                    counts[window_index] = max(counts[window_index] + correction, 0)
        return [self._month[self.month_key(s, month)] for s in scopes]
