"""Prefix-aware placement versus round-robin, on simulated workers with prefix caching.

Two scenarios, each run with the default placement profile (least-loaded + prefix affinity + session affinity) and
with round-robin, each on a fresh fleet (cold caches), same seeded Poisson arrivals:

* ``shared``: many long system prompts (more than one worker's KV cache holds, less than the fleet's), each request
  one of them plus a short question — prefix affinity keeps each system prompt on one worker, so its cached blocks
  are reused instead of prefilled again;
* ``no_reuse``: every prompt unique and as long — nothing to reuse, so affinity can only cost (it must not).

    python -m loadtests.prefix              # ~6 min on 2 cores
    python -m loadtests.prefix --quick      # a smoke run
    python -m loadtests.prefix --render loadtests/reports/prefix.json   # the report again (templates/prefix.md)

A benchmark reports numbers; it does not fail on a missed goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from loadtests import bench
from loadtests.common import bootstrap_diff_ci, machine_info, summarize
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


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    sim = {"time_scale": args.time_scale, "stream_every": 8}
    if args.kv_blocks:
        sim["kv_blocks"] = args.kv_blocks
    report: dict[str, Any] = {
        "machine": machine_info(),
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


def mean_ttft(scenario: str) -> Any:
    """Prefix-aware placement's mean TTFT in a scenario, and round-robin's (the baseline) in the same run."""
    def measure(report: dict[str, Any]) -> tuple[float | None, float | None]:
        per = report["scenarios"][scenario]
        return per["prefix_aware"]["ttft"]["mean_ms"], per["round_robin"]["ttft"]["mean_ms"]
    return measure


GOALS = [
    bench.Goal("shared prefixes: mean TTFT ≥ 40% lower than round-robin", mean_ttft("shared"), -0.40, at_most=True,
               judged="change", digits=0),
    bench.Goal("no reuse: mean TTFT ≤ 3% worse than round-robin", mean_ttft("no_reuse"), 0.03, at_most=True,
               judged="change", digits=0),
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kv-blocks", type=int, default=0, help="per worker; 0 = the A100 calibration (7000)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--systems", type=int, default=96, help="distinct system prompts (shared scenario)")
    ap.add_argument("--system-chars", type=int, default=8000)
    ap.add_argument("--question-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--scenarios", default="shared,no_reuse")


BENCHMARK = bench.Benchmark(
    name="prefix", doc=__doc__ or "", run=measure, arguments=add_arguments, goals=GOALS,
    context=lambda report: {"placements": list(PLACEMENTS)},
    fleet=bench.Fleet(workers=4, max_num_seqs=32, time_scale=1.0, base_port=26500), seed=11,
    quick={"workers": 2, "requests": 120, "systems": 24, "kv_blocks": 1500},
    quick_help="2 workers, 120 requests, 24 system prompts, 1500 KV blocks (a smoke run)",
    ok=lambda report, args: any(per[n]["ok"] for per in report["scenarios"].values() for n in PLACEMENTS),
    reports=("prefix-house3", "prefix"))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
