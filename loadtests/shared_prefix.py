"""Shared prefix: many users of one application whose prompts start with one of a few long system prompts, versus
prompts as long with nothing shared, under the same Poisson load; TTFT, goodput and the prefix cache's share.

Arms, each on a fresh fleet (cold caches), the same seeded arrivals, users and questions:

* ``shared``: one tenant (an application) with ``--users`` users; each request is one of ``--systems`` long system
  prompts plus the user's short question: after the first of each, the workers' prefix caches serve the system
  prompt and the scheduler's prefix affinity keeps each system prompt on the workers that hold it;
* ``unique``: every prompt as long, but unique (no reuse possible): what the same traffic costs without sharing;
* ``tenants``: the same few system prompts, but each user is a tenant of its own: the workers salt every tenant's
  cache blocks differently (so that one tenant cannot time another's prompts), so nothing is shared across them.

Each offered rate (``--rates``, per second of engine time) runs ``--phase-s`` wall seconds of arrivals, rising, and
waits for every request before the next.

    python -m loadtests.shared_prefix --out loadtests/reports/shared_prefix-sim     # 4 simulated workers, ~10 min
    python -m loadtests.shared_prefix --engine vllm --out loadtests/reports/shared_prefix-vllm   # ~6 min
    python -m loadtests.shared_prefix --smoke      # 2 simulated workers, one short rate, 2 arms (the test)

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from loadtests import bench
from loadtests.common import machine_info
from loadtests.simfleet import LeaseClient, RequestSpec, Result, random_text
from loadtests.suite import (
    LOGS,
    Engine,
    declare,
    engine_for,
    figure_title,
    fleet,
    latency_stats,
    open_loop,
    p0_slo,
    samples,
    worker_info,
)

NAME = "shared_prefix"
PRESETS: dict[str, dict[str, Any]] = {
    "sim": {"workers": 4, "max_num_seqs": 64, "max_model_len": 8192, "systems": 4, "system_tokens": 2000,
            "question_tokens": "30,80", "max_tokens": 64, "users": 1000, "rates": "4,8,12,16", "phase_s": 30.0},
    "vllm": {"workers": 1, "max_num_seqs": 8, "max_model_len": 2048, "systems": 2, "system_tokens": 600,
             "question_tokens": "20,40", "max_tokens": 16, "users": 50, "rates": "0.3,0.6", "phase_s": 40.0},
    "smoke": {"workers": 2, "max_num_seqs": 8, "max_model_len": 4096, "systems": 2, "system_tokens": 400,
              "question_tokens": "10,20", "max_tokens": 8, "users": 20, "rates": "4", "phase_s": 2.0,
              "time_scale": 1.0, "arms": "shared,unique"},
}
ARMS = {
    "shared": "one tenant, a few long system prompts shared by its users",
    "unique": "every prompt as long, nothing shared",
    "tenants": "the same few system prompts, but every user a tenant of its own (cache salted per tenant)",
}


def requests(arm: str, rate_index: int, args: argparse.Namespace, engine: Engine) -> Iterator[RequestSpec]:
    """The arm's requests for one rate: the same users, system-prompt choices and questions in every arm.

    >>> ns = argparse.Namespace(seed=1, systems=2, system_tokens=20, question_tokens="2,4", users=5, max_tokens=4)
    >>> e = Engine("sim", 1, 1, 512, {}, {})
    >>> [len({s.prompt[:80] for s, _ in zip(requests(a, 0, ns, e), range(20))}) for a in ("shared", "unique")]
    [2, 20]
    >>> {s.tenant for s, _ in zip(requests("tenants", 0, ns, e), range(20))} <= {f"user-{i}" for i in range(5)}
    True
    """
    cpt = engine.chars_per_token
    systems = [f"system prompt {i}: " + random_text(random.Random(f"sys-{i}"), int(args.system_tokens * cpt))
               for i in range(args.systems)]
    lo, hi = (int(x) for x in args.question_tokens.split(","))
    rng = random.Random(f"{args.seed}-{rate_index}")
    i = 0
    while True:
        user, system = rng.randrange(args.users), rng.randrange(args.systems)
        question = "\nuser: " + random_text(rng, int(rng.randint(lo, hi) * cpt)) + "\nassistant:"
        head = systems[system]
        if arm == "unique":
            head = f"unique {rate_index}-{i}: " + random_text(random.Random(f"u-{rate_index}-{i}"), len(head))
            head = head[:len(systems[system])]
        yield RequestSpec(request_id=f"{arm}-{rate_index}-{i}", priority="P0",
                          tenant=f"user-{user}" if arm == "tenants" else "app", prompt=head + question,
                          max_tokens=args.max_tokens, deadline_s=300.0)
        i += 1


async def run_arm(args: argparse.Namespace, arm: str, rates: list[float]) -> dict[str, Any]:
    engine = engine_for(args)
    slo = p0_slo(args.engine)
    levels = []
    async with fleet(engine, base_port=args.base_port, logdir=LOGS / NAME,
                     name=f"scheduler-{arm}") as f:
        workers = await worker_info(f)
        client = LeaseClient(f.scheduler_addr, rng=random.Random(args.seed))
        for k, rate in enumerate(rates):
            results, _ = await open_loop(client, requests(arm, k, args, engine), rate=rate / engine.scale,
                                         duration_s=args.phase_s, rng=random.Random(f"{args.seed}-arrivals-{k}"))
            stats = latency_stats(samples(results, engine.scale), slo, window_s=args.phase_s / engine.scale,
                                  offered=len(results))
            levels.append({"rate": rate, **stats, "failed": sum(1 for r in results if r.outcome != "ok"),
                           "errors": _errors(results)})
            print(f"[{arm}] {rate:g}/s: TTFT p50 {stats['ttft']['p50_ms'] or 0:.0f} ms p99 "
                  f"{stats['ttft']['p99_ms'] or 0:.0f} ms; within SLO {(stats['attainment'] or 0) * 100:.1f}%; "
                  f"cached {(stats['cached_share'] or 0) * 100:.0f}%", flush=True)
        await client.close()
    return {"arm": arm, "description": ARMS[arm], "engine": engine.describe(), "workers": workers, "levels": levels}


def _errors(results: list[Result]) -> list[str]:
    return sorted({(r.error or r.outcome)[:120] for r in results if r.outcome != "ok"})[:5]


def capacity_within_slo(levels: list[dict[str, Any]], target: float = 0.99) -> float | None:
    """The highest offered rate before the first whose share within the SLO is under ``target``.

    >>> capacity_within_slo([{"rate": 4, "attainment": 1.0}, {"rate": 8, "attainment": 0.9}])
    4
    """
    out = None
    for lv in levels:
        if lv["attainment"] is None or lv["attainment"] < target:
            break
        out = lv["rate"]
    return out


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    slo = p0_slo(args.engine)
    rates = [float(x) for x in args.rates.split(",")]
    report: dict[str, Any] = {
        "machine": machine_info(), "slo": asdict(slo),
        "setup": {"systems": args.systems, "system_tokens": args.system_tokens, "users": args.users,
                  "question_tokens": args.question_tokens, "max_tokens": args.max_tokens, "rates": rates,
                  "phase_s_wall": args.phase_s, "seed": args.seed},
        "arms": {},
    }
    for arm in args.arms.split(","):
        result = await run_arm(args, arm, rates)
        report["engine"] = result.pop("engine")
        result["capacity_within_slo"] = capacity_within_slo(result["levels"])
        report["arms"][arm] = result
    return report


# ---- report (the prose: templates/shared_prefix.md) -------------------------------------------------------------


def context(report: dict[str, Any]) -> dict[str, Any]:
    """The shared and unique arms' levels side by side; the errors per arm and rate."""
    arms = report["arms"]
    return {"pairs": list(zip(arms.get("shared", {}).get("levels", []), arms.get("unique", {}).get("levels", []),
                              strict=False)),
            "errors": [(name, lv["rate"], lv["errors"]) for name, a in arms.items() for lv in a["levels"]
                       if lv["errors"]]}


def figure(report: dict[str, Any]) -> bench.Figure:
    """TTFT p50/p99 and goodput against the offered rate, every arm."""
    arms = report["arms"]
    colour = {name: f"C{i}" for i, name in enumerate(arms)}
    rates = [lv["rate"] for a in arms.values() for lv in a["levels"]]
    offered = sorted(set(rates))
    xlabel = "offered rate (req/s" + (", A100 time)" if report["engine"]["engine"] == "sim" else ")")
    ttft = bench.Panel("TTFT vs offered rate", xlabel, "TTFT (ms, log)", [
        bench.Series(f"{name} {q}", [lv["rate"] for lv in a["levels"]], [lv["ttft"][f"{q}_ms"] for lv in a["levels"]],
                     style, colour[name]) for name, a in arms.items() for q, style in (("p50", "-"), ("p99", ":"))],
        lines=[(report["slo"]["ttft_s"] * 1000, "P0 TTFT SLO", "-", "red")], yscale="log", legend_size=7)
    goodput = bench.Panel("goodput", xlabel, "requests/s within the P0 SLO", [
        *(bench.Series(name, [lv["rate"] for lv in a["levels"]], [lv["goodput_rps"] for lv in a["levels"]],
                       color=colour[name]) for name, a in arms.items()),
        bench.Series("offered", offered, offered, "--", "grey")], legend_size=7)
    return bench.Figure(figure_title(report, "Shared prefix vs unique prompts"), [ttft, goodput])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arms", default=None, help=f"comma-separated, of: {', '.join(ARMS)} (default all)")
    ap.add_argument("--systems", type=int, default=None, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--question-tokens", default=None, help="MIN,MAX")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rates", default=None, help="offered rates, req/s of engine time, comma-separated")
    ap.add_argument("--phase-s", type=float, default=None, help="wall seconds of arrivals per rate")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.arms = args.arms or ",".join(ARMS)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms: {', '.join(sorted(unknown))}")


BENCHMARK = declare(NAME, __doc__ or "", benchmark, presets=PRESETS, base_port=31300, arguments=add_arguments,
                    prepare=prepare, figure=figure, context=context,
                    ok=lambda report: any(lv["served"] for a in report["arms"].values() for lv in a["levels"]))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
