"""Noisy-neighbour benchmark: tenant A floods P0 at 10x its share while tenant B sends its normal P0 rate, through
the gateway (REST, streaming), on a simulated fleet; without quotas and with them, on the same arrivals.

For each fleet size, one platform (``goodput_cli.supervisor.Platform``: real gateway, scheduler and simulated
workers, ``GOODPUT_INFERENCE_ENGINE=sim``; only the GPU is simulated) and, in this order:

1. **calibration**: B's unloaded P0 TTFT, one request at a time, and the fleet's P0 capacity (closed loop, every
   slot busy, completions per second), both measured in this run;
2. **shares**: two tenants of equal weight, so each one's share is half the fleet: ``share_rps`` = capacity / 2
   and ``share_slots`` = slots / 2. A's flood is open-loop Poisson at ``--flood`` (10) x ``share_rps``; B's normal
   rate is ``--b-load`` (0.5) x ``share_rps``. The arrivals are drawn once (seeded) and replayed in every phase;
   only the prompts' text differs between phases (so no phase reuses another's prefix cache);
3. **phases**, ``--phase-s`` seconds of arrivals each: ``alone`` (B only: B's unloaded value, the reference of the
   goal), ``without_quotas`` (A + B, keys without limits: only the scheduler's per-tenant queue shares act) and one
   ``with_quotas`` run per ``--quota-runs`` entry (A + B, each tenant limited to its share in the gateway's keys
   file: ``rpm`` = share_rps x 60, and with ``+concurrent`` also ``max_concurrent`` = share_slots; the quota
   counters start empty), and ``no_limits_a_holds_every_slot`` (keys without limits; A holds every slot with long
   streams, ``--long-tokens`` each, in a closed loop of twice the fleet's slots started ``--hold-lead-s`` before B's
   arrivals, so B meets a full fleet: only the scheduler's fair share of the slots, with preemption, acts).

Per phase it reports B's success rate and TTFT p50/p95/p99 (first content delta of the SSE stream) with the ratio
of p99 to B's p99 alone (goal: <= 1.25x; <= 1.5x when A holds every slot with no limits, where it also reports how
many of A's requests were preempted, admitted again by the gateway, and how many finished) and A's admitted and
refused requests: by what refused them, and whether every refusal was a 429 with ``code: rate_limit_exceeded``
(``queue_full`` when the scheduler refused it), a ``Retry-After`` and sane ``x-ratelimit-*-requests`` headers (limit =
the configured rpm, 0 <= remaining <= limit, a parseable reset within the minute), and whether A passed its rpm more
often than the limit allows. A's flood is
sent from a separate process, so B's client (and its TTFT clock) does not share an event loop with it.

    python -m loadtests.noisy_neighbour                          # 2 and 4 workers, ~11 min on 2 cores
    python -m loadtests.noisy_neighbour --out loadtests/reports/noisy_neighbour   # the reference run
    python -m loadtests.noisy_neighbour --smoke                  # 2 workers, short phases, one quota run (~70 s)
    python -m loadtests.noisy_neighbour --render loadtests/reports/noisy_neighbour.json   # the report again

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests import bench
from loadtests.common import machine_info, percentile, summarize
from loadtests.simfleet import random_text

__all__ = ["BENCHMARK", "Outcome", "analyse_flood", "analyse_quiet", "goals", "main", "parse_reset", "refusal_kind",
           "refusal_problems"]

NOISY, QUIET, PROBE = "tenant-a", "tenant-b", "calibration"
LABELS = {NOISY: "A", QUIET: "B"}
PORT_OFFSET = 3400  # no other test or benchmark uses it (tests: 1000, 2300-3200, 3500, 3700; loadtests: 300, 3000)
TTFT_GOAL_RATIO = 1.25
AT_SHARE_GOAL_RATIO = 1.1  # B's TTFT p99 with quotas against what A at exactly its share leaves
HOLD_GOAL_RATIO = 1.5  # B's TTFT p99 against B alone when A holds every slot with no limits configured
RPM_WINDOW_S = 60.0
# The gateway's x-ratelimit-reset-* format (goodput_gateway.quotas.format_reset): 20ms, 1s, 59.5s, 6m0s, 1h2m5s.
_RESET = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


# ---- one request through the gateway -------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One streamed chat request as the client saw it."""

    tenant: str
    scheduled_s: float  # arrival, seconds after the phase's start
    lag_s: float = 0.0  # how late the client sent it (a load generator short of CPU shows here)
    status: int = 0  # HTTP status; 0 = no response (transport error)
    code: str = ""  # the OpenAI error body's code (a refusal, or an error event mid-stream)
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # Retry-After and x-ratelimit-*
    ttft_s: float | None = None  # to the first content delta
    e2e_s: float | None = None
    completed: bool = False  # a finish_reason and [DONE] arrived

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.completed


@dataclass(frozen=True)
class Traffic:
    """One tenant's arrivals in one phase (picklable: A's flood runs in another process)."""

    base_url: str
    key: str
    tenant: str
    tag: str  # makes the prompts unique to the phase (no prefix-cache reuse between phases)
    arrivals: tuple[float, ...]  # seconds after t0
    t0: float  # time.monotonic() of the phase's start (CLOCK_MONOTONIC: the same in every process)
    prompt_chars: int
    max_tokens: int
    timeout_s: float = 120.0


def prompt_for(tag: str, i: int, chars: int) -> str:
    head = f"{tag} request {i}: "
    return head + random_text(random.Random(f"{tag}-{i}"), max(chars - len(head), 1))


def _error_of(raw: bytes) -> tuple[str, str]:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or ""), str(err.get("message") or "")[:240]
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", raw[:240].decode("utf-8", "replace")


async def send(client: httpx.AsyncClient, traffic: Traffic, i: int) -> Outcome:
    scheduled = traffic.arrivals[i] if i < len(traffic.arrivals) else None  # None: closed loop, no schedule
    out = Outcome(tenant=traffic.tenant, scheduled_s=scheduled or 0.0)
    body = {"messages": [{"role": "user", "content": prompt_for(traffic.tag, i, traffic.prompt_chars)}],
            "max_tokens": traffic.max_tokens, "stream": True, "priority": "P0"}
    start = time.monotonic()
    out.lag_s = 0.0 if scheduled is None else max(0.0, start - (traffic.t0 + scheduled))
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {traffic.key}"}) as resp:
            out.status = resp.status_code
            out.headers = {k: v for k, v in resp.headers.items() if k == "retry-after" or k.startswith("x-ratelimit-")}
            if resp.status_code != 200:
                out.code, out.message = _error_of(await resp.aread())
                return out
            finished = done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:  # an error after the headers: an SSE event
                    out.code, out.message = str(event["error"].get("code") or ""), str(event["error"].get("message"))
                    continue
                for choice in event.get("choices") or ():
                    if out.ttft_s is None and (choice.get("delta") or {}).get("content"):
                        out.ttft_s = time.monotonic() - start
                    if choice.get("finish_reason"):
                        finished = True
            out.completed = finished and done
            out.e2e_s = time.monotonic() - start
    except (httpx.HTTPError, ValueError) as err:
        out.message = f"{type(err).__name__}: {err}"[:240]
    return out


async def drive(traffic: Traffic) -> list[Outcome]:
    """Sends every arrival at its time (open loop) and waits for all of them."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    timeout = httpx.Timeout(traffic.timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=traffic.base_url, timeout=timeout, limits=limits) as client:
        tasks = []
        for i, at in enumerate(traffic.arrivals):
            delay = traffic.t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, traffic, i)))
        return list(await asyncio.gather(*tasks))


def drive_in_process(traffic: Traffic) -> list[Outcome]:
    """:func:`drive` in a process of its own (a ProcessPoolExecutor's worker)."""
    return asyncio.run(drive(traffic))


async def hold(traffic: Traffic, *, concurrency: int, until: float) -> list[Outcome]:
    """A closed loop of ``concurrency`` requests at once, each sent again as soon as it ends (0.1 s later when it
    failed), until ``until`` (``time.monotonic()``); waits for the last ones."""
    out: list[Outcome] = []
    counter = itertools.count()
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=traffic.base_url, timeout=httpx.Timeout(traffic.timeout_s, connect=10.0),
                                 limits=limits) as client:
        async def loop() -> None:
            while time.monotonic() < until:
                r = await send(client, traffic, next(counter))
                out.append(r)
                if not r.ok:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return out


def hold_in_process(traffic: Traffic, concurrency: int, until: float) -> list[Outcome]:
    """:func:`hold` in a process of its own."""
    return asyncio.run(hold(traffic, concurrency=concurrency, until=until))


def _ready() -> bool:
    return True


def poisson(rng: random.Random, rate: float, duration_s: float) -> tuple[float, ...]:
    out: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        out.append(round(t, 4))
    return tuple(out)


# ---- calibration ---------------------------------------------------------------------------------------------------

async def sequential_ttft(base_url: str, key: str, tenant: str, *, n: int, prompt_chars: int,
                          max_tokens: int) -> list[float]:
    """B alone, one request at a time: its unloaded TTFT."""
    traffic = Traffic(base_url, key, tenant, "sequential", (), 0.0, prompt_chars, max_tokens)
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        for i in range(n):
            r = await send(client, traffic, i)
            if r.ok and r.ttft_s is not None:
                out.append(r.ttft_s)
            await asyncio.sleep(0.05)
    return out


async def capacity(base_url: str, key: str, *, concurrency: int, warmup_s: float, measure_s: float,
                   prompt_chars: int, max_tokens: int) -> dict[str, Any]:
    """Closed loop with every slot busy (a tenant of its own, no limits): P0 completions per second."""
    traffic = Traffic(base_url, key, PROBE, "capacity", (), 0.0, prompt_chars, max_tokens)
    done: list[float] = []
    refused = 0
    counter = iter(range(1_000_000))
    start = time.monotonic()
    stop = start + warmup_s + measure_s

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal refused
        while time.monotonic() < stop:
            r = await send(client, traffic, next(counter))
            if r.ok:
                done.append(time.monotonic())
            else:
                refused += 1
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, limits=limits) as client:
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
    window = [t for t in done if start + warmup_s <= t <= start + warmup_s + measure_s]
    return {"rps": len(window) / measure_s, "completed_in_window": len(window), "not_ok": refused,
            "concurrency": concurrency, "warmup_s": warmup_s, "measure_s": measure_s}


# ---- the keys file -----------------------------------------------------------------------------------------------

def keys_document(keys: dict[str, str], limits: dict[str, int] | None, marker: int) -> dict[str, Any]:
    """A and B with equal weights and, in a quota run, the same limits each; the probe tenant's rpm is a version
    marker (never reached) that shows on its responses once the gateway has reloaded this document."""
    tenants: dict[str, dict[str, Any]] = {NOISY: {"weight": 1}, QUIET: {"weight": 1}, PROBE: {"rpm": marker}}
    for t in (NOISY, QUIET):
        tenants[t].update(limits or {})
    return {"tenants": tenants,
            "keys": [{"id": f"{t}-key", "key": keys[t], "tenant": t, "max_priority": "P0", "default_priority": "P0"}
                     for t in (NOISY, QUIET, PROBE)]}


async def install_keys(platform: Any, doc: dict[str, Any], marker: int, probe_key: str, *,
                       timeout_s: float = 30.0) -> float:
    """Writes the keys document (atomically) and waits until the gateway serves it; returns the seconds taken."""
    from goodput_cli.keys import edit_keys_document

    started = time.monotonic()
    with edit_keys_document(platform.api_keys_file) as current:
        current.clear()
        current.update(doc)
    body = {"messages": [{"role": "user", "content": f"probe {marker} {secrets.token_hex(4)}"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=platform.gateway_http, timeout=30.0) as client:
        while time.monotonic() - started < timeout_s:
            r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {probe_key}"})
            if r.headers.get("x-ratelimit-limit-requests") == str(marker):
                return time.monotonic() - started
            await asyncio.sleep(0.25)
    raise RuntimeError(f"the gateway did not load the keys file within {timeout_s:.0f} s")


def reset_counters(redis_url: str, prefix: str) -> int:
    """Deletes this run's quota (and usage) keys, so a quota run starts with empty counters; the store's epoch
    stays (without it the gateways would take the store for one that lost its counts, and refuse budgets)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = [k for k in client.scan_iter(match=f"{prefix}*", count=1000) if not k.endswith(b":epoch")]
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


async def gateway_counters(metrics_url: str) -> dict[str, float]:
    """The gateway's quota counters (refusals by limit, fail-open decisions), summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(metrics_url)).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "goodput_gateway_preempted_total":
                    name = f"preempted:{s.labels.get('stage', '?')}"
                elif s.name == "goodput_quota_refused_total":
                    name = f"refused:{s.labels.get('limit', '?')}"
                elif s.name == "goodput_quota_fail_open_total":
                    name = f"fail_open:{s.labels.get('reason', '?')}"
                else:
                    continue
                out[name] = out.get(name, 0.0) + s.value
    except (httpx.HTTPError, ValueError):
        pass
    return out


# ---- analysis ------------------------------------------------------------------------------------------------------

def parse_reset(value: str) -> float | None:
    """Seconds of an ``x-ratelimit-reset-*`` value; None when it is not in the gateway's format.

    >>> parse_reset("20ms"), parse_reset("59.5s"), parse_reset("6m0s"), parse_reset("1h2m5s"), parse_reset("soon")
    (0.02, 59.5, 360.0, 3725.0, None)
    """
    if value.endswith("ms") and value[:-2].isdigit():
        return int(value[:-2]) / 1000
    m = _RESET.match(value)
    if not value or m is None:
        return None
    h, mi, s = m.groups()
    return int(h or 0) * 3600 + int(mi or 0) * 60 + float(s or 0)


def refusal_kind(o: Outcome) -> str:
    """What refused a request, from its error code and message.

    >>> refusal_kind(Outcome("a", 0, status=429, code="rate_limit_exceeded",
    ...                      message="tenant 'a' is over its limit of 5 requests per minute"))
    'rpm'
    """
    m = o.message
    if o.status == 0:
        return "no response"
    if "requests per minute, enforced as" in m:
        return "rpm quantum"
    if "requests per minute" in m:
        return "rpm"
    if "requests in flight" in m:
        return "max_concurrent"
    if "tokens per minute" in m:
        return "tpm"
    if o.code == "insufficient_quota":
        return "monthly budget"
    if o.code == "queue_full":
        return "scheduler: tenant share" if "share" in m else "scheduler: queue full"
    return f"{o.status} {o.code or m[:60]}".strip()


QUOTA_KINDS = ("rpm", "rpm quantum", "max_concurrent", "tpm")


def expected_code(kind: str) -> str:
    """The error code a refusal of this kind must carry: the gateway's quotas say ``rate_limit_exceeded`` (a spent
    monthly budget ``insufficient_quota``), the scheduler's queue ``queue_full``."""
    if kind == "monthly budget":
        return "insufficient_quota"
    return "queue_full" if kind.startswith("scheduler") else "rate_limit_exceeded"


def refusal_problems(o: Outcome, rpm: int) -> list[str]:
    """Why a refusal in a quota run is not what a client is promised ([] when it is): a 429 with its kind's code
    (``rate_limit_exceeded`` for a quota), ``Retry-After`` (whole seconds, at least 1) and, since the request's
    tenant has an rpm limit, ``x-ratelimit-*-requests`` with the configured limit (the gateway puts them on a later
    refusal by the scheduler too).

    >>> refusal_problems(Outcome("a", 0, status=429, code="rate_limit_exceeded", headers={"retry-after": "1"}), 60)
    ['x-ratelimit-*-requests missing']
    """
    problems = []
    kind = refusal_kind(o)
    if o.status != 429:
        problems.append(f"status {o.status}")
    if o.code != expected_code(kind):
        problems.append(f"code {o.code or '(none)'}")
    ra = o.headers.get("retry-after", "")
    if not ra.isdigit() or int(ra) < 1:
        problems.append("Retry-After missing or < 1 s")
    problems += ratelimit_problems(o.headers, rpm, refused_by_rpm=kind == "rpm")
    return problems


def ratelimit_problems(headers: dict[str, str], rpm: int, *, refused_by_rpm: bool = False) -> list[str]:
    limit, remaining = headers.get("x-ratelimit-limit-requests"), headers.get("x-ratelimit-remaining-requests")
    reset = headers.get("x-ratelimit-reset-requests")
    if limit is None or remaining is None or reset is None:
        return ["x-ratelimit-*-requests missing"]
    problems = []
    if limit != str(rpm):
        problems.append(f"x-ratelimit-limit-requests {limit} != configured {rpm}")
    if not remaining.isdigit() or int(remaining) > rpm:
        problems.append(f"x-ratelimit-remaining-requests {remaining} not within 0..{rpm}")
    elif refused_by_rpm and int(remaining) != 0:
        problems.append(f"x-ratelimit-remaining-requests {remaining} on an rpm refusal")
    seconds = parse_reset(reset)
    if seconds is None or not 0 <= seconds <= RPM_WINDOW_S:
        problems.append(f"x-ratelimit-reset-requests {reset!r} not a time within the minute")
    return problems


def _ms(values: Sequence[float]) -> list[float]:
    return [round(v * 1000, 1) for v in values]


def analyse_quiet(outcomes: list[Outcome], *, rpm: int | None) -> dict[str, Any]:
    """B's side of a phase: success, TTFT and, in a quota run, the x-ratelimit headers of its admitted responses."""
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    out: dict[str, Any] = {
        "n": len(outcomes), "ok": len(ok), "success_rate": len(ok) / len(outcomes) if outcomes else None,
        "ttft": summarize(ttft), "e2e": summarize([o.e2e_s for o in ok if o.e2e_s is not None]),
        "ttft_ms": _ms(ttft),
        "failures": Counter(refusal_kind(o) if o.status != 200 else f"stream: {o.code or o.message[:60]}"
                            for o in outcomes if not o.ok).most_common(5),
        "client_lag_p99_ms": (percentile([o.lag_s for o in outcomes], 99) or 0.0) * 1000,
    }
    if rpm:
        admitted = [o for o in outcomes if o.status == 200]
        bad = Counter(p for o in admitted for p in ratelimit_problems(o.headers, rpm))
        out["admitted_headers"] = {"checked": len(admitted), "ok": sum(1 for o in admitted
                                                                       if not ratelimit_problems(o.headers, rpm)),
                                   "problems": bad.most_common(5)}
    return out


def analyse_flood(outcomes: list[Outcome], *, phase_s: float, rpm: int | None) -> dict[str, Any]:
    """A's side of a phase: what was admitted, what refused it and, in a quota run, whether every refusal carried
    what a client is promised."""
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    retry_after = [float(o.headers["retry-after"]) for o in refused if o.headers.get("retry-after", "").isdigit()]
    out: dict[str, Any] = {
        "n": len(outcomes), "offered_rps": len(outcomes) / phase_s if phase_s else None,
        "admitted": len(admitted), "admitted_rps": len(admitted) / phase_s if phase_s else None,
        "completed": sum(1 for o in outcomes if o.ok), "refused": len(refused),
        "refused_by": Counter(refusal_kind(o) for o in refused).most_common(),
        "other_failures": Counter(refusal_kind(o) if o.status != 200 else f"stream: {o.code or o.message[:60]}"
                                  for o in outcomes if o.status != 429 and not o.ok).most_common(5),
        "retry_after_s": {"min": min(retry_after), "p50": percentile(retry_after, 50), "max": max(retry_after)}
        if retry_after else None,
        "refusals_with_retry_after": sum(1 for o in refused if o.headers.get("retry-after")),
        "client_lag_p99_ms": (percentile([o.lag_s for o in outcomes], 99) or 0.0) * 1000,
    }
    if rpm:
        kinds: dict[str, list[int]] = {}
        problems: Counter[str] = Counter()
        for o in refused:
            found = refusal_problems(o, rpm)
            tally = kinds.setdefault(refusal_kind(o), [0, 0])
            tally[0] += not found
            tally[1] += 1
            problems.update(f"{refusal_kind(o)}: {p}" for p in found)
        out["refusal_checks"] = {"checked": len(refused), "ok": sum(ok for ok, _ in kinds.values()),
                                 "by_quota": sum(n for k, (_, n) in kinds.items() if k in QUOTA_KINDS),
                                 "ok_by_kind": kinds, "problems": problems.most_common(8)}
        bad = Counter(p for o in admitted for p in ratelimit_problems(o.headers, rpm))
        out["admitted_headers"] = {"checked": len(admitted), "ok": sum(1 for o in admitted
                                                                       if not ratelimit_problems(o.headers, rpm)),
                                   "problems": bad.most_common(5)}
    return out


# ---- the benchmark -------------------------------------------------------------------------------------------------

QUOTA_RUNS = {"rpm": ("rpm",), "rpm+concurrent": ("rpm", "max_concurrent")}
AT_SHARE = "a_at_its_share"
HOLDS_ALL = "no_limits_a_holds_every_slot"


async def run_fleet(args: argparse.Namespace, workers: int, pool: ProcessPoolExecutor,
                    flood_ready: Future[bool]) -> dict[str, Any]:
    """One platform of ``workers`` simulated workers: calibration, then every phase on the same arrivals."""
    from goodput_cli.supervisor import Platform

    run_id = secrets.token_hex(4)
    quota_prefix, usage_prefix = f"goodput:nn-{run_id}:quota", f"goodput:nn-{run_id}:usage"
    sim = {"time_scale": args.time_scale, "stream_every": 8, "max_batched_tokens": args.max_batched_tokens}
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps(sim),
           "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(args.max_num_seqs),
           "GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER": str(args.max_num_seqs),
           "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.25", "GOODPUT_GATEWAY_API_KEYS_RELOAD_S": "0.5",
           "GOODPUT_GATEWAY_QUOTAS__PREFIX": quota_prefix, "GOODPUT_GATEWAY_METERING__USAGE_PREFIX": usage_prefix,
           "GOODPUT_GATEWAY_QUOTAS__QUANTUM_S": str(args.quantum_s),
           **{f"GOODPUT_{svc}_LOG_LEVEL": "WARNING" for svc in ("GATEWAY", "SCHEDULER", "INFERENCE")}}
    keys = {t: f"nn-{t}-{secrets.token_hex(12)}" for t in (NOISY, QUIET, PROBE)}
    slots = workers * args.max_num_seqs
    fleet: dict[str, Any] = {"workers": workers, "slots": slots, "phases": {}}
    workdir = tempfile.TemporaryDirectory(prefix="goodput-noisy-")
    platform = Platform(workdir=Path(workdir.name), workers=workers, port_offset=args.port_offset, env=env,
                        api_keys=keys_document(keys, None, 0)["keys"], knowledge=False, cache=False, jobs=False,
                        redis_db=args.redis_db)
    base = platform.gateway_http
    markers = iter(range(10_000_000, 11_000_000))

    async def apply(limits: dict[str, int] | None) -> float:
        marker = next(markers)
        return await install_keys(platform, keys_document(keys, limits, marker), marker, keys[PROBE])

    try:
        started = time.monotonic()
        platform.start(timeout_s=180)
        fleet["start_s"] = time.monotonic() - started
        await apply(None)

        seq = await sequential_ttft(base, keys[QUIET], QUIET, n=args.unloaded_n, prompt_chars=args.prompt_chars,
                                    max_tokens=args.max_tokens)
        fleet["unloaded_sequential"] = summarize(seq)
        cap = await capacity(base, keys[PROBE], concurrency=slots + 2, warmup_s=args.warmup_s,
                             measure_s=args.capacity_s, prompt_chars=args.prompt_chars, max_tokens=args.max_tokens)
        fleet["capacity"] = cap
        share_rps = cap["rps"] * args.share
        share_slots = max(1, round(slots * args.share))
        rpm = max(1, math.ceil(share_rps * RPM_WINDOW_S))
        rates = {NOISY: args.flood * share_rps, QUIET: args.b_load * share_rps}
        fleet["share"] = {"fraction": args.share, "rps": share_rps, "slots": share_slots}
        fleet["rates_rps"] = {LABELS[t]: r for t, r in rates.items()}
        fleet["limits"] = {"rpm": rpm, "max_concurrent": share_slots, "weight": 1}
        print(f"[{workers} workers] B unloaded TTFT p50 {fleet['unloaded_sequential']['p50_ms'] or 0:.0f} ms "
              f"p99 {fleet['unloaded_sequential']['p99_ms'] or 0:.0f} ms; capacity {cap['rps']:.2f} req/s; share "
              f"{share_rps:.2f} req/s, {share_slots} slots; A {rates[NOISY]:.1f} req/s, B {rates[QUIET]:.2f} req/s",
              flush=True)
        if cap["rps"] <= 0:
            raise RuntimeError("the fleet completed nothing while measuring its capacity")
        arrivals = {t: poisson(random.Random(f"{args.seed}-{workers}-{t}"), rates[t], args.phase_s)
                    for t in (NOISY, QUIET)}
        # The best quotas can do: A sending exactly its share (no flood, no limits) beside B's same arrivals.
        at_share = poisson(random.Random(f"{args.seed}-{workers}-{NOISY}-share"), share_rps, args.phase_s)

        phases: list[tuple[str, tuple[str, ...] | None, bool]] = [("alone", None, False)]
        if args.at_share:
            phases.append((AT_SHARE, None, True))
        phases.append(("without_quotas", None, True))
        phases += [(f"with_quotas[{name}]", QUOTA_RUNS[name], True) for name in args.quota_runs]
        if args.holds_all:
            phases.append((HOLDS_ALL, None, True))
        await asyncio.wrap_future(flood_ready)
        for name, limit_kinds, flood in phases:
            phase_s = args.phase_s if flood else args.alone_s
            limits = None
            if limit_kinds is not None:
                limits = {k: fleet["limits"][k] for k in limit_kinds}
            deleted = reset_counters(platform.redis_url, quota_prefix)
            reload_s = await apply(limits)
            await asyncio.sleep(0.5)  # the probe's request leaves the fleet
            before = await gateway_counters(platform.gateway_metrics)
            # A's process gets its arrivals meanwhile (and, holding every slot, fills them before B's first)
            t0 = time.monotonic() + (args.hold_lead_s if name == HOLDS_ALL else 0.5)
            tag = f"{name} {workers}w"
            quiet = Traffic(base, keys[QUIET], QUIET, f"{tag} B", tuple(a for a in arrivals[QUIET] if a <= phase_s),
                            t0, args.prompt_chars, args.max_tokens)
            loop = asyncio.get_running_loop()
            flood_future: asyncio.Future[list[Outcome]] | None
            if name == HOLDS_ALL:
                noisy = Traffic(base, keys[NOISY], NOISY, f"{tag} A", (), t0, args.prompt_chars, args.long_tokens)
                flood_future = loop.run_in_executor(pool, hold_in_process, noisy, 2 * slots, t0 + phase_s)
            else:
                noisy = Traffic(base, keys[NOISY], NOISY, f"{tag} A",
                                at_share if name == AT_SHARE else arrivals[NOISY], t0, args.prompt_chars,
                                args.max_tokens)
                flood_future = loop.run_in_executor(pool, drive_in_process, noisy) if flood else None
            quiet_out = await drive(quiet)
            noisy_out = await flood_future if flood_future is not None else []
            drain_s = time.monotonic() - (t0 + phase_s)
            after = await gateway_counters(platform.gateway_metrics)
            rpm_in_force = limits.get("rpm") if limits else None
            phase = {"limits": limits, "phase_s": phase_s, "quiet": analyse_quiet(quiet_out, rpm=rpm_in_force),
                     "noisy": analyse_flood(noisy_out, phase_s=phase_s, rpm=rpm_in_force) if flood else None,
                     "drain_s": drain_s, "keys_reload_s": reload_s, "counters_reset": deleted,
                     "gateway_counters": {k: v - before.get(k, 0.0) for k, v in after.items()
                                          if v - before.get(k, 0.0)}}
            fleet["phases"][name] = phase
            q = phase["quiet"]
            line = (f"[{workers} workers] {name}: B {q['ok']}/{q['n']} ok, TTFT p50 {q['ttft']['p50_ms'] or 0:.0f} "
                    f"p99 {q['ttft']['p99_ms'] or 0:.0f} ms")
            if phase["noisy"]:
                a = phase["noisy"]
                line += f"; A {a['admitted']}/{a['n']} admitted, refused by {dict(a['refused_by'])}"
                if "refusal_checks" in a:
                    line += f", {a['refusal_checks']['ok']}/{a['refusal_checks']['checked']} refusals as promised"
                if name == HOLDS_ALL:
                    counters = phase["gateway_counters"]
                    line += (f"; A {a['completed']} finished, {counters.get('preempted:before_first_token', 0):.0f} "
                             f"preempted before their first token, {counters.get('preempted:mid_stream', 0):.0f} "
                             "mid-stream (resumed)")
            print(line, flush=True)
    finally:
        platform.stop()
        try:
            reset_counters(platform.redis_url, f"goodput:nn-{run_id}:")
        except Exception as err:  # noqa: BLE001 - leftover keys under a unique prefix are harmless
            print(f"could not delete this run's Redis keys: {err}", file=sys.stderr)
        workdir.cleanup()
    alone = fleet["phases"]["alone"]["quiet"]["ttft"]["p99_ms"]
    fair = fleet["phases"].get(AT_SHARE, {}).get("quiet", {}).get("ttft", {}).get("p99_ms")
    seq_p99 = fleet["unloaded_sequential"]["p99_ms"]
    for phase in fleet["phases"].values():
        p99 = phase["quiet"]["ttft"]["p99_ms"]
        phase["quiet"]["p99_vs_alone"] = p99 / alone if p99 and alone else None
        phase["quiet"]["p99_vs_at_share"] = p99 / fair if p99 and fair else None
        phase["quiet"]["p99_vs_sequential"] = p99 / seq_p99 if p99 and seq_p99 else None
    return fleet


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": machine_info(),
        "setup": {"workers": args.workers, "max_num_seqs": args.max_num_seqs,
                  "sim": {"time_scale": args.time_scale, "stream_every": 8,
                          "max_batched_tokens": args.max_batched_tokens},
                  "prompt_chars": args.prompt_chars, "max_tokens": args.max_tokens, "phase_s": args.phase_s,
                  "alone_s": args.alone_s,
                  "share": args.share, "flood": args.flood, "b_load": args.b_load, "quota_runs": args.quota_runs,
                  "quantum_s": args.quantum_s, "at_share": args.at_share, "unloaded_n": args.unloaded_n,
                  "seed": args.seed, "p0_max_queue": 20, "smoke": args.quick,
                  "goal_ttft_ratio": TTFT_GOAL_RATIO, "holds_all": args.holds_all, "long_tokens": args.long_tokens,
                  "hold_lead_s": args.hold_lead_s, "hold_goal_ratio": HOLD_GOAL_RATIO},
        "fleets": [],
    }
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        flood_ready = pool.submit(_ready)  # A's process starts (imports) while the first platform starts
        for workers in args.workers:
            report["fleets"].append(await run_fleet(args, workers, pool, flood_ready))
    return report


# ---- goals, report and plot (the prose: templates/noisy_neighbour.md) ------------------------------------------------

def quota_passes(phase: dict[str, Any]) -> tuple[int, int | None]:
    """How many of A's requests the gateway's quotas let through in a phase (admitted, or refused later by the
    scheduler: both count against the rpm), and the most an rpm limit allows in the phase (None: no rpm limit)."""
    a = phase.get("noisy") or {}
    passed = a.get("n", 0) - sum(n for kind, n in a.get("refused_by", ()) if kind in QUOTA_KINDS)
    rpm = (phase.get("limits") or {}).get("rpm")
    if not rpm:
        return passed, None
    return passed, rpm * math.ceil(phase.get("phase_s", RPM_WINDOW_S) / RPM_WINDOW_S)


def _measured(value: float | None, base: float | None = None) -> Callable[[Any], tuple[float | None, float | None]]:
    return lambda _: (value, base)


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """Per fleet and quota run: B fully served, B's TTFT p99 against B alone (and against A at exactly its share,
    where the run has it), A refused by its quota with every refusal as promised, A within its rpm bound. The goals
    are this report's, measured from it (a field an older report lacks leaves its goal unjudged)."""
    out = []
    for fleet in report["fleets"]:
        phases = fleet["phases"]
        if HOLDS_ALL in phases:
            phase, where = phases[HOLDS_ALL], f"{fleet['workers']} workers, {HOLDS_ALL}"
            q, a = phase["quiet"], phase["noisy"]
            alone = phases.get("alone", {}).get("quiet", {}).get("ttft", {}).get("p99_ms")
            out += [bench.Goal(f"{where}: B's P0 success 100%", _measured(q["success_rate"]), 1.0, unit="%",
                               digits=1),
                    bench.Goal(f"{where}: B's TTFT p99 ≤ {HOLD_GOAL_RATIO}x B alone", _measured(q["ttft"]["p99_ms"],
                               alone), HOLD_GOAL_RATIO, at_most=True, judged="ratio", digits=0),
                    bench.Goal(f"{where}: every admitted request of A finished (its preempted work included)",
                               _measured(a["completed"] / a["admitted"] if a.get("admitted") else None), 1.0,
                               unit="%", digits=1)]
        for name, phase in phases.items():
            if not name.startswith("with_quotas"):
                continue
            q, where = phase["quiet"], f"{fleet['workers']} workers, {name}"
            out.append(bench.Goal(f"{where}: B's P0 success 100%", _measured(q["success_rate"]), 1.0, unit="%",
                                  digits=1))
            for ref, what in (("alone", "B alone"),
                              (AT_SHARE, "B's when A sends exactly its share (what perfect quotas leave)")):
                base = phases.get(ref, {}).get("quiet", {}).get("ttft", {}).get("p99_ms")
                ratio = TTFT_GOAL_RATIO if ref == "alone" else AT_SHARE_GOAL_RATIO
                if ref == "alone" or base:
                    out.append(bench.Goal(f"{where}: B's TTFT p99 ≤ {ratio}x {what}",
                                          _measured(q["ttft"]["p99_ms"], base), ratio, at_most=True,
                                          judged="ratio", digits=0))
            checks = phase["noisy"].get("refusal_checks") or {}
            out += [bench.Goal(f"{where}: A refused by its quota", _measured(checks.get("by_quota")), 1, unit="",
                               digits=0),
                    bench.Goal(f"{where}: every refusal of A a 429 with its code (rate_limit_exceeded; the "
                               "scheduler's queue_full), Retry-After and x-ratelimit-*-requests (limit = configured, "
                               "remaining ≥ 0)",
                               _measured(checks["ok"] / checks["checked"] if checks.get("checked") else None), 1.0,
                               unit="%", digits=1)]
            passed, bound = quota_passes(phase)
            if bound is not None:
                out.append(bench.Goal(f"{where}: A passed its rpm quota at most {bound} times (rpm "
                                      f"{phase['limits']['rpm']}, a "
                                      f"{phase.get('phase_s', report['setup']['phase_s']):g} s phase)",
                                      _measured(passed), bound, at_most=True, unit="", digits=0))
    return out


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Per fleet and phase A's passes through its quota and the bound; what refusals and admitted responses lacked
    (workers, phase, whose admitted responses or "" for A's refusals, problems)."""
    fleets = report["fleets"]
    return {"at_share_phase": AT_SHARE, "goal_ratio": TTFT_GOAL_RATIO, "hold_phase": HOLDS_ALL,
            "passes": [{name: quota_passes(ph) for name, ph in f["phases"].items()} for f in fleets],
            "lacked": [(f["workers"], name, "", ph["noisy"]["refusal_checks"]["problems"]) for f in fleets
                       for name, ph in f["phases"].items()
                       if ph["noisy"] and ph["noisy"].get("refusal_checks", {}).get("problems")]
            + [(f["workers"], name, who, side["admitted_headers"]["problems"]) for f in fleets
               for name, ph in f["phases"].items() for who, side in (("A", ph["noisy"]), ("B", ph["quiet"]))
               if side and side.get("admitted_headers", {}).get("problems")]}


QUANTILES = (*range(0, 100, 5), 99, 100)


def figure(report: dict[str, Any]) -> bench.Figure | None:
    """Per fleet size, B's TTFT by quantile in each run (log scale), and the goal's bound."""
    panels = []
    for f in report["fleets"]:
        series = [bench.Series(f"{name} (p99 {ph['quiet']['ttft']['p99_ms']:.0f} ms)", QUANTILES,
                               [percentile(ph["quiet"]["ttft_ms"], q) for q in QUANTILES])
                  for name, ph in f["phases"].items() if ph["quiet"]["ttft_ms"]]
        alone = f["phases"]["alone"]["quiet"]["ttft"]["p99_ms"]
        lines = [(TTFT_GOAL_RATIO * alone, f"goal: p99 ≤ {TTFT_GOAL_RATIO}x alone ({TTFT_GOAL_RATIO * alone:.0f} ms)",
                  "--", "red")] if alone else []
        panels.append(bench.Panel(f"{f['workers']} simulated workers: B's P0 TTFT", "share of B's requests (%)",
                                  "B's TTFT (ms, log)", series, lines=lines, yscale="log"))
    return bench.Figure("", panels, panel_width=6.5) if panels else None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="fleet sizes, one platform each")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per worker (and the scheduler's per-worker cap)")
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="simulated time multiplier: a slower simulated GPU keeps the request rates (and so the "
                         "CPU the gateway and the load generators need) small")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="the engines' token budget per step")
    ap.add_argument("--prompt-chars", type=int, default=1024, help="prompt length (~4 characters a token)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phase-s", type=float, default=45.0, help="seconds of arrivals per phase")
    ap.add_argument("--alone-s", type=float, default=None,
                    help="seconds of the alone phase (the first part of the same arrivals; default: --phase-s)")
    ap.add_argument("--share", type=float, default=0.5, help="each tenant's share of the fleet")
    ap.add_argument("--flood", type=float, default=10.0, help="A's rate, in multiples of its share")
    ap.add_argument("--b-load", type=float, default=0.5, help="B's rate, in multiples of its share")
    ap.add_argument("--quota-runs", nargs="+", choices=sorted(QUOTA_RUNS), default=["rpm", "rpm+concurrent"],
                    help="the with-quotas runs: which limits A and B get")
    ap.add_argument("--quantum-s", type=int, default=5,
                    help="the gateways' GOODPUT_GATEWAY_QUOTAS__QUANTUM_S: rpm limits enforced pro rata per this many "
                         "seconds (0 = per minute only, so a flood spends its minute in a burst)")
    ap.add_argument("--no-at-share", dest="at_share", action="store_false",
                    help="skip the reference phase in which A sends exactly its share")
    ap.add_argument("--no-holds-all", dest="holds_all", action="store_false",
                    help=f"skip the {HOLDS_ALL} phase (no limits; A's long streams hold every slot)")
    ap.add_argument("--long-tokens", type=int, default=256, help=f"output tokens of A's streams in {HOLDS_ALL}")
    ap.add_argument("--hold-lead-s", type=float, default=3.0,
                    help=f"seconds A's streams run in {HOLDS_ALL} before B's first arrival")
    ap.add_argument("--unloaded-n", type=int, default=30, help="B's requests one at a time (unloaded TTFT)")
    ap.add_argument("--capacity-s", type=float, default=12.0)
    ap.add_argument("--port-offset", type=int, default=PORT_OFFSET)
    ap.add_argument("--redis-db", type=int, default=None, help="Redis database (default: the URL's, 0)")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.alone_s is None or args.alone_s > args.phase_s:
        args.alone_s = args.phase_s


def served(report: dict[str, Any], args: argparse.Namespace) -> bool:
    return sum(ph["quiet"]["ok"] + ((ph["noisy"] or {}).get("completed") or 0)
               for f in report["fleets"] for ph in f["phases"].values()) > 0


BENCHMARK = bench.Benchmark(
    name="noisy_neighbour", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare, goals=goals,
    context=context, figure=figure, seed=11,
    warmup=bench.Option(6.0, "seconds of closed-loop load before the capacity is measured (not counted)",
                        aliases=("--capacity-warmup-s",)),
    # 7 s phases: A at 10x its share passes a minute's rpm (60 s x its share) after ~6 s, so the rpm run refuses;
    # per minute only (no quantum): B's Poisson arrivals never meet a quantum in a few seconds.
    quick={"workers": [2], "phase_s": 7.0, "alone_s": 3.0, "time_scale": 2.0, "unloaded_n": 5, "capacity_s": 3.0,
           "warmup_s": 2.0, "quota_runs": ["rpm"], "at_share": False, "quantum_s": 0, "long_tokens": 128},
    quick_help="one fleet of 2 workers, short phases, the rpm quota run only (a smoke run, ~70 s)", ok=served,
    reports=("noisy_neighbour", "noisy_neighbour-tenants"))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
