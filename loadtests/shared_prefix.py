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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtests.common import machine_info, markdown_table, produce, pyplot
from loadtests.simfleet import LeaseClient, RequestSpec, Result, random_text
from loadtests.suite import (
    LOGS,
    Engine,
    add_common_args,
    describe_run,
    engine_for,
    finish_args,
    fleet,
    fmt,
    latency_stats,
    open_loop,
    p0_slo,
    pct,
    samples,
    save_figure,
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
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "benchmark": NAME, "machine": machine_info(), "slo": asdict(slo),
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


# ---- report ----------------------------------------------------------------------------------------------------




def render_markdown(report: dict[str, Any]) -> str:
    s, arms = report["setup"], report["arms"]
    sim = report["engine"]["engine"] == "sim"
    unit = "req/s (A100 time)" if sim else "req/s"
    lines = [
        "# Shared prefix: many users, a few long system prompts",
        "",
        describe_run(report),
        "",
        f"- {s['systems']} system prompts of ~{s['system_tokens']} tokens, {s['users']} users, questions of "
        f"{s['question_tokens'].replace(',', '-')} tokens, {s['max_tokens']} output tokens, P0; Poisson arrivals at "
        f"{', '.join(f'{r:g}' for r in s['rates'])} {unit}, {s['phase_s_wall']:g} s (wall) each, rising; the "
        "scheduler's default profile (prefix affinity on the gateway's 512-character prefix hint).",
        "- Arms, each on a fresh fleet, the same arrivals, users and questions:",
        "",
        *[f"  - **{name}**: {a['description']}." for name, a in arms.items()],
        "",
        "## Headline",
        "",
    ]
    shared, unique = arms.get("shared"), arms.get("unique")
    if shared and unique:
        for a, b in zip(shared["levels"], unique["levels"], strict=False):
            ratio = (b["ttft"]["p50_ms"] / a["ttft"]["p50_ms"]) if a["ttft"]["p50_ms"] and b["ttft"]["p50_ms"] \
                else None
            lines.append(f"- {a['rate']:g} {unit}: TTFT p50 shared {fmt(a['ttft']['p50_ms'])} ms vs unique "
                         f"{fmt(b['ttft']['p50_ms'])} ms ({fmt(ratio, '{:.1f}')}x lower shared), p99 "
                         f"{fmt(a['ttft']['p99_ms'])} vs {fmt(b['ttft']['p99_ms'])} ms; within the P0 SLO "
                         f"{pct(a['attainment'], '{:.1f}%')} vs {pct(b['attainment'], '{:.1f}%')}; "
                         f"prompt from the cache {pct(a['cached_share'])} vs {pct(b['cached_share'])}.")
    lines.append("- Highest offered rate with ≥ 99% within the P0 SLO: " + "; ".join(
        f"{name} {fmt(a['capacity_within_slo'], '{:g}')}" + ("" if a["capacity_within_slo"] != s["rates"][-1]
                                                             else " (every rate)") for name, a in arms.items())
                 + f" {unit}.")
    rows = [[name, f"{lv['rate']:g}", lv["offered"], lv["failed"], fmt(lv["ttft"]["p50_ms"]),
             fmt(lv["ttft"]["p95_ms"]), fmt(lv["ttft"]["p99_ms"]), fmt(lv["tpot"]["p50_ms"], "{:.1f}"),
             fmt(lv["tpot"]["p99_ms"], "{:.1f}"), pct(lv["attainment"], "{:.1f}%"),
             fmt(lv["goodput_rps"], "{:.2f}"), pct(lv["cached_share"])]
            for name, a in arms.items() for lv in a["levels"]]
    lines += ["", "## Results", "",
              markdown_table(["arm", f"offered {unit}", "requests", "failed", "TTFT p50 ms", "p95", "p99",
                              "TPOT p50 ms", "p99", "within SLO", "goodput req/s", "cached"], rows), ""]
    errors = [f"- {name} at {lv['rate']:g}: {'; '.join(lv['errors'])}" for name, a in arms.items()
              for lv in a["levels"] if lv["errors"]]
    if errors:
        lines += ["Requests not served:", "", *errors, ""]
    lines += [
        "## Reading it",
        "",
        "- A cached system prompt is not prefilled again: a shared request's prefill is its question (and the "
        "block the prompt's last token falls in), so TTFT stays near one engine step and the prefill budget each "
        "step leaves for others is not spent on the same system prompt again; the fleet serves more within the SLO.",
        "- *tenants* shows the price of isolation: the same prompts, but nothing is shared across tenants (each "
        "tenant's blocks are salted), so it costs what *unique* costs once its users have warmed up their own "
        "caches — with many users each sends too few requests for that.",
        f"- The plot `{NAME}-{report['engine']['engine']}.png` shows TTFT p50/p99 and goodput against the offered "
        "rate, every arm.",
    ]
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, a in report["arms"].items():
        xs = [lv["rate"] for lv in a["levels"]]
        line = ax1.plot(xs, [lv["ttft"]["p50_ms"] for lv in a["levels"]], "-o", markersize=4, label=f"{name} p50")
        ax1.plot(xs, [lv["ttft"]["p99_ms"] for lv in a["levels"]], ":s", color=line[0].get_color(), markersize=3,
                 label=f"{name} p99")
        ax2.plot(xs, [lv["goodput_rps"] for lv in a["levels"]], "-o", color=line[0].get_color(), markersize=4,
                 label=name)
    ax2.plot(xs, xs, color="grey", linewidth=0.8, linestyle="--", label="offered")
    ax1.axhline(report["slo"]["ttft_s"] * 1000, color="red", linewidth=1, label="P0 TTFT SLO")
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (ms, log)")
    ax1.set_title("TTFT vs offered rate")
    ax2.set_ylabel("requests/s within the P0 SLO")
    ax2.set_title("goodput")
    sim = report["engine"]["engine"] == "sim"
    for ax in (ax1, ax2):
        ax.set_xlabel("offered rate (req/s" + (", A100 time)" if sim else ")"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(plt, fig, path, report, "Shared prefix vs unique prompts")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m loadtests.{NAME}", description=__doc__.split("\n\n")[0])
    add_common_args(ap, name=NAME, base_port=31300)
    ap.add_argument("--arms", default=None, help=f"comma-separated, of: {', '.join(ARMS)} (default all)")
    ap.add_argument("--systems", type=int, default=None, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--question-tokens", default=None, help="MIN,MAX")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rates", default=None, help="offered rates, req/s of engine time, comma-separated")
    ap.add_argument("--phase-s", type=float, default=None, help="wall seconds of arrivals per rate")
    args = finish_args(ap.parse_args(argv), name=NAME, presets=PRESETS)
    args.arms = args.arms or ",".join(ARMS)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = produce(args, benchmark, render_markdown, render_plot)
    return 0 if any(lv["served"] for a in report["arms"].values() for lv in a["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
