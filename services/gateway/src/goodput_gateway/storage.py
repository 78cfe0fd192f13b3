"""Per-tenant storage quotas: how many objects of each kind a tenant keeps, and how large they are together.

Every store that keeps a tenant's data (files, batches, jobs, stored responses, stream-resume recordings, answers
kept for feedback) reserves its object in the tenant's **ledger** before it writes anything, and gives it back when
the object is deleted, when its write failed, or when it expires. A reservation names the object (its id), its size
(``amount``: bytes, or lines for a batch) and when the store's copy expires. The ledger of one (tenant, kind) is
three keys on the quota Redis, under one hash tag so that Redis Cluster keeps them together:

* ``<prefix>:{<tenant>}:<kind>``: a sorted set, object id -> when it expires (unix seconds);
* ``<prefix>:{<tenant>}:<kind>:amounts``: a hash, object id -> its amount;
* ``<prefix>:{<tenant>}:<kind>:total``: the sum of the amounts.

One Lua script checks and reserves (or releases) atomically, so two gateway replicas cannot both take the last
place. It first forgets what has expired (at most :data:`REAP` entries a call, more than any call adds), so space
comes back without a delete and without keyspace notifications. A reservation of an id already held only moves
its expiry (a retried write is not counted twice; a stream that ended holds its place only while it is kept).

The ledger sits on the quota Redis, apart from the stores' data: a tenant that fills the data Redis cannot touch
the quota counters, and the ledger refuses it long before that. A ledger that cannot be reached refuses the write
(503 ``store_unavailable``): storage never fails open. Without Redis the ledger is this process's (right for one
replica only).

Refusals come before anything is written: an object larger than its kind's byte limit on its own is 413
``object_too_large``; one that would take the tenant past its count or its bytes is 429 ``insufficient_quota``
naming the limit and what is in use, with a Retry-After of when its oldest object expires.

    >>> ledger = StorageLedger(None, prefix="q")
    >>> quota = StorageQuota(files=1, file_bytes=100)
    >>> ledger.reserve("acme", "files", "file-1", amount=60, expires_at=2e9, quota=quota)
    >>> try:
    ...     ledger.reserve("acme", "files", "file-2", amount=10, expires_at=2e9, quota=quota)
    ... except ResourceExhausted as err:
    ...     print(err.code, err.message)
    insufficient_quota tenant acme keeps 1 of its 1 files (60 bytes of its 100): delete one, or wait for one to expire
    >>> ledger.release("acme", "files", "file-1")
    >>> ledger.reserve("acme", "files", "file-2", amount=10, expires_at=2e9, quota=quota)
    >>> ledger.usage("acme", "files")
    (1, 10)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from goodput_core.errors import ResourceExhausted, Unavailable

from goodput_gateway.limits import PayloadTooLarge

__all__ = ["DEFAULT_STORAGE", "KINDS", "AsyncStorageLedger", "StorageLedger", "StorageQuota", "storage_prefix"]

REAP = 1000  # expired entries forgotten per call: far more than the one a call adds, so expiry keeps up


@dataclass(frozen=True)
class StorageQuota:
    """One tenant's storage limits; 0 = none. The defaults bound a tenant the operator never configured: with
    about 0.6 GiB at most per tenant on the data Redis (files 256 MiB, batch lines as large as their files, jobs
    64 MiB, responses 64 MiB, resume recordings 64 MiB, feedback ~20 MB), a data Redis of 4 GiB holds a handful of
    tenants each at its limit (docs/operations.md, "Redis")."""

    files: int = 100  # a batch's input or result file each; far more than a team keeps in flight
    file_bytes: int = 256 << 20  # 16 input files at the 16 MiB upload bound
    batches: int = 20  # batches kept (running, and their results until they expire)
    batch_lines: int = 100_000  # ten batches at the 10,000-line bound
    jobs: int = 10_000  # POST /v1/jobs and parked P2 requests, until their results expire
    job_bytes: int = 64 << 20  # their request bodies together (a body is at most 1 MiB)
    responses: int = 10_000  # stored Responses API responses
    response_bytes: int = 64 << 20  # their conversations together (~6 KiB each on average)
    resume_streams: int = 256  # streams recorded for resume at once (each at most RESUME__MAX_BYTES)
    feedback: int = 100_000  # answers kept for feedback (~200 bytes each): a day at about one answer a second


DEFAULT_STORAGE = StorageQuota()

# kind -> (the StorageQuota field of its count, that of its amount or "", the amount's unit)
KINDS: dict[str, tuple[str, str, str]] = {
    "files": ("files", "file_bytes", "bytes"),
    "batches": ("batches", "batch_lines", "lines"),
    "jobs": ("jobs", "job_bytes", "bytes"),
    "responses": ("responses", "response_bytes", "bytes"),
    "resume": ("resume_streams", "", ""),
    "feedback": ("feedback", "", ""),
}

# KEYS: the sorted set, the amounts, the total. ARGV: now, op (reserve | check | release | usage), id, amount,
# expires at, count limit, amount limit (0 = none). Returns {granted (1/0), count, total, when the oldest expires}.
_SCRIPT = """
local now = tonumber(ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, %d)
for _, id in ipairs(gone) do
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], id) or '0'))
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
end
if ARGV[2] == 'release' then
  local amount = redis.call('HGET', KEYS[2], ARGV[3])
  if amount then
    redis.call('DECRBY', KEYS[3], tonumber(amount))
    redis.call('HDEL', KEYS[2], ARGV[3])
    redis.call('ZREM', KEYS[1], ARGV[3])
  end
end
local count = redis.call('ZCARD', KEYS[1]) - redis.call('ZCOUNT', KEYS[1], '-inf', now)
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
if ARGV[2] == 'reserve' and redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[5], ARGV[3])
  return {1, count, total, 0}
end
if ARGV[2] ~= 'reserve' and ARGV[2] ~= 'check' then
  return {1, count, total, 0}
end
local amount, max_count, max_amount = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
if (max_count > 0 and count + 1 > max_count) or (max_amount > 0 and total + amount > max_amount) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, count, total, math.ceil(tonumber(oldest[2] or now))}
end
if ARGV[2] == 'check' then
  return {1, count, total, 0}
end
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], amount)
redis.call('INCRBY', KEYS[3], amount)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local until_ms = math.ceil(tonumber(last[2]) * 1000) + 60000
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], until_ms) end
return {1, count + 1, total + amount, 0}
""" % REAP


def storage_prefix(settings: Any) -> str:
    """Where the ledgers' keys live: beside the quota counters."""
    return f"{settings.quotas.prefix}:storage"


def _limits(kind: str, quota: StorageQuota) -> tuple[int, int, str]:
    count_field, amount_field, unit = KINDS[kind]
    return getattr(quota, count_field), getattr(quota, amount_field) if amount_field else 0, unit


def _too_large(tenant: str, kind: str, amount: int, quota: StorageQuota) -> PayloadTooLarge | None:
    """413 when one object alone is larger than its kind's limit."""
    _, max_amount, unit = _limits(kind, quota)
    if max_amount and amount > max_amount:
        return PayloadTooLarge(f"the object has {amount} {unit}; tenant {tenant}'s {KINDS[kind][1]} limit is "
                               f"{max_amount}", code="object_too_large")
    return None


def _refusal(tenant: str, kind: str, quota: StorageQuota, count: int, total: int, oldest: float,
             now: float) -> ResourceExhausted:
    max_count, max_amount, unit = _limits(kind, quota)
    name = KINDS[kind][0].replace("_", " ")
    use = f" ({total} {unit} of its {max_amount})" if max_amount else ""
    err = ResourceExhausted(f"tenant {tenant} keeps {count} of its {max_count or 'unlimited'} {name}{use}: delete "
                            "one, or wait for one to expire", code="insufficient_quota",
                            retry_after_s=max(oldest - now, 1.0) if oldest else None)
    err.headers = {"x-goodput-storage-limit": f"{KINDS[kind][0]}={max_count}"
                   + (f", {KINDS[kind][1]}={max_amount}" if max_amount else ""),
                   "x-goodput-storage-used": f"{KINDS[kind][0]}={count}" + (f", {unit}={total}" if max_amount else "")}
    return err


class _Local:
    """The ledger of this process only (no Redis): the same decisions over dicts."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], dict[str, tuple[float, int]]] = {}

    def run(self, tenant: str, kind: str, op: str, object_id: str, amount: int, expires_at: float,
            max_count: int, max_amount: int, now: float) -> tuple[int, int, int, float]:
        entries = self._entries.setdefault((tenant, kind), {})
        for gone in [k for k, (until, _) in entries.items() if until <= now]:
            del entries[gone]
        if op == "release":
            entries.pop(object_id, None)
        count, total = len(entries), sum(a for _, a in entries.values())
        if op == "reserve" and object_id in entries:
            entries[object_id] = (expires_at, entries[object_id][1])
            return 1, count, total, 0
        if op not in ("reserve", "check"):
            return 1, count, total, 0
        if (max_count and count + 1 > max_count) or (max_amount and total + amount > max_amount):
            return 0, count, total, min(until for until, _ in entries.values()) if entries else 0
        if op == "check":
            return 1, count, total, 0
        entries[object_id] = (expires_at, amount)
        return 1, count + 1, total + amount, 0


class _Ledger:
    """What the sync and async ledgers share: keys, arguments and decisions."""

    def __init__(self, redis: Any | None, *, prefix: str, clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._local = _Local() if redis is None else None
        self._script = redis.register_script(_SCRIPT) if redis is not None else None

    def _keys(self, tenant: str, kind: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}:{kind}"
        return [base, f"{base}:amounts", f"{base}:total"]

    def _call(self, tenant: str, kind: str, op: str, object_id: str = "", *, amount: int = 0,
              expires_at: float = 0.0, quota: StorageQuota = DEFAULT_STORAGE,
              enforce: bool = True) -> tuple[list[str], list[Any]]:
        if kind not in KINDS:
            raise ValueError(f"unknown storage kind {kind!r}")
        max_count, max_amount, _ = _limits(kind, quota) if enforce else (0, 0, "")
        return self._keys(tenant, kind), [self.clock(), op, object_id, int(amount), math.ceil(expires_at),
                                          max_count, max_amount]

    def _decide(self, tenant: str, kind: str, quota: StorageQuota, reply: Any) -> tuple[int, int]:
        granted, count, total, oldest = (int(float(v)) for v in reply)
        if not granted:
            raise _refusal(tenant, kind, quota, count, total, oldest, self.clock())
        return count, total

    def _local_run(self, keys: list[str], args: list[Any], tenant: str, kind: str) -> tuple[int, int, int, float]:
        assert self._local is not None
        now, op, object_id, amount, expires_at, max_count, max_amount = args
        return self._local.run(tenant, kind, op, object_id, amount, expires_at, max_count, max_amount, now)


def _unavailable(err: Exception) -> Unavailable:
    return Unavailable(f"the storage ledger is unavailable ({type(err).__name__}); nothing was stored",
                       code="store_unavailable")


class StorageLedger(_Ledger):
    """The ledger over a synchronous Redis client (the job and batch stores, which run in threads)."""

    def _run(self, tenant: str, kind: str, op: str, quota: StorageQuota, **kw: Any) -> tuple[int, int]:
        keys, args = self._call(tenant, kind, op, quota=quota, **kw)
        if self._script is None:
            return self._decide(tenant, kind, quota, self._local_run(keys, args, tenant, kind))
        try:
            reply = self._script(keys=keys, args=args)
        except (RedisError, OSError) as err:
            raise _unavailable(err) from None
        return self._decide(tenant, kind, quota, reply)

    def reserve(self, tenant: str, kind: str, object_id: str, *, amount: int = 0, expires_at: float,
                quota: StorageQuota, enforce: bool = True) -> None:
        """Holds a place for the object, or raises the refusal (413, 429 ``insufficient_quota``) before anything is
        written. ``enforce=False`` counts it without a check (what the platform writes itself, e.g. a batch's
        results)."""
        if enforce and (err := _too_large(tenant, kind, amount, quota)) is not None:
            raise err
        self._run(tenant, kind, "reserve", quota, object_id=object_id, amount=amount, expires_at=expires_at,
                  enforce=enforce)

    def release(self, tenant: str, kind: str, object_id: str) -> None:
        """Gives the object's place back (deleted, or its write failed); nothing when it holds none."""
        self._run(tenant, kind, "release", DEFAULT_STORAGE, object_id=object_id)

    def usage(self, tenant: str, kind: str) -> tuple[int, int]:
        """(objects, their amount) the tenant keeps of ``kind`` now."""
        return self._run(tenant, kind, "usage", DEFAULT_STORAGE)


class AsyncStorageLedger(_Ledger):
    """The ledger over an asyncio Redis client (the response, feedback and resume stores)."""

    async def _run(self, tenant: str, kind: str, op: str, quota: StorageQuota, **kw: Any) -> tuple[int, int]:
        keys, args = self._call(tenant, kind, op, quota=quota, **kw)
        if self._script is None:
            return self._decide(tenant, kind, quota, self._local_run(keys, args, tenant, kind))
        try:
            reply = await self._script(keys=keys, args=args)
        except (RedisError, OSError) as err:
            raise _unavailable(err) from None
        return self._decide(tenant, kind, quota, reply)

    async def reserve(self, tenant: str, kind: str, object_id: str, *, amount: int = 0, expires_at: float,
                      quota: StorageQuota, enforce: bool = True) -> None:
        """As :meth:`StorageLedger.reserve`."""
        if enforce and (err := _too_large(tenant, kind, amount, quota)) is not None:
            raise err
        await self._run(tenant, kind, "reserve", quota, object_id=object_id, amount=amount, expires_at=expires_at,
                        enforce=enforce)

    async def check(self, tenant: str, kind: str, *, quota: StorageQuota) -> None:
        """Raises the refusal a new object of ``kind`` would get now (before work whose result is to be stored:
        the reservation itself comes with the write)."""
        await self._run(tenant, kind, "check", quota)

    async def reserve_many(self, items: list[tuple[str, str, str, float, StorageQuota]]) -> list[bool]:
        """Reserves each (tenant, kind, id, expires at, quota), of no amount, in one round trip (what the platform
        keeps for many answers at once); whether each got its place."""
        calls = [(t, k, self._call(t, k, "reserve", i, expires_at=e, quota=q)) for t, k, i, e, q in items]
        if self._script is None or self.redis is None:
            return [bool(self._local_run(keys, args, t, k)[0]) for t, k, (keys, args) in calls]
        if not calls:
            return []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for _, _, (keys, args) in calls:
                    await self._script(keys=keys, args=args, client=pipe)
                replies = await pipe.execute()
        except (RedisError, OSError) as err:
            raise _unavailable(err) from None
        return [bool(int(reply[0])) for reply in replies]

    async def release(self, tenant: str, kind: str, object_id: str) -> None:
        await self._run(tenant, kind, "release", DEFAULT_STORAGE, object_id=object_id)

    async def usage(self, tenant: str, kind: str) -> tuple[int, int]:
        return await self._run(tenant, kind, "usage", DEFAULT_STORAGE)
