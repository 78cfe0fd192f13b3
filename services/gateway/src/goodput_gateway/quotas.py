"""Per-tenant and per-key limits, enforced the same by every gateway replica because their counters live in Redis.

Each request is admitted against the limits of its tenant and of its key (:class:`~goodput_gateway.auth.Quota`),
before anything is spent on it, and settled when it ends:

* **requests per minute**: the ``limits`` library's moving window (a Lua script on Redis): exact over any 60 s, so
  a tenant allowed N sending 3N through any number of replicas gets exactly N;
  With ``quota_quantum_s`` set, the same limit is also enforced pro rata over that many seconds (as OpenAI
  quantises its limits), so a tenant cannot spend a whole minute's requests in one burst that floods the fleet;
* **tokens per minute**: ``limits``' fixed window of 60 s. The prompt's estimated tokens are counted at admission
  (a request that would pass the limit is refused and its count given back); at the end the count is corrected to
  what the worker reports: its real prompt tokens plus the completion tokens generated, so a stream that ends early
  counts only what it produced, and a cache hit counts nothing (no inference was spent on it);
* **concurrent requests**: a sorted set per scope (an atomic script, all scopes at once; Redis's own clock), each
  member expiring with its request's deadline so a replica that dies leaks nothing for long;
* **monthly tokens**: a counter per calendar month (UTC) and scope; at or over the budget every request is refused
  with ``insufficient_quota`` (the hard stop) until the month ends. Requests in flight finish, so the budget can be
  passed by what they were already generating. The share used is exported for the soft threshold's alert.

Refusals are :class:`RateLimited` (429 ``rate_limit_exceeded``) or :class:`QuotaExhausted` (429
``insufficient_quota``), with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` values, which every admitted response
carries too (REST headers, gRPC metadata).

When Redis cannot be reached (or answers slower than ``quota_timeout_s``), quotas **fail open with a local bound**:
for ``quota_retry_s`` each replica enforces ``quota_fail_open_share`` of every rate and concurrency limit with
in-process counters (``limits``' memory storage), budgets are not checked, and every such decision is counted in
``goodput_quota_fail_open_total``. Without a Redis URL at all, the local counters are the quotas (one replica only).

Example (no Redis: the local counters)::

    quotas = Quotas(settings, redis_url="", registry=registry)
    admission = await quotas.admit(principal, prompt_tokens=120, timeout_s=300)
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
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.errors import StorageError
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from goodput_core.errors import ResourceExhausted

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.quota_counters import Backend, Scope, scopes_of
from goodput_gateway.tenants import TenantLabels

__all__ = ["Admission", "QuotaExhausted", "Quotas", "RateLimited", "format_reset", "month_of"]

log = logging.getLogger("goodput.gateway.quotas")
T = TypeVar("T")

_REDIS_DOWN = (RedisError, StorageError, OSError, asyncio.TimeoutError, ConnectionError)


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


class QuotaExhausted(RateLimited):
    """The monthly token budget is spent: 429 ``insufficient_quota`` until the month ends."""

    def __init__(self, message: str, *, headers: dict[str, str], retry_after_s: float) -> None:
        super().__init__(message, headers=headers, retry_after_s=retry_after_s, code="insufficient_quota")


@dataclass
class _Window:
    """What one scope's rate limits showed at admission (for the x-ratelimit headers)."""

    limit: int
    remaining: int
    reset_s: float


async def _rpm_window(backend: Backend, scope: Scope) -> _Window:
    item = backend.rpm_item(scope)
    stats = await backend.moving.get_window_stats(item, *scope.id())
    return _Window(item.amount, stats.remaining, stats.reset_time - time.time())


async def _tpm_window(backend: Backend, scope: Scope) -> _Window:
    item = backend.tpm_item(scope)
    stats = await backend.fixed.get_window_stats(item, *scope.id())
    return _Window(item.amount, stats.remaining, stats.reset_time - time.time() if stats.reset_time else 60.0)


def _headers(requests: list[_Window], tokens: list[_Window]) -> dict[str, str]:
    """OpenAI's six x-ratelimit headers, from the tightest scope of each kind (none of a kind without a limit)."""
    out: dict[str, str] = {}
    for kind, windows in (("requests", requests), ("tokens", tokens)):
        if not windows:
            continue
        w = min(windows, key=lambda w: (w.remaining, -w.reset_s))
        out[f"x-ratelimit-limit-{kind}"] = str(w.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(w.remaining, 0))
        out[f"x-ratelimit-reset-{kind}"] = format_reset(max(w.reset_s, 0.0))
    return out


@dataclass
class Admission:
    """A request admitted against its quotas. :meth:`settle` (always, once) corrects its token count, counts it in
    the month and gives back its concurrency place, off the response path."""

    quotas: Quotas
    scopes: list[Scope]
    backend: Backend
    member: str
    estimate: int
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
            await self.quotas.guarded(self.backend.release(self.scopes, self.member))
            for s in self.scopes:
                if s.quota.tpm and used != self.estimate:
                    await self.quotas.guarded(self.backend.add_tokens(s, used - self.estimate))
            month, _ = month_of()
            totals = await self.quotas.guarded(self.backend.add_month(self.scopes, month, used))
            for s, total in zip(self.scopes, totals, strict=False):
                self.quotas.observe_budget(s, total)
        except _REDIS_DOWN as err:
            # The in-flight member expires with its deadline; the tokens of this request are not in the counters.
            self.quotas.metrics.fail_open.labels("settle").inc()
            log.warning("quota settle failed; counters miss this request", extra={"error": str(err)})


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


class Quotas:
    def __init__(self, settings: GatewaySettings, *, redis_url: str, registry: CollectorRegistry | None = None,
                 labels: TenantLabels | None = None) -> None:
        self.settings = settings
        self.metrics = QuotaMetrics(registry, labels or TenantLabels(settings.metrics_tenants))
        prefix = settings.quotas.prefix
        self.local = Backend(MemoryStorage(), redis=None, prefix=prefix)
        self.fallback = Backend(MemoryStorage(), redis=None, prefix=prefix, share=settings.quotas.fail_open_share)
        self.remote: Backend | None = None
        self._redis: aioredis.Redis | None = None
        if redis_url:
            timeout = settings.quotas.timeout_s
            self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
            storage = RedisStorage(f"async+{redis_url}", implementation="redispy", key_prefix=f"{prefix}:limits",
                                   wrap_exceptions=True, socket_timeout=timeout, socket_connect_timeout=timeout)
            self.remote = Backend(storage, redis=self._redis, prefix=prefix)
        self._down_until = 0.0
        self._background: set[asyncio.Task[None]] = set()

    @property
    def shared(self) -> bool:
        """Whether the counters are shared by every replica (Redis configured)."""
        return self.remote is not None

    def _backend(self) -> Backend:
        if self.remote is None:
            return self.local
        return self.fallback if time.monotonic() < self._down_until else self.remote

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

    async def admit(self, principal: Principal, *, prompt_tokens: int, timeout_s: float) -> Admission:
        """Admits a request of ``prompt_tokens`` (estimated) against the principal's limits, or raises
        RateLimited / QuotaExhausted. ``timeout_s`` bounds how long its concurrency place is held if it is never
        settled (its deadline)."""
        scopes = scopes_of(principal)
        backend = self._backend()
        member = secrets.token_hex(8)
        if not scopes:
            return Admission(self, scopes, backend, member, prompt_tokens)
        try:
            return await self._admit(backend, principal, scopes, member, prompt_tokens, timeout_s)
        except _REDIS_DOWN as err:
            if backend is not self.remote:
                raise
            self._down_until = time.monotonic() + self.settings.quotas.retry_s
            self.metrics.fail_open.labels("admit").inc()
            # a step that timed out may still have taken a concurrency place in Redis: given back when Redis answers
            self.spawn(self._forget(backend, scopes, member))
            log.warning("quota store unreachable: enforcing the local bound", extra={"error": repr(err)})
            return await self._admit(self.fallback, principal, scopes, member, prompt_tokens, timeout_s)

    async def _forget(self, backend: Backend, scopes: list[Scope], member: str) -> None:
        with contextlib.suppress(*_REDIS_DOWN):  # else it expires with the request's deadline
            await asyncio.wait_for(backend.release(scopes, member), timeout=self.settings.quotas.retry_s)

    @staticmethod
    async def _windows(backend: Backend, scopes: list[Scope]) -> tuple[list[_Window], list[_Window]]:
        """Each scope's request and token windows as they stand, without counting anything in them."""
        return ([await _rpm_window(backend, s) for s in scopes if s.quota.rpm],
                [await _tpm_window(backend, s) for s in scopes if s.quota.tpm])

    async def _admit(self, backend: Backend, principal: Principal, scopes: list[Scope], member: str,
                     prompt_tokens: int, timeout_s: float) -> Admission:
        if backend is self.fallback:
            self.metrics.fail_open.labels("local_bound").inc()
        guarded = self.guarded
        month, month_left = month_of()

        # the hard stop: a spent monthly budget refuses everything until the month ends
        budgeted = [s for s in scopes if s.quota.monthly_tokens]
        if budgeted:
            for s, used in zip(budgeted, await guarded(backend.month_used(budgeted, month)), strict=True):
                self.observe_budget(s, used)
                if used >= s.quota.monthly_tokens:
                    raise self._refuse(principal, "budget", QuotaExhausted(
                        f"{s.describe()} has used its monthly budget of {s.quota.monthly_tokens} tokens "
                        f"({used} in {month}); it resets at the start of next month (UTC)",
                        headers=_headers(*await guarded(self._windows(backend, scopes))), retry_after_s=month_left))

        # concurrency: a place in every scope at once, or none (the refusal shows the rate windows, uncounted)
        full = await guarded(backend.acquire(scopes, member, timeout_s + 30.0))
        if full is not None:
            raise self._refuse(principal, "concurrent", RateLimited(
                f"{full.describe()} already has {full.quota.max_concurrent} requests in flight "
                f"(its max_concurrent); retry when one finishes",
                headers=_headers(*await guarded(self._windows(backend, scopes))), retry_after_s=1.0))
        try:
            requests: list[_Window] = []
            tokens: list[_Window] = []
            # requests per minute (moving window)
            for s in [s for s in scopes if s.quota.rpm]:
                item = backend.rpm_item(s)
                if self.settings.quotas.quantum_s:  # quantised: a share of the minute's requests per quantum
                    quantum = backend.quantum_item(s, self.settings.quotas.quantum_s)
                    if not await guarded(backend.moving.hit(quantum, *s.id())):
                        requests.append(await guarded(_rpm_window(backend, s)))
                        q_stats = await guarded(backend.moving.get_window_stats(quantum, *s.id()))
                        raise self._refuse(principal, "rpm", RateLimited(
                            f"{s.describe()} is over its limit of {item.amount} requests per minute, enforced as "
                            f"{quantum.amount} per {quantum.multiples} s", headers=_headers(requests, tokens),
                            retry_after_s=max(q_stats.reset_time - time.time(), 0.05)))
                ok = await guarded(backend.moving.hit(item, *s.id()))
                requests.append(await guarded(_rpm_window(backend, s)))
                if not ok:
                    raise self._refuse(principal, "rpm", RateLimited(
                        f"{s.describe()} is over its limit of {item.amount} requests per minute",
                        headers=_headers(requests, tokens), retry_after_s=max(requests[-1].reset_s, 0.05)))
            # tokens per minute (fixed window): the prompt now, corrected at the end
            counted: list[Scope] = []
            for s in [s for s in scopes if s.quota.tpm]:
                item = backend.tpm_item(s)
                if prompt_tokens > item.amount:
                    raise self._refuse(principal, "tpm", RateLimited(
                        f"this request's {prompt_tokens} prompt tokens are more than {s.describe()}'s limit of "
                        f"{item.amount} tokens per minute", headers=_headers(requests, tokens), retry_after_s=60.0))
                ok = await guarded(backend.fixed.hit(item, *s.id(), cost=prompt_tokens))
                if ok:
                    counted.append(s)
                else:  # the window counted the refused prompt too: given back before its stats are read
                    await guarded(backend.add_tokens(s, -prompt_tokens))
                tokens.append(await guarded(_tpm_window(backend, s)))
                if not ok:
                    for other in counted:
                        await guarded(backend.add_tokens(other, -prompt_tokens))
                    raise self._refuse(principal, "tpm", RateLimited(
                        f"{s.describe()} is over its limit of {item.amount} tokens per minute "
                        f"(this request: {prompt_tokens} prompt tokens)",
                        headers=_headers(requests, tokens), retry_after_s=max(tokens[-1].reset_s, 0.05)))
        except BaseException:
            await backend.release(scopes, member)
            raise
        return Admission(self, scopes, backend, member, prompt_tokens, headers=_headers(requests, tokens))
