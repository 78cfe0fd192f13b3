"""Long context: TTFT as the prompt grows from 256 tokens to the context window, and what a long prompt's prefill
does to the other streams' time per output token, with chunked prefill and without.

Arms, each on a fresh worker: **chunked-N** for each N of ``--chunks`` (the engine schedules at most N tokens per
step, the running streams' decodes and a chunk of the prompt; vLLM's ``max_num_batched_tokens``) and **unchunked**
(a step budget of the whole window: a prompt is prefilled in one step, as an engine without chunked prefill does,
and every running stream waits for it). In each arm:

1. *unloaded*: each prompt length ``--repeats`` times, one request at a time, nothing else running: TTFT growth;
2. *loaded*: ``--background`` closed-loop P0 chat streams decode all along; the same prompt lengths are sent one
   at a time (``--gap-s`` apart), and each background token's gap from the previous one is attributed to the long
   prompt whose prefill it overlapped: the other streams' TPOT while a long prompt is prefilled, p50/p99/max, against
   their TPOT when no long prompt is being prefilled; and the TPOT (first to last token over the tokens) of the
   background requests that were decoding during a long prefill, what their SLO judges.

The worker streams every token (``stream_every`` 1 on the sim), so a gap is one token's time.

    python -m loadtests.long_context --out loadtests/reports/long_context-sim    # 1 simulated worker, ~6 min
    python -m loadtests.long_context --engine vllm --out loadtests/reports/long_context-vllm   # ~8 min
    python -m loadtests.long_context --smoke       # a small window, two lengths (the test)
    python -m loadtests.long_context --render loadtests/reports/long_context-sim.json   # re-render report + plot

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict
from typing import Any

from loadtests import bench
from loadtests.common import machine_info, percentile, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result
from loadtests.suite import (
    LOGS,
    Engine,
    closed_loop,
    declare,
    engine_for,
    figure_title,
    fleet,
    p0_slo,
    prompt_of,
    samples,
    worker_info,
)

NAME = "long_context"
PRESETS: dict[str, dict[str, Any]] = {
    "sim": {"workers": 1, "max_num_seqs": 64, "max_model_len": 32768, "chunks": "512,2048",
            "lengths": "256,1024,2048,4096,8192,16384,max", "repeats": 3, "max_tokens": 16, "background": 8,
            "background_prompt_tokens": 256, "background_max_tokens": 256, "gap_s": 1.0},
    "vllm": {"workers": 1, "max_num_seqs": 8, "max_model_len": 2048, "chunks": "256",
             "lengths": "128,256,512,1024,max", "repeats": 2, "max_tokens": 4, "background": 3,
             "background_prompt_tokens": 64, "background_max_tokens": 64, "gap_s": 1.0},
    "smoke": {"workers": 1, "max_num_seqs": 16, "max_model_len": 4096, "chunks": "256", "lengths": "256,max",
              "repeats": 1, "max_tokens": 8, "background": 2, "background_prompt_tokens": 64,
              "background_max_tokens": 32, "gap_s": 0.2, "time_scale": 1.0},
}
UNCHUNKED = "unchunked"


def arms_of(chunks: str) -> dict[str, int | None]:
    """Arm name -> step budget in tokens (None: the whole window).

    >>> arms_of("512,2048")
    {'chunked-512': 512, 'chunked-2048': 2048, 'unchunked': None}
    """
    return {**{f"chunked-{int(c)}": int(c) for c in chunks.split(",") if c}, UNCHUNKED: None}


def lengths_of(spec: str, *, window: int, max_tokens: int) -> list[int]:
    """Prompt lengths in tokens; ``max`` = the window less the answer and a small margin.

    >>> lengths_of("256,1024,max", window=4096, max_tokens=16)
    [256, 1024, 4072]
    """
    top = window - max_tokens - 8
    return [top if x == "max" else min(int(x), top) for x in spec.split(",")]


def gaps(results: list[Result], scale: float) -> list[tuple[float, float, float, int]]:
    """Every gap between two consecutive streamed messages of a request: (start, end) on the wall clock, engine
    seconds per token in it, tokens in it.

    >>> spec = RequestSpec("r", "P0", "t", "x", 3, 1)
    >>> gaps([Result(spec, 10.0, "ok", deltas=[(0.25, 1), (0.75, 2), (1.75, 4)])], scale=2.0)
    [(10.25, 10.75, 0.25, 1), (10.75, 11.75, 0.25, 2)]
    """
    out = []
    for r in results:
        for (t0, n0), (t1, n1) in zip(r.deltas, r.deltas[1:], strict=False):
            if n1 > n0:
                out.append((r.arrival + t0, r.arrival + t1, (t1 - t0) / (n1 - n0) / scale, n1 - n0))
    return out


def itl_stats(per_token: list[float], raw_gaps: list[float], tpot_slo: float) -> dict[str, Any]:
    """Percentiles of time per token (ms), the longest gap between two messages (ms), share of tokens over the SLO."""
    return {"n": len(per_token), "p50_ms": _ms(percentile(per_token, 50)), "p99_ms": _ms(percentile(per_token, 99)),
            "max_gap_ms": _ms(max(raw_gaps, default=None)),
            "over_slo": sum(1 for x in per_token if x > tpot_slo) / len(per_token) if per_token else None}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


async def one_at_a_time(client: LeaseClient, engine: Engine, lengths: list[int], *, repeats: int, max_tokens: int,
                        gap_s: float, tag: str, rng: random.Random) -> list[Result]:
    out = []
    for length in lengths:
        for i in range(repeats):
            spec = RequestSpec(request_id=f"{tag}-{length}-{i}", priority="P0", tenant="long",
                               prompt=prompt_of(rng, length, engine, head=f"{tag} {length} {i}: "),
                               max_tokens=max_tokens, deadline_s=600.0)
            out.append(await client.run(spec))
            await asyncio.sleep(gap_s)
    return out


async def run_arm(args: argparse.Namespace, arm: str, budget: int, lengths: list[int],
                  slo_tpot: float) -> dict[str, Any]:
    engine = engine_for(args, max_batched_tokens=budget, stream_every=1)
    rng = random.Random(f"{args.seed}-{arm}")
    background: list[Result] = []
    stop_at = [float("inf")]
    async with fleet(engine, base_port=args.base_port, logdir=LOGS / NAME,
                     name=f"scheduler-{arm}") as f:
        workers = await worker_info(f)
        client = LeaseClient(f.scheduler_addr, rng=random.Random(args.seed))
        await one_at_a_time(client, engine, [64], repeats=2, max_tokens=4, gap_s=0, tag="warm", rng=rng)
        unloaded = await one_at_a_time(client, engine, lengths, repeats=args.repeats, max_tokens=args.max_tokens,
                                       gap_s=args.gap_s, tag="unloaded", rng=rng)

        def stream(sid: int) -> Any:
            srng = random.Random(f"{args.seed}-{arm}-bg-{sid}")

            def make(i: int) -> RequestSpec:
                prompt = prompt_of(srng, args.background_prompt_tokens, engine, head=f"bg {sid} {i}: ")
                return RequestSpec(request_id=f"bg{sid}-{i}", priority="P0", tenant="chat", prompt=prompt,
                                   max_tokens=args.background_max_tokens, deadline_s=600.0)

            return closed_loop(client, make, until=lambda: time.monotonic() >= stop_at[0], sink=background)

        tasks = [asyncio.create_task(stream(i)) for i in range(args.background)]
        await asyncio.sleep(args.settle_s)
        loaded = await one_at_a_time(client, engine, lengths, repeats=args.repeats, max_tokens=args.max_tokens,
                                     gap_s=args.gap_s, tag="loaded", rng=rng)
        stop_at[0] = time.monotonic()
        await asyncio.wait(tasks, timeout=600)
        await client.close()
    return {"arm": arm, "budget_tokens": budget, "engine": engine.describe(), "workers": workers,
            **analyse_arm(unloaded, loaded, background, lengths, engine.scale, slo_tpot)}


def analyse_arm(unloaded: list[Result], loaded: list[Result], background: list[Result], lengths: list[int],
                scale: float, slo_tpot: float) -> dict[str, Any]:
    """Per length: TTFT unloaded and loaded (ms), the prompt tokens the worker counted, and the background streams'
    time per token during the loaded long prompts' prefills; the background's when no long prompt is prefilled."""
    bg = gaps(background, scale)
    served = [r for r in background if r.outcome == "ok" and r.ttft_s is not None and r.deltas]
    served_samples = samples(served, scale)
    prefills = [(r.arrival, r.arrival + r.ttft_s) for r in loaded if r.ttft_s is not None]

    def overlaps(a: float, b: float, windows: list[tuple[float, float]]) -> bool:
        return any(a < w1 and b > w0 for w0, w1 in windows)

    t_end = max((w1 for _, w1 in prefills), default=0.0)
    t_start = min((w0 for w0, _ in prefills), default=0.0)
    quiet = [g for g in bg if t_start <= g[0] <= t_end and not overlaps(g[0], g[1], prefills)]
    per_length = []
    for length in lengths:
        def mine(rs: list[Result], n: int = length) -> list[Result]:
            return [r for r in rs if r.spec.request_id.split("-")[1] == str(n)]

        u, lo = samples(mine(unloaded), scale), samples(mine(loaded), scale)
        windows = [(r.arrival, r.arrival + r.ttft_s) for r in mine(loaded) if r.ttft_s is not None]
        during = [g for g in bg if overlaps(g[0], g[1], windows)]
        hit = [s for r, s in zip(served, served_samples, strict=True)
               if overlaps(r.arrival + r.deltas[0][0], r.arrival + r.deltas[-1][0], windows)]
        tpots = [s.tpot_s for s in hit if s.tpot_s is not None]
        per_length.append({
            "prompt_tokens": length,
            "worker_prompt_tokens": max((s.prompt_tokens for s in u + lo), default=0) or None,
            "unloaded_ttft": summarize([s.ttft_s for s in u]), "loaded_ttft": summarize([s.ttft_s for s in lo]),
            "failed": sum(1 for r in mine(unloaded) + mine(loaded) if r.outcome != "ok"),
            "background_during_prefill": itl_stats([g[2] for g in during], [(g[1] - g[0]) / scale for g in during],
                                                   slo_tpot),
            "background_requests": {**summarize(tpots),
                                    "within_tpot_slo": sum(1 for x in tpots if x <= slo_tpot) / len(tpots)
                                    if tpots else None},
        })
    return {"lengths": per_length,
            "background_quiet": itl_stats([g[2] for g in quiet], [(g[1] - g[0]) / scale for g in quiet], slo_tpot),
            "background_requests": len(background),
            "background_failed": sum(1 for r in background if r.outcome != "ok")}


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    slo = p0_slo(args.engine)
    lengths = lengths_of(args.lengths, window=args.max_model_len, max_tokens=args.max_tokens)
    report: dict[str, Any] = {
        "machine": machine_info(), "slo": asdict(slo),
        "setup": {"lengths": lengths, "repeats": args.repeats, "max_tokens": args.max_tokens, "chunks": args.chunks,
                  "background": args.background, "background_prompt_tokens": args.background_prompt_tokens,
                  "background_max_tokens": args.background_max_tokens, "gap_s_wall": args.gap_s,
                  "seed": args.seed},
        "arms": {},
    }
    for arm, budget in arms_of(args.chunks).items():
        result = await run_arm(args, arm, budget or args.max_model_len, lengths, slo.tpot_s)
        report["arms"][arm] = result
        report["engine"] = result.pop("engine")
        for row in result["lengths"]:
            print(f"[{arm}] {row['prompt_tokens']} tokens: TTFT unloaded {row['unloaded_ttft']['p50_ms'] or 0:.0f} "
                  f"ms, loaded {row['loaded_ttft']['p50_ms'] or 0:.0f} ms; background p99 "
                  f"{row['background_during_prefill']['p99_ms'] or 0:.0f} ms/token", flush=True)
    report["engine"]["worker_env"].pop("GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS", None)  # per arm, below
    report["engine"].get("sim", {}).pop("max_batched_tokens", None)
    report["engine"]["step_budget"] = "each arm's step budget (below)"
    report["summary"] = summarize_growth(report)
    return report


def summarize_growth(report: dict[str, Any]) -> dict[str, Any]:
    """TTFT growth (unloaded, each arm): shortest -> longest prompt, the ratio, and ms per 1k tokens (least squares);
    the background's worst p99 time per token during a prefill, each arm.

    >>> arm = {"lengths": [{"prompt_tokens": 1000, "unloaded_ttft": {"p50_ms": 100.0},
    ...                     "background_during_prefill": {"p99_ms": 20.0, "max_gap_ms": 30.0}},
    ...                    {"prompt_tokens": 3000, "unloaded_ttft": {"p50_ms": 300.0},
    ...                     "background_during_prefill": {"p99_ms": 90.0, "max_gap_ms": 95.0}}]}
    >>> g = summarize_growth({"arms": {"chunked": arm}})["chunked"]
    >>> g["growth"], g["ms_per_1k_tokens"], g["background_p99_worst_ms"], g["background_max_gap_ms"]
    (3.0, 100.0, 90.0, 95.0)
    """
    out = {}
    for arm, a in report["arms"].items():
        pts = [(row["prompt_tokens"], row["unloaded_ttft"]["p50_ms"]) for row in a["lengths"]
               if row["unloaded_ttft"]["p50_ms"] is not None]
        slope = None
        if len(pts) >= 2:
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            den = sum((x - mx) ** 2 for x, _ in pts)
            slope = sum((x - mx) * (y - my) for x, y in pts) / den * 1000 if den else None
        bgs = [row["background_during_prefill"] for row in a["lengths"]]
        last = a["lengths"][-1].get("background_requests", {}) if a["lengths"] else {}
        out[arm] = {"ttft_short_ms": pts[0][1] if pts else None, "ttft_long_ms": pts[-1][1] if pts else None,
                    "growth": pts[-1][1] / pts[0][1] if pts and pts[0][1] else None, "ms_per_1k_tokens": slope,
                    "background_p99_worst_ms": max((b["p99_ms"] for b in bgs if b["p99_ms"] is not None),
                                                   default=None),
                    "background_max_gap_ms": max((b["max_gap_ms"] for b in bgs if b["max_gap_ms"] is not None),
                                                 default=None),
                    "background_request_tpot_p99_ms": last.get("p99_ms"),
                    "background_within_tpot_slo": last.get("within_tpot_slo")}
    return out


# ---- report (the prose: templates/long_context.md) -------------------------------------------------------------


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """What the P0 SLO judges, each arm: the TPOT of the other streams' requests decoding during the longest prompt's
    prefill."""
    def tpot(arm: str) -> Any:
        return lambda r: (r["summary"][arm]["background_request_tpot_p99_ms"], None)

    return [bench.Goal(f"{arm}: the other streams' TPOT p99 during the longest prefill ≤ the P0 TPOT SLO", tpot(arm),
                       report["slo"]["tpot_s"] * 1000, at_most=True, digits=0) for arm in report["arms"]]


def figure(report: dict[str, Any]) -> bench.Figure:
    """TTFT against prompt length (unloaded, loaded) and the other streams' time per token during the prefill."""
    arms, n = report["arms"], report["setup"]["background"]
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:orange"]
    colour = {name: "tab:red" if name == UNCHUNKED else palette[i % len(palette)] for i, name in enumerate(arms)}
    xs = {name: [row["prompt_tokens"] for row in a["lengths"]] for name, a in arms.items()}
    ttft = bench.Panel("TTFT vs prompt length", "prompt tokens (log)", "TTFT p50 (ms, log)", [
        bench.Series(f"{name}, {what}", xs[name], [row[key]["p50_ms"] for row in a["lengths"]], style, colour[name])
        for name, a in arms.items()
        for what, key, style in (("unloaded", "unloaded_ttft", "-"), (f"with {n} streams", "loaded_ttft", "--"))],
        lines=[(report["slo"]["ttft_s"] * 1000, "P0 TTFT SLO", "-.", "black")], xscale="log2", yscale="log",
        legend_size=7)
    others = bench.Panel("other streams' time per token during the prefill", "prompt tokens (log)", "ms (log)", [
        bench.Series(f"{name}: {what}", xs[name], [get(row) for row in a["lengths"]], style, colour[name])
        for name, a in arms.items() for what, get, style in (
            ("p99 ms/token", lambda row: row["background_during_prefill"]["p99_ms"], "-"),
            ("longest gap", lambda row: row["background_during_prefill"]["max_gap_ms"], ":"),
            ("their requests' TPOT p99", lambda row: row.get("background_requests", {}).get("p99_ms"), "--"))],
        lines=[*((a["background_quiet"]["p99_ms"], f"{name}: quiet p99", "-", colour[name]) for name, a in arms.items()
                 if a["background_quiet"]["p99_ms"]),
               (report["slo"]["tpot_s"] * 1000, "P0 TPOT SLO", "-.", "black")], xscale="log2", yscale="log",
        legend_size=7)
    return bench.Figure(figure_title(report, "Long context"), [ttft, others])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--chunks", default=None, help="the chunked arms' tokens per step (sim 512,2048; vllm 256); "
                                                   "an unchunked arm always runs")
    ap.add_argument("--lengths", default=None, help="prompt lengths in tokens; max = the window less the answer")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens of the long prompts")
    ap.add_argument("--background", type=int, default=None, help="background chat streams")
    ap.add_argument("--background-prompt-tokens", type=int, default=None)
    ap.add_argument("--background-max-tokens", type=int, default=None)
    ap.add_argument("--gap-s", type=float, default=None, help="wall seconds between long prompts")
    ap.add_argument("--settle-s", type=float, default=2.0, help="wall seconds of background before the first")


BENCHMARK = declare(NAME, __doc__ or "", benchmark, presets=PRESETS, base_port=31100, arguments=add_arguments,
                    goals=goals, figure=figure,
                    ok=lambda report: any(row["loaded_ttft"]["n"] for a in report["arms"].values()
                                          for row in a["lengths"]))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
