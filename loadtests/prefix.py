"""Prefix-aware placement versus round-robin, on simulated workers with prefix caching.

Two scenarios, each run with the default placement profile (least-loaded + prefix affinity + session affinity) and
with round-robin, each on a fresh fleet (cold caches), same seeded Poisson arrivals:

* ``shared``: many long system prompts (more than one worker's KV cache holds, less than the fleet's), each request
  one of them plus a short question — prefix affinity keeps each system prompt on one worker, so its cached blocks
  are reused instead of prefilled again;
* ``no_reuse``: every prompt unique and as long — nothing to reuse, so affinity can only cost (it must not).

    python -m loadtests.prefix              # ~6 min on 2 cores
    python -m loadtests.prefix --quick      # a smoke run

A benchmark reports numbers; it does not fail on a missed goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.common import (
    bootstrap_diff_ci,
    cpu_label,
    machine_info,
    markdown_table,
    produce,
    summarize,
)
from loadtests.simfleet import LeaseClient, RequestSpec, Result, SimFleet, random_text

PLACEMENTS = {
    "prefix_aware": {},  # the default profile
    "round_robin": {"PROFILE": json.dumps({"scorers": [{"name": "least_loaded", "weight": 1.0}],
                                           "picker": "round_robin"})},
}


def make_requests(scenario: str, rng: random.Random, n: int, *, systems: int, system_chars: int,
                  question_chars: int, max_tokens: int) -> list[RequestSpec]:
    prompts = [f"system prompt {i}: " + random_text(random.Random(f"sys-{i}"), system_chars) for i in range(systems)]
    out = []
    for i in range(n):
        if scenario == "shared":
            prompt = rng.choice(prompts) + "\nuser: " + random_text(rng, question_chars)
        else:
            prompt = f"unique {i}: " + random_text(rng, system_chars + question_chars)
        out.append(RequestSpec(request_id=f"{scenario}-{i}", priority="P1", tenant="t", prompt=prompt,
                               max_tokens=max_tokens, deadline_s=120.0))
    return out


async def drive(addr: str, specs: list[RequestSpec], rate: float, seed: int) -> tuple[list[Result], float]:
    client = LeaseClient(addr)
    rng = random.Random(seed)
    tasks = []
    start = time.monotonic()
    t = start
    for spec in specs:
        t += rng.expovariate(rate)
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.run(spec)))
    results = list(await asyncio.gather(*tasks))
    wall = time.monotonic() - start
    await client.close()
    return results, wall


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sim = {"time_scale": args.time_scale, "stream_every": 8}
    if args.kv_blocks:
        sim["kv_blocks"] = args.kv_blocks
    report: dict[str, Any] = {
        "benchmark": "prefix", "machine": machine_info(),
        "setup": {"workers": args.workers, "max_num_seqs": args.max_num_seqs, "sim": sim, "requests": args.requests,
                  "rate_rps": args.rate, "systems": args.systems, "system_chars": args.system_chars,
                  "question_chars": args.question_chars, "max_tokens": args.max_tokens, "seed": args.seed},
        "scenarios": {},
    }
    for scenario in args.scenarios.split(","):
        specs = make_requests(scenario, random.Random(args.seed), args.requests, systems=args.systems,
                              system_chars=args.system_chars, question_chars=args.question_chars,
                              max_tokens=args.max_tokens)
        per: dict[str, Any] = {}
        raw: dict[str, list[float]] = {}
        for name, env in PLACEMENTS.items():
            with SimFleet(workers=args.workers, base_port=args.base_port, sim=sim,
                          max_num_seqs=args.max_num_seqs) as fleet:
                fleet.start_scheduler(env, name=f"scheduler-{scenario}-{name}")
                await fleet.wait_ready()
                results, wall = await drive(fleet.scheduler_addr, specs, args.rate, args.seed + 1)
            ttft = [r.ttft_s for r in results if r.outcome == "ok" and r.ttft_s is not None]
            e2e = [r.e2e_s for r in results if r.outcome == "ok" and r.e2e_s is not None]
            reasons: dict[str, int] = {}
            for r in results:
                reasons[r.reason or "-"] = reasons.get(r.reason or "-", 0) + 1
            per[name] = {"ok": len(ttft), "failed": len(results) - len(ttft), "wall_s": wall,
                         "ttft": summarize(ttft), "e2e": summarize(e2e), "placement_reasons": reasons}
            raw[name] = ttft
            print(f"[{scenario}] {name}: mean TTFT {per[name]['ttft']['mean_ms']:.0f} ms, p99 "
                  f"{per[name]['ttft']['p99_ms']:.0f} ms ({len(ttft)}/{len(results)} ok)", flush=True)
        a, b = per["prefix_aware"]["ttft"]["mean_ms"], per["round_robin"]["ttft"]["mean_ms"]
        ci = bootstrap_diff_ci(raw["prefix_aware"], raw["round_robin"], q=50)
        per["change_mean_ttft"] = (a - b) / b if a and b else None
        per["p50_diff_ci_ms"] = None if ci is None else [ci[0] * 1000, ci[1] * 1000]
        report["scenarios"][scenario] = per
    return report


def goals(report: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    out: list[tuple[str, str, bool | None]] = []
    s = report["scenarios"]
    if "shared" in s and s["shared"]["change_mean_ttft"] is not None:
        c = s["shared"]["change_mean_ttft"]
        out.append(("shared prefixes: mean TTFT ≥ 40% lower than round-robin", f"{-c * 100:.1f}% lower", -c >= 0.40))
    if "no_reuse" in s and s["no_reuse"]["change_mean_ttft"] is not None:
        c = s["no_reuse"]["change_mean_ttft"]
        out.append(("no reuse: mean TTFT ≤ 3% worse than round-robin",
                    f"{c * 100:+.1f}% ({'worse' if c > 0 else 'better'})", c <= 0.03))
    return out


def render_markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        "# Prefix-aware placement vs round-robin",
        "",
        f"Generated by `python -m loadtests.prefix`. {s['workers']} simulated workers (A100 / 7B calibration, "
        f"prefix caching, KV cache {s['sim'].get('kv_blocks', 7000)} blocks of 16 tokens each), "
        f"simulated time x{s['sim']['time_scale']}; real scheduler and worker processes over gRPC on "
        f"{report['machine'].get('cores_usable')} CPU cores ({cpu_label(report['machine'])}). "
        f"{s['requests']} requests per run, Poisson at "
        f"{s['rate_rps']:g} req/s, {s['max_tokens']} output tokens; each run on a fresh fleet (cold caches).",
        "",
        f"- shared: {s['systems']} system prompts of ~{s['system_chars'] // 4} tokens (together more than one "
        f"worker's KV cache holds, less than the fleet's) + a ~{s['question_chars'] // 4}-token question.",
        f"- no_reuse: every prompt unique, ~{(s['system_chars'] + s['question_chars']) // 4} tokens.",
        "",
        "## Goals",
        "",
        markdown_table(["goal", "measured", "met"],
                       [(g, m, "yes" if ok else "**no**") for g, m, ok in goals(report)]),
        "",
        "## Results",
        "",
    ]
    rows = []
    for scenario, per in report["scenarios"].items():
        for name in PLACEMENTS:
            r = per[name]
            t, e = r["ttft"], r["e2e"]
            rows.append([scenario, name, r["ok"], r["failed"], f"{t['mean_ms']:.0f}", f"{t['p50_ms']:.0f}",
                         f"{t['p95_ms']:.0f}", f"{t['p99_ms']:.0f}", f"{e['mean_ms']:.0f}",
                         ", ".join(f"{k} {v}" for k, v in sorted(r["placement_reasons"].items()))])
    lines += [markdown_table(["scenario", "placement", "ok", "failed", "TTFT mean ms", "p50", "p95", "p99",
                              "e2e mean ms", "placement reasons"], rows), ""]
    for scenario, per in report["scenarios"].items():
        ci = per["p50_diff_ci_ms"]
        lines.append(f"- {scenario}: prefix-aware vs round-robin mean TTFT {per['change_mean_ttft'] * 100:+.1f}%"
                     + (f"; TTFT p50 difference 95% CI [{ci[0]:.0f}, {ci[1]:.0f}] ms" if ci else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--kv-blocks", type=int, default=0, help="per worker; 0 = the A100 calibration (7000)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--systems", type=int, default=96, help="distinct system prompts (shared scenario)")
    ap.add_argument("--system-chars", type=int, default=8000)
    ap.add_argument("--question-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--base-port", type=int, default=26500)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path("loadtests/out/prefix"))
    ap.add_argument("--scenarios", default="shared,no_reuse")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.requests, args.systems, args.kv_blocks = 2, 120, 24, 1500
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = produce(args, benchmark, render_markdown)
    for g, m, ok in goals(report):
        print(f"  {'MET ' if ok else 'MISS'} {g}: {m}")
    return 0 if any(per[n]["ok"] for per in report["scenarios"].values() for n in PLACEMENTS) else 1


if __name__ == "__main__":
    sys.exit(main())
