"""Replay a workload trace (capacity planning): the arrivals of a recorded trace, with their classes, prompt lengths
and output lengths, sent again to a fleet, and the latency it serves them with.

The trace is the gateway's (``GOODPUT_GATEWAY_TRACE__PATH``, format :mod:`goodput_contracts.trace`): sampled, without
prompt text. A replay rebuilds each request from its numbers: a prompt of the recorded token count (the part the
engine's prefix cache held, ``cached_tokens``, as a prefix shared by the tenant's requests; the rest unique) and
``max_tokens`` = the recorded **output** tokens, so the engine generates as much as it did then (the simulated engine
always generates ``max_tokens``; a real one may stop earlier at its end-of-sequence token, which the report counts).
Answers served from the gateway's response cache (``outcome: cache_hit``) cost no engine time and are left out.

Targets:

- ``--engine sim`` (default): a fleet of simulated workers (``--workers``, the engine model ``--sim-config``: the
  A100 / 7B defaults of ``goodput_inference.sim_engine.SimParams``, a JSON object of overrides, or the ``fit`` of a
  ``loadtests.calibrate`` report) and a scheduler, as real processes; the client does the gateway's part per request
  (lease -> stream -> release), as the other fleet benchmarks do.
- ``--engine vllm``: a platform of vLLM CPU workers (the dev model) started by the replay, requests through its
  gateway's REST API (prompt lengths cut with the model's tokenizer).
- ``--gateway URL --api-key KEY``: a platform already running, through its REST API.

``--speed X`` divides every arrival time by X: a trace recorded at ``TRACE__SAMPLE`` 0.01 replayed at ``--speed 100``
approximates the full arrival rate; ``--speed 2`` asks what twice today's traffic would do. The report gives TTFT and
TPOT p50/p99, end-to-end latency and throughput per class and overall, next to the latencies the trace recorded.

    python -m loadtests.replay --trace prod.jsonl                       # simulated A100 / 7B fleet, 1 worker
    python -m loadtests.replay --trace prod.jsonl --workers 4 --speed 100
    python -m loadtests.replay --trace t.jsonl --sim-config loadtests/reports/calibration.json   # the CPU engine
    python -m loadtests.replay --smoke                                  # a small synthetic trace on 1 sim worker

Writes ``<out>.json`` and ``<out>.md`` (``templates/replay.md``; default ``loadtests/out/replay``). Exit status 1 when
nothing was served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from goodput_contracts.trace import PRIORITIES, TraceRecord, read_trace, relative

from loadtests import bench
from loadtests.common import machine_info, percentile, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, SimFleet, random_text

__all__ = ["BENCHMARK", "Served", "SimPrompts", "TokenizerPrompts", "compare", "replay_gateway", "replay_sim", "stats",
           "synthetic_trace"]

DEADLINE_S = 600.0  # per request: a replay measures latency, it does not give up on slow answers
DEFAULT_PARAMS = {"prefill_s_per_token": 0.00012, "step_base_s": 0.012, "step_per_seq_s": 0.0003,
                  "max_batched_tokens": 2048}  # SimParams' A100 / 7B defaults, for the report


# ---- synthetic traces (the smoke run, the calibration's workload) --------------------------------------------------

def synthetic_trace(n: int, *, rate: float, seed: int = 0, mix: dict[str, float] | None = None,
                    prompt_tokens: tuple[int, int] = (32, 1024), output_tokens: tuple[int, int] = (8, 128),
                    tenants: int = 3, start_s: float = 0.0) -> list[TraceRecord]:
    """``n`` requests with Poisson arrivals at ``rate`` per second, classes drawn from ``mix``, prompt and output
    lengths log-uniform within the given bounds (many short, a few long, as chat traffic is).

    >>> t = synthetic_trace(50, rate=5.0, seed=1)
    >>> len(t), t[0].arrival_s < t[-1].arrival_s, {r.priority for r in t} <= {"P0", "P1", "P2"}
    (50, True, True)
    >>> all(32 <= r.prompt_tokens <= 1024 and 8 <= r.output_tokens <= 128 for r in t)
    True
    """
    rng = random.Random(seed)
    mix = mix or {"P0": 0.3, "P1": 0.4, "P2": 0.3}
    classes, weights = list(mix), list(mix.values())

    def loguniform(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    out, t = [], start_s
    for _ in range(n):
        t += rng.expovariate(rate)
        out_tokens = loguniform(*output_tokens)
        out.append(TraceRecord(arrival_s=round(t, 6), priority=rng.choices(classes, weights)[0],
                               prompt_tokens=loguniform(*prompt_tokens), output_tokens=out_tokens,
                               max_tokens=out_tokens, tenant=f"t{rng.randrange(tenants)}", outcome="length"))
    return out


# ---- prompts of a given length --------------------------------------------------------------------------------------

class SimPrompts:
    """Prompts for the simulated engine, which counts ``ceil(chars / chars_per_token)`` tokens of a raw prompt: exact
    lengths. The recorded ``cached_tokens`` become a prefix shared by the tenant's requests (the simulated prefix
    cache then holds it once a first request of the tenant has run, as the real one did)."""

    def __init__(self, *, chars_per_token: float = 4.0) -> None:
        self.cpt = chars_per_token
        self._prefix: dict[str, str] = {}
        self._calls = 0  # every prompt unique, also across replays sharing this object

    def _shared(self, tenant: str, chars: int) -> str:
        text = self._prefix.get(tenant, "")
        if len(text) < chars:
            text = f"system: tenant {tenant}. " + random_text(random.Random(f"prefix-{tenant}"), max(chars, 4096))
            self._prefix[tenant] = text
        return text[:chars]

    def __call__(self, rec: TraceRecord, index: int) -> str:
        chars = max(int(rec.prompt_tokens * self.cpt), 1)
        cached = min(rec.cached_tokens or 0, max(rec.prompt_tokens - 1, 0))
        shared = self._shared(rec.tenant or "-", int(cached * self.cpt))
        self._calls += 1
        unique = f" request {index}.{self._calls}: " + random_text(random.Random(index), chars)
        return (shared + unique)[:chars].ljust(chars, "x")


class TokenizerPrompts:
    """Prompts for a real engine, cut to the recorded token count with its tokenizer (less what its chat template
    adds around one user message), a tenant's cached part shared as with :class:`SimPrompts`."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # lazy: only a real-engine replay needs it

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.template_tokens = self.chat_tokens("")
        self._prefix: dict[str, list[int]] = {}
        self._calls = 0  # every prompt unique, also across replays sharing this object

    def chat_tokens(self, content: str) -> int:
        """Tokens of one user message with the chat template around it (what the engine counts)."""
        out = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True)
        if isinstance(out, Mapping):  # newer transformers return a BatchEncoding
            return len(out["input_ids"])
        return len(out)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def __call__(self, rec: TraceRecord, index: int) -> str:
        want = max(rec.prompt_tokens - self.template_tokens, 1)
        cached = min(max((rec.cached_tokens or 0) - self.template_tokens, 0), want - 1)
        tenant = rec.tenant or "-"
        if len(self._prefix.get(tenant, [])) < cached:
            self._prefix[tenant] = self._ids(f"Notes of {tenant}: " + random_text(random.Random(tenant),
                                                                                  max(cached * 6, 4096)))
        self._calls += 1
        unique = self._ids(f" Request {self._calls}. Continue the list: "
                           + random_text(random.Random(self._calls), want * 6))
        ids = self._prefix.get(tenant, [])[:cached] + unique[:want - cached]
        return str(self.tok.decode(ids))


# ---- the replays ----------------------------------------------------------------------------------------------------

@dataclass
class Served:
    """One trace request as the replay served it (times in seconds from the replay's start or from its send)."""

    index: int
    priority: str
    sent_s: float  # when it was sent, from the replay's start (its arrival / speed, plus any client lag)
    outcome: str = "pending"  # ok, shed, expired, error
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0  # asked for (the trace's)
    output_tokens: int = 0  # generated
    error: str = ""


async def _paced(records: Sequence[TraceRecord], speed: float,
                 send: Callable[[int, TraceRecord, float], Any]) -> list[Served]:
    """Sends every record at its arrival / speed (open loop: nothing waits for an answer before sending)."""
    t0 = time.monotonic()
    tasks = []
    for i, rec in enumerate(records):
        delay = t0 + rec.arrival_s / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(i, rec, time.monotonic() - t0)))
    return list(await asyncio.gather(*tasks))


async def replay_sim(records: Sequence[TraceRecord], scheduler_addr: str, *, speed: float = 1.0,
                     prompts: Callable[[TraceRecord, int], str] | None = None) -> list[Served]:
    """The records against a scheduler and its workers, the client doing the gateway's part (lease, stream,
    release)."""
    prompts = prompts or SimPrompts()
    client = LeaseClient(scheduler_addr, rng=random.Random(0))
    run_id = uuid.uuid4().hex[:8]

    async def send(i: int, rec: TraceRecord, sent: float) -> Served:
        out_tokens = max(rec.output_tokens, 1)
        spec = RequestSpec(request_id=f"replay-{run_id}-{i}", priority=rec.priority, tenant=rec.tenant or "replay",
                           prompt=prompts(rec, i), max_tokens=out_tokens, deadline_s=DEADLINE_S)
        r = await client.run(spec)
        served = Served(index=i, priority=rec.priority, sent_s=sent, outcome=r.outcome, ttft_s=r.ttft_s,
                        e2e_s=r.e2e_s, prompt_tokens=rec.prompt_tokens, error=r.error)
        if r.outcome == "ok":
            served.output_tokens = getattr(r, "completion_tokens", 0) or out_tokens
            if served.output_tokens > 1 and r.ttft_s is not None and r.e2e_s is not None:
                served.tpot_s = (r.e2e_s - r.ttft_s) / (served.output_tokens - 1)
        return served

    try:
        return await _paced(records, speed, send)
    finally:
        await client.close()


async def replay_gateway(records: Sequence[TraceRecord], gateway_url: str, api_key: str, *, speed: float = 1.0,
                         prompts: Callable[[TraceRecord, int], str], model: str = "") -> list[Served]:
    """The records through a gateway's REST API (streamed chat completions, the class in ``x-goodput-priority``,
    the response cache bypassed); TTFT and TPOT as this client sees them."""
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=httpx.Timeout(DEADLINE_S), limits=limits) as http:
        async def send(i: int, rec: TraceRecord, sent: float) -> Served:
            served = Served(index=i, priority=rec.priority, sent_s=sent, prompt_tokens=rec.prompt_tokens)
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompts(rec, i)}],
                                    "max_tokens": max(rec.output_tokens, 1), "stream": True,
                                    "stream_options": {"include_usage": True}, "temperature": 0}
            if model:
                body["model"] = model
            headers = {"Authorization": f"Bearer {api_key}", "x-goodput-priority": rec.priority,
                       "Cache-Control": "no-store"}
            t0 = time.monotonic()
            first = last = None
            deltas = 0
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")[:160]
                        served.outcome = "shed" if resp.status_code == 429 else "error"
                        served.error = f"HTTP {resp.status_code}: {text}"
                        return served
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if "error" in event:
                            served.outcome, served.error = "error", str(event["error"])[:160]
                            return served
                        if event.get("usage"):
                            served.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                        for choice in event.get("choices") or ():
                            if (choice.get("delta") or {}).get("content"):
                                last = time.monotonic()
                                first = first or last
                                deltas += 1
            except (httpx.HTTPError, json.JSONDecodeError) as err:
                served.outcome, served.error = "error", f"{type(err).__name__}: {err}"[:160]
                return served
            end = time.monotonic()
            served.outcome = "ok"
            served.e2e_s = end - t0
            served.output_tokens = served.output_tokens or deltas
            if first is not None:
                served.ttft_s = first - t0
                if last is not None and served.output_tokens > 1:
                    served.tpot_s = (last - first) / (served.output_tokens - 1)
            return served

        return await _paced(records, speed, send)


# ---- analysis -------------------------------------------------------------------------------------------------------

def _ms(values: Sequence[float]) -> dict[str, Any]:
    s = summarize(values, (50, 90, 99))
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}


def stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT/TPOT/e2e summaries and throughput of served requests, each a dict with ``start_s`` (arrival or send),
    ``ttft_s``, ``tpot_s``, ``e2e_s`` and ``output_tokens``.

    >>> rows = [{"start_s": 0.0, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.1, "output_tokens": 101},
    ...         {"start_s": 1.0, "ttft_s": 0.3, "tpot_s": 0.02, "e2e_s": 1.0, "output_tokens": 36}]
    >>> s = stats(rows)
    >>> s["ttft"]["p50_ms"], s["output_tokens_per_s"], s["span_s"]
    (200.0, 68.5, 2.0)
    """
    ok = [r for r in rows if r.get("e2e_s") is not None]
    if not ok:
        return {"n": 0, "ttft": _ms([]), "tpot": _ms([]), "e2e": _ms([]), "output_tokens_per_s": None,
                "requests_per_s": None, "span_s": None}
    start = min(r["start_s"] for r in ok)
    end = max(r["start_s"] + r["e2e_s"] for r in ok)
    span = max(end - start, 1e-9)
    tokens = sum(r["output_tokens"] for r in ok)
    return {"n": len(ok), "ttft": _ms([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
            "tpot": _ms([r["tpot_s"] for r in ok if r.get("tpot_s")]),
            "e2e": _ms([r["e2e_s"] for r in ok]), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / span, 3), "requests_per_s": round(len(ok) / span, 4),
            "span_s": round(span, 3)}


def recorded_rows(records: Sequence[TraceRecord]) -> list[dict[str, Any]]:
    """The trace's own latencies as :func:`stats` rows (records without them are left out)."""
    return [{"start_s": r.arrival_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s,
             "output_tokens": r.output_tokens, "priority": r.priority}
            for r in records if r.e2e_s is not None]


def served_rows(served: Sequence[Served]) -> list[dict[str, Any]]:
    return [{"start_s": s.sent_s, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "e2e_s": s.e2e_s,
             "output_tokens": s.output_tokens, "priority": s.priority}
            for s in served if s.outcome == "ok"]


def by_class(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {"all": stats(rows)}
    for c in PRIORITIES:
        mine = [r for r in rows if r["priority"] == c]
        if mine:
            out[c] = stats(mine)
    return out


def _rel(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or real is None or real == 0 else round(sim / real - 1.0, 4)


METRICS = (("TTFT p50", "ttft", "p50_ms"), ("TTFT p99", "ttft", "p99_ms"), ("TPOT p50", "tpot", "p50_ms"),
           ("TPOT p99", "tpot", "p99_ms"), ("e2e p50", "e2e", "p50_ms"), ("e2e p99", "e2e", "p99_ms"))


def compare(real: dict[str, Any], replayed: dict[str, Any]) -> list[dict[str, Any]]:
    """Per metric: the recorded value, the replayed one and the relative error (replayed / recorded - 1).

    >>> a = {"ttft": {"p50_ms": 100.0, "p99_ms": 400.0}, "tpot": {"p50_ms": 20.0, "p99_ms": 30.0},
    ...      "e2e": {"p50_ms": 1.0, "p99_ms": 2.0}, "output_tokens_per_s": 50.0}
    >>> b = {**a, "ttft": {"p50_ms": 110.0, "p99_ms": 300.0}}
    >>> [(m["metric"], m["rel_error"]) for m in compare(a, b)][:2]
    [('TTFT p50', 0.1), ('TTFT p99', -0.25)]
    """
    out = []
    for name, key, q in METRICS:
        r, s = real[key].get(q), replayed[key].get(q)
        out.append({"metric": name, "real": r, "replayed": s, "rel_error": _rel(s, r)})
    r, s = real.get("output_tokens_per_s"), replayed.get("output_tokens_per_s")
    out.append({"metric": "throughput (output tokens/s)", "real": r, "replayed": s, "rel_error": _rel(s, r)})
    return out


def paired_errors(records: Sequence[TraceRecord], served: Sequence[Served]) -> dict[str, Any]:
    """Request by request (the same trace line recorded and replayed): the median and p90 of |replayed / recorded
    - 1| for TTFT and TPOT."""
    out: dict[str, Any] = {}
    for key in ("ttft_s", "tpot_s"):
        errs = []
        for s in served:
            rec = records[s.index]
            a, b = getattr(rec, key), getattr(s, key)
            if s.outcome == "ok" and a and b:
                errs.append(abs(b / a - 1.0))
        out[key.removesuffix("_s")] = {"n": len(errs), "median_abs_rel": _round(percentile(errs, 50)),
                                       "p90_abs_rel": _round(percentile(errs, 90))}
    return out


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def outcomes(served: Sequence[Served]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in served:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    return counts


# ---- the benchmark --------------------------------------------------------------------------------------------------

def load_params(spec: str | None) -> dict[str, Any]:
    """Sim parameters from ``--sim-config``: empty (the A100 / 7B defaults), a JSON object, or a JSON file (a
    calibration report: its ``fit.sim_params``; else the object itself)."""
    if not spec:
        return {}
    if spec.lstrip().startswith("{"):
        return dict(json.loads(spec))
    doc = json.loads(Path(spec).read_text(encoding="utf-8"))
    return dict(doc.get("fit", {}).get("sim_params", doc))


def prepare(records: Sequence[TraceRecord], *, limit: int | None = None,
            include_cache_hits: bool = False) -> tuple[list[TraceRecord], dict[str, int]]:
    """The records to send (arrivals relative to the first), and how many were left out and why."""
    skipped = {"cache_hit": 0, "no_tokens": 0}
    keep = []
    for r in records:
        if r.outcome == "cache_hit" and not include_cache_hits:
            skipped["cache_hit"] += 1
        elif r.prompt_tokens < 1:
            skipped["no_tokens"] += 1
        else:
            keep.append(r)
    keep = relative(keep)
    if limit is not None:
        keep = keep[:limit]
    return keep, skipped


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        records = synthetic_trace(args.smoke_requests, rate=6.0, seed=3, prompt_tokens=(16, 512),
                                  output_tokens=(4, 32))
        trace_name = f"synthetic ({args.smoke_requests} requests at 6/s, seed 3)"
    else:
        records = read_trace(args.trace)
        trace_name = str(args.trace)
    todo, skipped = prepare(records, limit=args.limit, include_cache_hits=args.include_cache_hits)
    if not todo:
        raise SystemExit("the trace has no request to replay")
    sample = min((r.sample for r in todo), default=1.0)
    report: dict[str, Any] = {
        "machine": machine_info(), "trace": trace_name, "requests": len(todo),
        "skipped": skipped, "trace_sample": sample, "speed": args.speed, "engine": args.engine,
        "models_in_trace": sorted({r.model for r in todo if r.model}), "arrival_span_s": todo[-1].arrival_s,
    }
    started = time.monotonic()
    if args.gateway:
        served = await replay_gateway(todo, args.gateway, args.api_key, speed=args.speed,
                                      prompts=_tokenizer_prompts(), model=args.model)
        report["target"] = f"a running platform's gateway ({args.gateway})"
    elif args.engine == "vllm":
        served = await _replay_vllm(todo, args, report)
    else:
        params = {**load_params(args.sim_config)}
        report["sim_params"] = {**DEFAULT_PARAMS, **params}
        max_len = max(4096, max(r.prompt_tokens + r.output_tokens for r in todo) + 16)
        with SimFleet(workers=args.workers, base_port=args.base_port, sim=params, max_num_seqs=args.max_num_seqs,
                      max_model_len=max_len, logdir=args.out.parent / "logs") as fleet:
            fleet.start_scheduler({}, name="scheduler-replay")
            await fleet.wait_ready()
            served = await replay_sim(todo, fleet.scheduler_addr, speed=args.speed)
        report["target"] = (f"{args.workers} simulated worker(s) (max_num_seqs {args.max_num_seqs}) and a scheduler "
                            "with its default settings")
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["outcomes"] = outcomes(served)
    report["errors"] = sorted({s.error for s in served if s.error})[:5]
    report["replayed"] = by_class(served_rows(served))
    report["output_tokens_asked"] = sum(max(r.output_tokens, 1) for r in todo)
    scaled = [replace(r, arrival_s=r.arrival_s / args.speed) for r in todo]
    recorded = recorded_rows(scaled)
    if recorded and args.speed == 1.0:
        report["recorded"] = by_class(recorded)
        report["comparison"] = compare(report["recorded"]["all"], report["replayed"]["all"])
        report["paired"] = paired_errors(todo, served)
    report["served"] = [asdict(s) for s in served] if args.keep_requests else None
    return report


def _tokenizer_prompts() -> TokenizerPrompts:
    from goodput_inference.devmodel import ensure_dev_model

    return TokenizerPrompts(ensure_dev_model())


async def _replay_vllm(todo: list[TraceRecord], args: argparse.Namespace, report: dict[str, Any]) -> list[Served]:
    from goodput_cli.supervisor import Platform

    key = "replay-key"
    platform = Platform(workdir=(args.out.parent / f"{args.out.name}-platform").resolve(), workers=args.workers,
                        port_offset=args.port_offset, cache=False, knowledge=False, jobs=False,
                        env={"GOODPUT_GATEWAY_LADDER__ENABLED": "false"},
                        api_keys=[{"key": key, "tenant": "replay", "max_priority": "P0"}])
    platform.dev_key = key
    platform.start()
    try:
        served = await replay_gateway(todo, platform.gateway_http, key, speed=args.speed,
                                      prompts=_tokenizer_prompts())
    finally:
        platform.stop()
    report["target"] = (f"a platform of {args.workers} vLLM CPU worker(s) (the dev model), started by the replay, "
                        "through its gateway's REST API (degradation ladder off)")
    return served


# ---- the command line ---------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", type=Path, help="the trace file (JSONL, goodput_contracts.trace)")
    ap.add_argument("--gateway", default="", help="replay through a running platform's gateway REST URL instead")
    ap.add_argument("--api-key", default="", help="with --gateway: the key (it must allow every class replayed)")
    ap.add_argument("--model", default="", help="with --gateway: the model to ask for (default: the gateway's)")
    ap.add_argument("--speed", type=float, default=1.0, help="arrival times divided by this (default 1)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests")
    ap.add_argument("--include-cache-hits", action="store_true", help="also send answers the cache served")
    ap.add_argument("--workers", type=int, default=1, help="workers of the fleet (sim or vllm)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sim: sequences per worker (the worker default)")
    ap.add_argument("--sim-config", default="", help="sim: SimParams overrides (JSON) or a calibration report")
    ap.add_argument("--base-port", type=int, default=27100, help="sim: the fleet's first port")
    ap.add_argument("--port-offset", type=int, default=400, help="vllm: the platform's port offset")
    ap.add_argument("--keep-requests", action="store_true", help="every request's numbers in the JSON report")
    ap.add_argument("--smoke-requests", type=int, default=30, help=argparse.SUPPRESS)


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        if args.engine != "sim" or args.gateway:
            ap.error("--smoke runs on the simulated engine only")
    elif args.render is None and args.trace is None:
        ap.error("--trace is required (or --smoke)")
    if args.gateway and not args.api_key:
        ap.error("--gateway needs --api-key")
    if args.speed <= 0:
        ap.error("--speed must be positive")


BENCHMARK = bench.Benchmark(
    name="replay", doc=__doc__ or "", run=benchmark, arguments=add_arguments, prepare=check, engines=("sim", "vllm"),
    engine_help="sim: a fleet of simulated workers; vllm: a platform of vLLM CPU workers started by the replay",
    quick_help="a small synthetic trace on one simulated worker", out="loadtests/out/replay",
    ok=lambda report, args: report["replayed"]["all"]["n"] > 0)


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
