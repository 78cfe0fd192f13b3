"""What each tenant used, by model: requests, prompt / completion / prefix-cached tokens, response-cache hits and
the inference they saved, and estimated GPU-seconds. Persisted in Redis per calendar month and day (UTC), read by
the tenant through ``GET /v1/usage`` (its own only) and by an operator key for every tenant.

Counts are added up in memory and written to Redis in one script every ``usage_flush_s`` (off the response path);
a write that fails is sent again, the same counts under the same flush id, until Redis takes it, so an outage of
Redis delays usage, it does not lose it (up to the process's lifetime; the gateway flushes on a clean stop). The
script adds a flush only if its id is new: a write Redis applied whose reply was lost (a timeout) is not counted
twice when it is sent again. Without Redis, usage lives in this process.

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
import json
import logging
import re
import time
import uuid
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

# KEYS[1]: the flush's id; KEYS[2]: the id of this replica's flush before it, whose reply came (it will not be sent
# again: its key goes); KEYS[3..]: the usage hashes and tenant sets it adds to. ARGV[1]: seconds the usage is kept;
# ARGV[2]: JSON [[hash's KEYS index, set's KEYS index, tenant, [[field, amount, is_float], ...]], ...].
# allow-oom: usage is small, and a store that filled a Redis it shares must not stop it being counted.
_FLUSH = """#!lua flags=allow-oom
redis.call('DEL', KEYS[2])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', %d) then return 0 end
for _, op in ipairs(cjson.decode(ARGV[2])) do
  local hash, set = KEYS[op[1]], KEYS[op[2]]
  for _, f in ipairs(op[4]) do
    redis.call(f[3] and 'HINCRBYFLOAT' or 'HINCRBY', hash, f[1], f[2])
  end
  redis.call('EXPIRE', hash, ARGV[1])
  redis.call('SADD', set, op[3])
  redis.call('EXPIRE', set, ARGV[1])
end
return 1
""" % (24 * 3600)  # an id outlives its flush's retries; one a replica that died could not delete goes in a day


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
        # A flush Redis may have applied (its write failed): sent again as it is, under its id, before anything newer
        self._unsent: tuple[str, dict[tuple[str, str, str], Usage]] | None = None
        self._acked = ""  # the id of the last flush whose reply came
        self._script = redis.register_script(_FLUSH) if redis is not None else None
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
            if self._script is None:
                pending, self._pending = self._pending, defaultdict(Usage)
                for (tenant, day, model), usage in pending.items():
                    for period in (day, day[:7]):
                        self._memory[(tenant, period)][model].add(usage)
                return True
            while self._unsent is not None or self._pending:
                if self._unsent is None:
                    self._unsent, self._pending = (uuid.uuid4().hex, self._pending), defaultdict(Usage)
                try:
                    await self._write(*self._unsent)
                except (RedisError, OSError, asyncio.TimeoutError) as err:
                    self.metrics.flush_errors.inc()
                    log.warning("usage not written to Redis; sent again with the next write",
                                extra={"error": str(err), "flush_id": self._unsent[0]})
                    return False
                self._acked, self._unsent = self._unsent[0], None
            return True

    def _flush_key(self, flush_id: str) -> str:
        return f"{self.settings.metering.usage_prefix}:flush:{flush_id}"

    async def _write(self, flush_id: str, pending: dict[tuple[str, str, str], Usage]) -> None:
        assert self._script is not None
        keys = [self._flush_key(flush_id), self._flush_key(self._acked or "-")]  # "-": none acknowledged yet
        index: dict[str, int] = {}

        def slot(key: str) -> int:  # the key's 1-based place in KEYS
            if key not in index:
                keys.append(key)
                index[key] = len(keys)
            return index[key]

        ops = []
        for (tenant, day, model), usage in pending.items():
            amounts = [[f"{model}|{name}", repr(value) if isinstance(value, float) else str(value),
                        isinstance(value, float)] for name, value in asdict(usage).items() if value]
            for period in (day, day[:7]):
                ops.append([slot(self._key(tenant, period)), slot(self._tenants_key(period)), tenant, amounts])
        ttl = int(self.settings.metering.retention_days * 86_400)
        await self._script(keys=keys, args=[ttl, json.dumps(ops)])

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
