"""Stair-step concurrency: closed-loop P0 streams added in steps (1 -> 256 on the simulated fleet), each step held
for ``--step-s``; per step TTFT and TPOT p50/p95/p99, the share within the P0 SLO, goodput (requests and output
tokens within the SLO per second) and the **knee**: the largest concurrency whose step still meets the P0 SLO
(at least ``--attainment`` of its requests within both TTFT and TPOT, and every step below it too).

A stream sends a request, waits for its last token and sends the next (no think time), so the concurrency is the
number of requests in the system. Every prompt is unique (no prefix-cache hits), ``--prompt-tokens`` long, with
``--max-tokens`` output tokens. Streams are added at the start of each step and never removed; a step's requests are
those that arrive in it after ``--settle-s`` (the ramp's transient), whenever they finish.

    python -m loadtests.stairstep --out loadtests/reports/stairstep-sim      # 4 simulated workers, ~10 min
    python -m loadtests.stairstep --engine vllm --out loadtests/reports/stairstep-vllm   # 1 CPU worker, ~5 min
    python -m loadtests.stairstep --smoke          # 2 simulated workers, 2 short steps (the test)
    python -m loadtests.stairstep --render loadtests/reports/stairstep-sim.json   # re-render report + plot

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
from loadtests.common import machine_info, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result
from loadtests.suite import (
    LOGS,
    Slo,
    closed_loop,
    declare,
    engine_for,
    figure_title,
    fleet,
    latency_stats,
    p0_slo,
    prompt_of,
    samples,
    worker_info,
)

NAME = "stairstep"
PRESETS: dict[str, dict[str, Any]] = {
    "sim": {"workers": 4, "max_num_seqs": 128, "max_model_len": 4096, "max_batched_tokens": 2048,
            "stream_every": 16,
            "steps": "1,2,4,8,16,32,64,96,128,160,192,224,256", "step_s": 40.0, "settle_s": 12.0,
            "prompt_tokens": 1024, "max_tokens": 64},
    "vllm": {"workers": 1, "max_num_seqs": 8, "max_model_len": 2048, "max_batched_tokens": 0, "stream_every": 1,
             "steps": "1,2,4,8,16,24,32", "step_s": 40.0, "settle_s": 15.0, "prompt_tokens": 256, "max_tokens": 32},
    "smoke": {"workers": 2, "max_num_seqs": 8, "max_model_len": 2048, "stream_every": 8, "steps": "1,4", "step_s": 3.0,
              "settle_s": 0.5, "prompt_tokens": 256, "max_tokens": 16, "time_scale": 1.0},
}


def spread(rng: random.Random, mean: int, width: float) -> int:
    """A length drawn uniformly within ``mean`` x (1 +- ``width``): requests of one fixed size in a closed loop fall
    into step with each other (their prefills all at once, then their decodes), which real traffic does not.

    >>> spread(random.Random(1), 100, 0.0), 50 <= spread(random.Random(1), 100, 0.5) <= 150
    (100, True)
    """
    return max(1, round(mean * rng.uniform(1 - width, 1 + width)))


def knee(steps: list[dict[str, Any]], target: float) -> int | None:
    """The largest concurrency before the first step under ``target`` attainment (None: the first step misses).

    >>> knee([{"concurrency": 1, "attainment": 1.0}, {"concurrency": 8, "attainment": 0.99},
    ...       {"concurrency": 16, "attainment": 0.5}, {"concurrency": 32, "attainment": 1.0}], 0.99)
    8
    """
    out = None
    for st in steps:
        if st["attainment"] is None or st["attainment"] < target:
            break
        out = st["concurrency"]
    return out


def analyse_steps(results: list[Result], windows: list[tuple[int, float, float]], slo: Slo,
                  scale: float) -> list[dict[str, Any]]:
    """Per step (concurrency, window start, end on the wall clock): the requests that arrived in the window."""
    out = []
    for c, t0, t1 in windows:
        rs = [r for r in results if t0 <= r.arrival < t1]
        stats = latency_stats(samples(rs, scale), slo, window_s=(t1 - t0) / scale, offered=len(rs))
        waits = [r.queue_wait_s / scale for r in rs if r.outcome == "ok"]
        # requests in the system on average over the window (all of them, whenever they arrived): below the step's
        # streams when the client, starved of CPU, sends the next request late
        inflight = sum(max(0.0, min(r.arrival + r.e2e_s, t1) - max(r.arrival, t0))
                       for r in results if r.e2e_s is not None) / (t1 - t0)
        per_worker = {}
        for w in sorted({r.worker for r in rs if r.outcome == "ok"}):
            mine = samples([r for r in rs if r.worker == w], scale)
            per_worker[w] = {"n": len(mine),
                             "tpot_p50_ms": summarize([x.tpot_s for x in mine if x.tpot_s is not None])["p50_ms"]}
        out.append({"concurrency": c, **stats, "failed": sum(1 for r in rs if r.outcome != "ok"),
                    "in_flight_mean": inflight, "per_worker": per_worker,
                    "queue_wait": summarize(waits),
                    "errors": sorted({(r.error or r.outcome)[:120] for r in rs if r.outcome != "ok"})[:5]})
    return out


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_for(args, max_batched_tokens=args.max_batched_tokens, stream_every=args.stream_every)
    slo = p0_slo(args.engine)
    steps = [int(x) for x in args.steps.split(",")]
    report: dict[str, Any] = {
        "machine": machine_info(), "engine": engine.describe(), "slo": asdict(slo),
        "setup": {"steps": steps, "step_s_wall": args.step_s, "settle_s_wall": args.settle_s,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "spread": args.spread,
                  "attainment_target": args.attainment, "seed": args.seed},
    }
    results: list[Result] = []
    windows: list[tuple[int, float, float]] = []
    stop_at = [float("inf")]

    def stream(sid: int) -> Any:
        rng = random.Random(f"{args.seed}-{sid}")

        def make(i: int) -> RequestSpec:
            # the head makes every prompt's first block unique: no prefix-cache hit anywhere
            return RequestSpec(request_id=f"s{sid}-{i}", priority="P0", tenant="stairstep",
                               prompt=prompt_of(rng, spread(rng, args.prompt_tokens, args.spread), engine,
                                                head=f"stream {sid} request {i}: "),
                               max_tokens=spread(rng, args.max_tokens, args.spread), deadline_s=300.0)

        return closed_loop(client, make, until=lambda: time.monotonic() >= stop_at[0], sink=results)

    async with fleet(engine, base_port=args.base_port, logdir=LOGS / NAME) as f:
        report["workers"] = await worker_info(f)
        client = LeaseClient(f.scheduler_addr, rng=random.Random(args.seed))
        warm = [RequestSpec(f"warm-{i}", "P0", "warm", prompt_of(random.Random(i), 64, engine), 4, 300.0)
                for i in range(2 * engine.workers)]
        await asyncio.gather(*(client.run(s) for s in warm))  # connections open, engines warm; not measured
        tasks: list[asyncio.Task[None]] = []
        for c in steps:
            begin = time.monotonic()
            while len(tasks) < c:
                tasks.append(asyncio.create_task(stream(len(tasks))))
            await asyncio.sleep(args.step_s)
            windows.append((c, begin + args.settle_s, begin + args.step_s))
            done = [r for r in results if begin + args.settle_s <= r.arrival]
            ttft = summarize([s.ttft_s for s in samples(done, engine.scale)])
            print(f"[{c} streams] {len(done)} finished so far, TTFT p99 {ttft['p99_ms'] or 0:.0f} ms", flush=True)
        stop_at[0] = time.monotonic()
        await asyncio.wait(tasks, timeout=args.drain_timeout_s)
        await client.close()
    report["steps"] = analyse_steps(results, windows, slo, engine.scale)
    report["knee"] = knee(report["steps"], args.attainment)
    return report


# ---- report (the prose: templates/stairstep.md) -----------------------------------------------------------------


def context(report: dict[str, Any]) -> dict[str, Any]:
    """The first step past the knee, and the step of the highest goodput."""
    steps, k = report["steps"], report["knee"]
    return {"after": next((st for st in steps if k is None or st["concurrency"] > k), None),
            "best": max(steps, key=lambda st: st["goodput_rps"] or 0)}


def figure(report: dict[str, Any]) -> bench.Figure:
    """TTFT and TPOT percentiles and goodput per step (one slot per step), the SLO and the knee marked."""
    steps, slo, k = report["steps"], report["slo"], report["knee"]
    labels = [str(st["concurrency"]) for st in steps]
    xs = list(range(len(steps)))
    knee_line = [] if k is None else [(labels.index(str(k)), f"knee: {k}", "-.", "tab:purple")]
    panels = [bench.Panel(f"{title} percentiles", "concurrent streams", f"{title} (ms, log)", [
        bench.Series(q, xs, [st[key][f"{q}_ms"] for st in steps], style) for q, style in
        (("p50", "-"), ("p95", "--"), ("p99", ":"))], lines=[(limit * 1000, "P0 SLO", "-", "red")], vlines=knee_line,
        xticks=labels, yscale="log") for key, limit, title in (("ttft", slo["ttft_s"], "TTFT"),
                                                                ("tpot", slo["tpot_s"], "TPOT"))]
    panels.append(bench.Panel("goodput (within the P0 SLO)", "concurrent streams", "requests/s", [
        bench.Series("goodput", xs, [st["goodput_rps"] for st in steps], color="tab:green"),
        bench.Series("throughput", xs, [st["throughput_rps"] for st in steps], "--", "grey")],
        vlines=knee_line, xticks=labels))
    return bench.Figure(figure_title(report, "Stair-step concurrency"), panels, panel_width=5.0)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="the engine's token budget per step (sim 2048; vllm 0 = its default)")
    ap.add_argument("--steps", default=None, help="concurrency steps, comma-separated")
    ap.add_argument("--step-s", type=float, default=None, help="wall-clock seconds per step")
    ap.add_argument("--settle-s", type=float, default=None, help="wall-clock seconds of each step not measured")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--stream-every", type=int, default=None,
                    help="sim: the worker streams every this many tokens (sim 16: fewer messages for 2 cores)")
    ap.add_argument("--spread", type=float, default=0.5,
                    help="prompt and output lengths drawn within (1 +- this) x their mean; 0 = all the same")
    ap.add_argument("--attainment", type=float, default=0.99, help="share within the SLO for a step to meet it")
    ap.add_argument("--drain-timeout-s", type=float, default=300.0)


BENCHMARK = declare(NAME, __doc__ or "", benchmark, presets=PRESETS, base_port=31000, arguments=add_arguments,
                    figure=figure, context=context, ok=lambda report: any(st["served"] for st in report["steps"]))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
