"""What each tenant used, by model: requests, prompt / completion / prefix-cached tokens, response-cache hits and
the inference they saved, and estimated GPU-seconds. Persisted in Redis per calendar month and day (UTC), read by
the tenant through ``GET /v1/usage`` (its own only) and by an operator key for every tenant.

Counts are added up in memory and written to Redis in one pipeline every ``usage_flush_s`` (off the response
path); a write that fails keeps the counts for the next one, so an outage of Redis delays usage, it does not lose
it (up to the process's lifetime; the gateway flushes on a clean stop). Without Redis, usage lives in this process.

GPU-seconds are an estimate: prompt tokens over ``meter_prefill_tokens_per_s`` plus completion tokens over
``meter_decode_tokens_per_s`` (one GPU's prefill rate and its decode throughput at a typical batch), so a tenant
is charged its share of a batched GPU, not the wall time its stream was open.

Example (no Redis)::

    meter = Meter(settings, redis=None, registry=registry)
    meter.record("acme", "smollm2", Usage(requests=1, prompt_tokens=120, completion_tokens=40))
    await meter.flush()
    await meter.usage("acme", "2026-12")      # {"smollm2": {"requests": 1, "prompt_tokens": 120, ...}}
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from goodput_core.errors import InvalidArgument
from goodput_core.periodic import Periodic

from goodput_gateway.config import GatewaySettings
from goodput_gateway.tenants import TenantLabels

__all__ = ["Meter", "Usage", "parse_period"]

log = logging.getLogger("goodput.gateway.metering")
_PERIOD = re.compile(r"^\d{4}-(0[1-9]|1[0-2])(-(0[1-9]|[12]\d|3[01]))?$")


@dataclass
class Usage:
    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    cache_hits: int = 0  # answers served by the response cache
    saved_tokens: int = 0  # tokens the response cache's hits did not have to compute
    gpu_seconds: float = 0.0

    def add(self, other: Usage) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def parse_period(period: str | None) -> str:
    """A month ``YYYY-MM`` or a day ``YYYY-MM-DD`` (UTC); default: the current month.

    >>> parse_period("2026-12"), parse_period("2026-12-03")
    ('2026-12', '2026-12-03')
    """
    if not period:
        return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m")
    if not _PERIOD.match(period):
        raise InvalidArgument(f"period {period[:32]!r} is not a month (YYYY-MM) or a day (YYYY-MM-DD)",
                              param="period", code="invalid_period")
    return period


class MeterMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter("goodput_tenant_requests_total", "Requests by tenant, model and outcome.",
                                ["tenant", "model", "outcome"], registry=registry)
        self.tokens = Counter("goodput_tenant_tokens_total", "Tokens by tenant, model and kind (prompt, "
                              "completion, cached).", ["tenant", "model", "kind"], registry=registry)
        self.cache_hits = Counter("goodput_tenant_cache_hits_total", "Answers served by the response cache.",
                                  ["tenant", "model"], registry=registry)
        self.saved = Counter("goodput_tenant_saved_tokens_total", "Tokens the response cache's hits did not have "
                             "to compute.", ["tenant", "model"], registry=registry)
        self.gpu_seconds = Counter("goodput_tenant_gpu_seconds_total", "Estimated GPU-seconds.",
                                   ["tenant", "model"], registry=registry)
        self.flush_errors = Counter("goodput_usage_flush_errors_total", "Usage writes to Redis that failed (the "
                                    "counts are kept for the next write).", registry=registry)


class Meter:
    def __init__(self, settings: GatewaySettings, *, redis: aioredis.Redis | None,
                 registry: CollectorRegistry | None = None, labels: TenantLabels | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.labels = labels or TenantLabels(settings.metrics_tenants)
        self.metrics = MeterMetrics(registry)
        self._pending: dict[tuple[str, str, str], Usage] = defaultdict(Usage)  # (tenant, day, model)
        self._memory: dict[tuple[str, str], dict[str, Usage]] = defaultdict(lambda: defaultdict(Usage))
        self._writer = Periodic(self.flush, interval_s=settings.metering.flush_s, name="usage-writer")
        self._lock = asyncio.Lock()

    def gpu_seconds(self, prompt_tokens: int, completion_tokens: int) -> float:
        s = self.settings
        return prompt_tokens / s.metering.prefill_tokens_per_s + completion_tokens / s.metering.decode_tokens_per_s

    def record(self, tenant: str, model: str, usage: Usage, *, outcome: str = "ok") -> None:
        label = self.labels(tenant)
        m = self.metrics
        if usage.requests:
            m.requests.labels(label, model, outcome).inc(usage.requests)
        if usage.refused:
            m.requests.labels(label, model, "refused").inc(usage.refused)
        for kind in ("prompt", "completion", "cached"):
            n = getattr(usage, f"{kind}_tokens")
            if n:
                m.tokens.labels(label, model, kind).inc(n)
        for counter, n in ((m.cache_hits, usage.cache_hits), (m.saved, usage.saved_tokens),
                           (m.gpu_seconds, usage.gpu_seconds)):
            if n:
                counter.labels(label, model).inc(n)
        day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        self._pending[(tenant, day, model)].add(usage)

    # ---- persistence ----
    def _key(self, tenant: str, period: str) -> str:
        return f"{self.settings.metering.usage_prefix}:{tenant}:{period}"

    def _tenants_key(self, period: str) -> str:
        return f"{self.settings.metering.usage_prefix}:tenants:{period}"

    async def flush(self) -> bool:
        """Writes the pending counts; False (and kept for the next flush) when Redis failed."""
        async with self._lock:
            pending, self._pending = self._pending, defaultdict(Usage)
            if not pending:
                return True
            if self.redis is None:
                for (tenant, day, model), usage in pending.items():
                    for period in (day, day[:7]):
                        self._memory[(tenant, period)][model].add(usage)
                return True
            ttl = int(self.settings.metering.retention_days * 86_400)
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    for (tenant, day, model), usage in pending.items():
                        for period in (day, day[:7]):
                            key = self._key(tenant, period)
                            for name, value in asdict(usage).items():
                                if value:
                                    incr = pipe.hincrbyfloat if isinstance(value, float) else pipe.hincrby
                                    incr(key, f"{model}|{name}", value)
                            pipe.expire(key, ttl)
                            pipe.sadd(self._tenants_key(period), tenant)
                            pipe.expire(self._tenants_key(period), ttl)
                    await pipe.execute()
            except (RedisError, OSError, asyncio.TimeoutError) as err:
                for k, usage in pending.items():  # kept, merged with what came since
                    self._pending[k].add(usage)
                self.metrics.flush_errors.inc()
                log.warning("usage not written to Redis; kept for the next write", extra={"error": str(err)})
                return False
            return True

    async def usage(self, tenant: str, period: str) -> dict[str, dict[str, Any]]:
        """One tenant's usage in ``period`` (a month or a day), by model."""
        await self.flush()
        if self.redis is None:
            return {model: asdict(u) for model, u in sorted(self._memory.get((tenant, period), {}).items())}
        raw = await self.redis.hgetall(self._key(tenant, period))
        out: dict[str, dict[str, Any]] = defaultdict(lambda: asdict(Usage()))
        for field_, value in raw.items():
            f = field_.decode() if isinstance(field_, bytes) else str(field_)
            model, _, name = f.rpartition("|")
            out[model][name] = float(value) if name == "gpu_seconds" else int(value)
        return dict(sorted(out.items()))

    async def tenants(self, period: str) -> list[str]:
        await self.flush()
        if self.redis is None:
            return sorted({t for (t, p) in self._memory if p == period})
        members = await self.redis.smembers(self._tenants_key(period))
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    # ---- background writer ----
    def start(self) -> None:
        self._writer.start()

    async def stop(self) -> None:
        """Stops the writer and writes what is pending (retried for up to 2 s while Redis fails)."""
        await self._writer.stop()
        started = time.monotonic()
        while not await self.flush() and time.monotonic() - started < 2.0:
            await asyncio.sleep(0.2)
