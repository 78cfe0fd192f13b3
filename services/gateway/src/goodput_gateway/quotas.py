"""Per-tenant and per-key limits, enforced the same by every gateway replica because their counters live in Redis.

Each request is admitted against the limits of its tenant and of its key (:class:`~goodput_gateway.auth.Quota`)
before anything is spent on it, by one atomic step over every limit of both (:mod:`goodput_gateway.quota_counters`:
one script on Redis), and settled when it ends. Admission **reserves** what the request may use: its prompt
(estimated) and ``max_tokens`` for each of its ``n`` answers; the settle corrects the reservation to what the worker
reports (its real prompt tokens and the completion tokens generated, nothing for a cache hit) and gives back the
concurrency place.

* **requests per minute** and **tokens per minute**: sliding-window counters (constant cost per admission), the
  whole reservation counted in the tokens; with ``quota_quantum_s`` set, requests are also limited pro rata over that
  many seconds (as OpenAI quantises its limits), so a minute's requests cannot all arrive in one burst;
* **concurrent requests**: a sorted set per scope, each member expiring with its request's deadline so a replica
  that dies leaks nothing for long;
* **monthly tokens**: a counter per calendar month (UTC) and scope, holding what was used and what is reserved by the
  requests in flight. While it is under the budget a request is admitted and its reservation counted; at or over it
  every request is refused with ``insufficient_quota`` (the hard stop) until the month ends. So the month's metered
  tokens pass the budget by at most **one reservation** (the last admitted while under it), whatever the number of
  requests or replicas, plus any error of the prompt's estimate. The share used is exported for the soft alert.

A refused scope is turned away here, without Redis: until its retry time when requests per minute refused it, for
a second when tokens or the budget did (a request ending may give back part of its reservation). Refusals are
:class:`RateLimited` (429 ``rate_limit_exceeded``) or :class:`QuotaExhausted` (429 ``insufficient_quota``), with
``Retry-After`` and OpenAI's ``x-ratelimit-*`` values, which every admitted response carries too (REST headers,
gRPC metadata).

When Redis cannot be reached (or answers slower than ``quota_timeout_s``), quotas **fail open with a local bound**:
for ``quota_retry_s`` each replica enforces ``quota_fail_open_share`` of every rate and concurrency limit with
in-process counters, and each month's use starts from what Redis last said of it, so a budget Redis said was spent
stays spent, and each replica may spend only that share of what was left (1 / replicas: the replicas together
spend at most the remainder, whatever made Redis look unreachable: a busy event loop can, as well as a Redis that is
down); every such decision is counted in ``goodput_quota_fail_open_total``. Without a Redis URL at all, the
local counters are the quotas (one replica only).

A Redis that **lost its data** (restarted without persistence, flushed, failed over to an empty replica) would say
every budget is unspent. The store has an **epoch** (``<prefix>:epoch``), named by every admission: a replica that
starts on a store without one creates it (``g:...``); one whose known epoch went missing or was replaced by
another replica's marks the store ``lost:<time>``, and from then on every replica refuses the requests of scopes
with a monthly budget as unknown (503 ``budget_unknown``; rates and concurrency still hold) and exports
``goodput_quota_store_lost`` 1, until an operator accepts the counters as they stand (``goodput quotas
accept-loss``, which writes an ``op:...`` epoch every replica adopts). A loss while no replica runs is not seen.

Example (no Redis: the local counters)::

    quotas = Quotas(settings, redis_url="", registry=registry)
    admission = await quotas.admit(principal, tokens=120 + 2 * 256, timeout_s=300)  # prompt + n * max_tokens
    ...  # the request runs; admission.headers go on its response
    admission.settle(prompt_tokens=118, completion_tokens=40, inference=True)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import secrets
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from goodput_contracts.quota_epoch import GATEWAY, LOST, OPERATOR, is_lost
from goodput_core.errors import ResourceExhausted, Unavailable

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.quota_counters import (
    Counters,
    EpochChanged,
    MemoryCounters,
    Reading,
    RedisCounters,
    Scope,
    scopes_of,
)
from goodput_gateway.tenants import TenantLabels

__all__ = ["Admission", "BudgetUnknown", "QuotaExhausted", "Quotas", "RateLimited", "format_reset", "month_of"]

log = logging.getLogger("goodput.gateway.quotas")
T = TypeVar("T")

# How long a refusal that a settle could undo (tokens, budget) turns its scope away here: it bounds a refused
# tenant's flood to one Redis step per second per replica, and a given-back reservation is seen a second later.
_TURN_AWAY_S = 1.0
_TURNS_AWAY = ("budget", "rpm", "rpq", "tpm")  # the refusals remembered (not concurrency: a place frees any time)
_REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError, ConnectionError)


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it.

    >>> format_reset(0.02), format_reset(1), format_reset(59.5), format_reset(360), format_reset(3725)
    ('20ms', '1s', '59.5s', '6m0s', '1h2m5s')
    """
    if seconds < 1:
        return f"{max(int(seconds * 1000), 0)}ms"
    if seconds < 60:
        return f"{seconds:.1f}s".replace(".0s", "s")
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


def month_of(now: float | None = None) -> tuple[str, float]:
    """The calendar month (UTC) of ``now`` and the seconds until the next one starts.

    >>> month_of(dt.datetime(2026, 12, 31, 23, 0, tzinfo=dt.timezone.utc).timestamp())
    ('2026-12', 3600.0)
    """
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc)
    nxt = dt.datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=dt.timezone.utc)
    return f"{t.year:04d}-{t.month:02d}", (nxt - t).total_seconds()


class RateLimited(ResourceExhausted):
    """A request over its requests-, tokens- or concurrency limit: 429 ``rate_limit_exceeded``."""

    def __init__(self, message: str, *, headers: dict[str, str], retry_after_s: float,
                 code: str = "rate_limit_exceeded") -> None:
        super().__init__(message, code=code, retry_after_s=retry_after_s)
        self.headers = dict(headers)


class BudgetUnknown(Unavailable):
    def __init__(self, scope: str) -> None:
        super().__init__(f"{scope}'s monthly budget cannot be checked: the quota store lost its counts (an operator "
                         "must confirm them, goodput quotas accept-loss); retry later", code="budget_unknown",
                         retry_after_s=60.0)


class QuotaExhausted(RateLimited):
    """The monthly token budget is spent: 429 ``insufficient_quota`` until the month ends."""

    def __init__(self, message: str, *, headers: dict[str, str], retry_after_s: float) -> None:
        super().__init__(message, headers=headers, retry_after_s=retry_after_s, code="insufficient_quota")


def _headers(reading: Reading, cost: int) -> dict[str, str]:
    """OpenAI's six x-ratelimit headers, from the tightest scope of each kind (none of a kind without a limit); an
    admitted request counted in them."""
    out: dict[str, str] = {}
    counted = reading.refused is None
    for kind, name in (("requests", "rpm"), ("tokens", "tpm")):
        windows = [w[name].after((1 if name == "rpm" else cost) if counted else 0)
                   for w in reading.windows if name in w]
        if not windows:
            continue
        w = min(windows, key=lambda w: w.remaining())
        out[f"x-ratelimit-limit-{kind}"] = str(w.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(w.remaining())
        # every request counted now has left the last minute within the minute (the counter's estimate of that
        # minute may lag behind it, which Retry-After allows for)
        out[f"x-ratelimit-reset-{kind}"] = format_reset(min(w.wait_s(0), w.period))
    return out


@dataclass
class Admission:
    """A request admitted against its quotas, with ``reserved`` tokens counted in its month and its tokens per
    minute. :meth:`settle` (always, once) corrects the reservation to what was really used, and gives back its
    concurrency place, off the response path."""

    quotas: Quotas
    scopes: list[Scope]
    counters: Counters
    member: str
    reserved: int
    month: str = ""
    window_index: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False
    used: int | None = None  # the tokens a call that is not a generation really used (set by the caller)

    def settle(self, *, prompt_tokens: int, completion_tokens: int, inference: bool) -> None:
        if self.settled:
            return
        self.settled = True
        if self.scopes:
            self.quotas.spawn(self._settle(prompt_tokens + completion_tokens if inference else 0))

    async def _settle(self, used: int) -> None:
        try:
            months = await self.quotas.guarded(self.counters.settle(
                self.scopes, member=self.member, month=self.month, window_index=self.window_index,
                correction=used - self.reserved))
            for s, month_used in zip(self.scopes, months, strict=True):
                self.quotas.observe_budget(s, month_used)
        except _REDIS_DOWN as err:
            # The in-flight member expires with its deadline; the reservation stands in place of the real use.
            self.quotas.metrics.fail_open.labels("settle").inc()
            log.warning("quota settle failed; the reservation stands for this request", extra={"error": str(err)})


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry | None, labels: TenantLabels) -> None:
        self.labels = labels
        self.refused = Counter("goodput_quota_refused_total", "Requests refused by a tenant's or key's limit.",
                               ["tenant", "limit"], registry=registry)
        self.fail_open = Counter("goodput_quota_fail_open_total", "Quota decisions taken against the local bound "
                                 "because Redis could not be reached, by step.", ["reason"], registry=registry)
        self.budget_used = Gauge("goodput_tenant_budget_used_ratio", "This month's tokens over the monthly budget, "
                                 "as last seen by this replica.", ["tenant"], registry=registry)
        self.budget_soft = Gauge("goodput_tenant_budget_soft_ratio", "The share of the monthly budget at which the "
                                 "soft threshold fires.", ["tenant"], registry=registry)
        self.store_lost = Gauge("goodput_quota_store_lost", "1 while the quota store is marked as having lost its "
                                "counts (budgeted requests refused until an operator accepts them).",
                                registry=registry)


class Quotas:
    def __init__(self, settings: GatewaySettings, *, redis_url: str, registry: CollectorRegistry | None = None,
                 labels: TenantLabels | None = None) -> None:
        self.settings = settings
        self.metrics = QuotaMetrics(registry, labels or TenantLabels(settings.metrics_tenants))
        self.local = MemoryCounters()
        self.fallback = MemoryCounters()
        self.remote: RedisCounters | None = None
        self._redis: aioredis.Redis | None = None
        if redis_url:
            timeout = settings.quotas.timeout_s
            self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
            self.remote = RedisCounters(self._redis, settings.quotas.prefix)
        self._down_until = 0.0
        self._background: set[asyncio.Task[None]] = set()
        # refusals that hold until a known time, answered here without Redis: (scope, limit) -> (until, error)
        self._turned_away: dict[tuple[Scope, str], tuple[float, RateLimited, int]] = {}

    @property
    def shared(self) -> bool:
        """Whether the counters are shared by every replica (Redis configured)."""
        return self.remote is not None

    def _counters(self) -> tuple[Counters, float]:
        """The counters to use now and the share of each rate and concurrency limit they enforce."""
        if self.remote is None:
            return self.local, 1.0
        if time.monotonic() < self._down_until:
            return self.fallback, self.settings.quotas.fail_open_share
        return self.remote, 1.0

    async def guarded(self, step: Awaitable[T]) -> T:
        return await asyncio.wait_for(step, timeout=self.settings.quotas.timeout_s)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle_all(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)

    async def close(self) -> None:
        await self.settle_all()
        if self._redis is not None:
            await self._redis.aclose()

    def observe_budget(self, scope: Scope, used: int) -> None:
        if scope.kind == "tenant" and scope.quota.monthly_tokens:
            tenant = self.metrics.labels(scope.name)
            self.metrics.budget_used.labels(tenant).set(used / scope.quota.monthly_tokens)
            self.metrics.budget_soft.labels(tenant).set(scope.quota.monthly_soft)

    def _refuse(self, principal: Principal, limit: str, err: RateLimited) -> RateLimited:
        self.metrics.refused.labels(self.metrics.labels(principal.tenant), limit).inc()
        return err

    def _still_turned_away(self, principal: Principal, scopes: list[Scope], tokens: int) -> None:
        """Raises the refusal a scope got earlier when it still holds (until its retry time; a tokens-per-minute
        refusal only for a request at least as large), without asking the counters."""
        now = time.monotonic()
        for key in ((s, limit) for s in scopes for limit in _TURNS_AWAY):
            if (held := self._turned_away.get(key)) is None:
                continue
            until, err, cost = held
            if until <= now:
                del self._turned_away[key]
            elif tokens >= cost:
                cls = QuotaExhausted if isinstance(err, QuotaExhausted) else RateLimited
                raise self._refuse(principal, "rpm" if key[1] == "rpq" else key[1],
                                   cls(err.message, headers=err.headers, retry_after_s=until - now))

    async def admit(self, principal: Principal, *, tokens: int, timeout_s: float) -> Admission:
        """Admits a request that may use ``tokens`` (its prompt and every answer's max_tokens) against the
        principal's limits, reserving them, or raises RateLimited / QuotaExhausted. ``timeout_s`` bounds how long
        its concurrency place is held if it is never settled (its deadline)."""
        scopes = scopes_of(principal)
        counters, share = self._counters()
        member = secrets.token_hex(8)
        if not scopes:
            return Admission(self, scopes, counters, member, tokens)
        self._still_turned_away(principal, scopes, tokens)
        for s in scopes:
            if s.quota.tpm and tokens > s.quota.tpm:
                raise self._refuse(principal, "tpm", RateLimited(
                    f"this request may use {tokens} tokens (its prompt and max_tokens for every answer), more than "
                    f"{s.describe()}'s limit of {s.quota.tpm} tokens per minute; lower max_tokens or n",
                    headers={}, retry_after_s=60.0, code="request_too_large"))
        month, month_left = month_of()
        try:
            reading = await (self._count_remote(scopes, member, tokens, timeout_s, month) if counters is self.remote
                             else self._count(counters, scopes, member, tokens, timeout_s, month, share))
        except _REDIS_DOWN as err:
            if counters is not self.remote:
                raise
            self._down_until = time.monotonic() + self.settings.quotas.retry_s
            self.metrics.fail_open.labels("admit").inc()
            # a script that timed out may still have counted the request in Redis: its place is given back when
            # Redis answers (the reservation stays, which only errs on the side of the budget)
            self.spawn(self._forget(scopes, member, month))
            log.warning("quota store unreachable: enforcing the local bound", extra={"error": repr(err)})
            counters, share = self.fallback, self.settings.quotas.fail_open_share
            reading = await self._count(counters, scopes, member, tokens, timeout_s, month, share)
        if reading.refused is None:
            return Admission(self, scopes, counters, member, tokens, month=month,
                             window_index=reading.window_index, headers=_headers(reading, tokens))
        raise self._refused(principal, scopes, reading, tokens, month, month_left)

    async def _count_remote(self, scopes: list[Scope], member: str, tokens: int, timeout_s: float,
                            month: str) -> Reading:
        """:meth:`_count` in Redis under the store's epoch, adopted or marked lost as it changes (at most twice: an
        operator's or a new store's, then ours)."""
        assert self.remote is not None
        budgeted = [s for s in scopes if s.quota.monthly_tokens]
        for _ in range(3):
            if budgeted and is_lost(self.remote.epoch):  # until an operator's epoch comes
                await self._epoch_changed(await self.guarded(self.remote.read_epoch()))
                if is_lost(self.remote.epoch):
                    raise BudgetUnknown(budgeted[0].describe())
            try:
                return await self._count(self.remote, scopes, member, tokens, timeout_s, month, 1.0)
            except EpochChanged as changed:
                await self._epoch_changed(changed.epoch)
        raise Unavailable("the quota store's epoch keeps changing", code="store_unavailable")

    async def _epoch_changed(self, epoch: str) -> None:
        """Adopts the store's ``epoch``, or marks the store lost when the one this replica knew went missing or
        another replica replaced it (a replica that started on the emptied store)."""
        assert self.remote is not None
        known = self.remote.epoch
        if epoch and epoch == known:  # seen by a request that began before another of this replica's adopted it
            return
        if epoch == "" and known == "":  # a new store (or one that lost its data while no replica ran)
            epoch = await self.guarded(self.remote.swap_epoch("", GATEWAY + secrets.token_hex(8)))
        elif not epoch.startswith((LOST, OPERATOR)) and known:
            log.error("the quota store lost its counts: budgets are unknown until an operator accepts them",
                      extra={"epoch_known": known, "epoch_found": epoch})
            lost = LOST + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            epoch = await self.guarded(self.remote.swap_epoch(epoch, lost))
        self.remote.epoch = epoch
        self.metrics.store_lost.set(1 if is_lost(epoch) else 0)

    async def _count(self, counters: Counters, scopes: list[Scope], member: str, tokens: int, timeout_s: float,
                     month: str, share: float) -> Reading:
        if counters is self.fallback:
            self.metrics.fail_open.labels("local_bound").inc()
        reading = await self.guarded(counters.admit(scopes, member=member, cost=tokens, ttl_s=timeout_s + 30.0,
                                                    month=month, quantum_s=self.settings.quotas.quantum_s,
                                                    share=share))
        for s, used in zip(scopes, reading.month_used, strict=True):
            self.observe_budget(s, used + (tokens if reading.refused is None else 0))
            if counters is self.remote:  # what Redis last said of the month holds while it is down
                self.fallback.floor(s, month, used + (tokens if reading.refused is None else 0))
        return reading

    async def _forget(self, scopes: list[Scope], member: str, month: str) -> None:
        assert self.remote is not None
        with contextlib.suppress(*_REDIS_DOWN):  # else it expires with the request's deadline
            await asyncio.wait_for(self.remote.settle(scopes, member=member, month=month, window_index=0,
                                                      correction=0), timeout=self.settings.quotas.retry_s)

    def _refused(self, principal: Principal, scopes: list[Scope], reading: Reading, tokens: int, month: str,
                 month_left: float) -> RateLimited:
        """The refusal for the limit ``reading`` names, remembered until its retry time where that is known."""
        s, limit = reading.scope, reading.refused
        assert s is not None and limit is not None
        i = scopes.index(s)
        headers = _headers(reading, tokens)
        err: RateLimited
        if limit == "budget":
            err = QuotaExhausted(
                f"{s.describe()} has used its monthly budget of {s.quota.monthly_tokens} tokens "
                f"({reading.month_used[i]} in {month}, the requests in flight counted at their max_tokens); it "
                f"resets at the start of next month (UTC)", headers=headers, retry_after_s=month_left)
        elif limit == "concurrent":
            return self._refuse(principal, limit, RateLimited(
                f"{s.describe()} already has {s.quota.max_concurrent} requests in flight (its max_concurrent); "
                f"retry when one finishes", headers=headers, retry_after_s=1.0))
        else:
            w = reading.windows[i][limit]
            retry = max(w.wait_s(w.limit - (tokens if limit == "tpm" else 1)), 0.05)
            what = {"rpm": f"its limit of {s.quota.rpm} requests per minute",
                    "rpq": f"its limit of {s.quota.rpm} requests per minute, enforced as {w.limit} per "
                           f"{self.settings.quotas.quantum_s} s",
                    "tpm": f"its limit of {s.quota.tpm} tokens per minute (this request may use {tokens})"}[limit]
            err = RateLimited(f"{s.describe()} is over {what}", headers=headers, retry_after_s=retry)
        assert err.retry_after_s is not None
        # a settle may give back reserved tokens, so a token or budget refusal is remembered for a second only
        hold = err.retry_after_s if limit in ("rpm", "rpq") else min(err.retry_after_s, _TURN_AWAY_S)
        self._turned_away[(s, limit)] = (time.monotonic() + hold, err, tokens if limit == "tpm" else 0)
        return self._refuse(principal, "rpm" if limit == "rpq" else limit, err)
