"""Priority pools benchmark: two pools of one model (interactive P0/P1 with small batches, batch P2 with large ones)
versus one shared pool of the same size, under the same seeded arrivals, on simulated workers.

The fleet is real processes on localhost: ``python -m goodput_inference`` with the simulated engine (A100 / 7B
calibration, ``goodput_inference.sim_engine``) and ``python -m goodput_scheduler`` (only the GPU is simulated).
Both configurations use the same number of workers and the same scheduler; they differ only in the workers' pool
settings (``GOODPUT_INFERENCE_POOL``, ``POOL_CLASSES``, ``MAX_NUM_SEQS``):

* ``shared``: every worker serves every class with the same batch size; the scheduler's usual class handling
  (strict priority, class shares, latency guard, prefill gate) keeps P0 fast;
* ``pools``: ``--interactive`` workers serve P0/P1 with small batches, the rest serve P2 with large batches; the
  scheduler's ``serves_class`` filter keeps each class on its pool.

The same Poisson arrivals (seeded: a P0 chat / P2 batch mix at the fleets' capacity: both end the arrivals with a
batch backlog) run against each for
``--phase-s`` seconds; the run then waits for every request to finish. Reported: P0 TTFT p50/p99 and P2 output
tokens/s (P2 tokens generated over the time from the first arrival to the last P2 completion), both configurations,
their ratios, and whether pools beat the shared pool on both (the goal).

    python -m loadtests.pools                 # full run, 4 simulated workers, ~5 min on 2 cores
    python -m loadtests.pools --smoke         # 2 workers, a few seconds of arrivals (the test)
    python -m loadtests.pools --render loadtests/reports/pools.json   # re-render report + plot

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtests.common import cpu_label, machine_info, markdown_table, produce, pyplot, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result, SimFleet, random_text

SHAPES = {"P0": (1024, 64), "P2": (2048, 256)}  # (prompt chars ~ 4 per token, max_tokens): chat vs batch generation
DEADLINES = {"P0": 30.0, "P2": 600.0}
# Both configurations: no overload shedding (a shed P2 would be retried after a backoff, which measures the retry
# policy, not placement); everything else at the scheduler's defaults.
SCHEDULER_ENV = {"SHED_P2_AT": "100", "SHED_P1_AT": "100"}


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker's pool settings."""

    pool: str
    classes: str  # "" = every class
    max_num_seqs: int


def layouts(args: argparse.Namespace) -> dict[str, list[WorkerSpec]]:
    """The two fleets, same size: one shared pool, or ``args.interactive`` P0/P1 workers and the rest P2.

    >>> ns = argparse.Namespace(workers=4, interactive=1, shared_seqs=32, interactive_seqs=16, batch_seqs=96)
    >>> [(w.pool, w.classes, w.max_num_seqs) for w in layouts(ns)["pools"]]
    [('interactive', 'P0,P1', 16), ('batch', 'P2', 96), ('batch', 'P2', 96), ('batch', 'P2', 96)]
    """
    return {
        "shared": [WorkerSpec("default", "", args.shared_seqs)] * args.workers,
        "pools": [WorkerSpec("interactive", "P0,P1", args.interactive_seqs)] * args.interactive
        + [WorkerSpec("batch", "P2", args.batch_seqs)] * (args.workers - args.interactive),
    }


def scheduler_env(fleet: list[WorkerSpec]) -> dict[str, str]:
    """The scheduler's settings for one configuration: the same, but for the per-worker lease cap, which is the
    largest batch in the fleet (one setting for all workers)."""
    return {**SCHEDULER_ENV, "MAX_INFLIGHT_PER_WORKER": str(max(w.max_num_seqs for w in fleet))}


class PoolFleet(SimFleet):
    """A :class:`SimFleet` whose workers each have their own pool settings."""

    def __init__(self, *, layout: list[WorkerSpec], **kw: Any) -> None:
        super().__init__(workers=len(layout), max_num_seqs=max(w.max_num_seqs for w in layout), **kw)
        self.layout = layout

    def start_workers(self) -> None:
        for i, (addr, spec) in enumerate(zip(self.worker_addrs, self.layout, strict=True)):
            env = {"GOODPUT_INFERENCE_ENGINE": self.engine, "GOODPUT_INFERENCE_GRPC_PORT": addr.rsplit(":", 1)[1],
                   "GOODPUT_INFERENCE_HTTP_PORT": "0", "GOODPUT_INFERENCE_WORKER_ID": f"sim-{i}",
                   "GOODPUT_INFERENCE_MAX_MODEL_LEN": str(self.max_model_len),
                   "GOODPUT_INFERENCE_SCHEDULING_POLICY": "priority",
                   "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps(self.sim), "GOODPUT_INFERENCE_LOG_LEVEL": "WARNING",
                   **self.worker_env, "GOODPUT_INFERENCE_POOL": spec.pool,
                   "GOODPUT_INFERENCE_POOL_CLASSES": spec.classes,
                   "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(spec.max_num_seqs)}
            self.procs.append(self._spawn("goodput_inference", env, f"pool-worker-{i}"))


@dataclass(frozen=True)
class Arrival:
    at_s: float
    spec: RequestSpec


def arrivals(seed: int, *, rate: float, p0_share: float, phase_s: float) -> list[Arrival]:
    """The seeded arrivals both configurations get: Poisson at ``rate``/s, P0 with probability ``p0_share``.

    >>> a, b = arrivals(1, rate=5, p0_share=0.3, phase_s=10), arrivals(1, rate=5, p0_share=0.3, phase_s=10)
    >>> a == b and {x.spec.priority for x in a} == {"P0", "P2"}
    True
    """
    rng = random.Random(seed)
    system = "system: you are a helpful assistant. " + random_text(random.Random("system"), 400) + "\n"
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > phase_s:
            return out
        prio = "P0" if rng.random() < p0_share else "P2"
        chars, max_tokens = SHAPES[prio]
        prompt = system + random_text(rng, chars - len(system))
        out.append(Arrival(t, RequestSpec(request_id=f"{prio}-{len(out)}", priority=prio, tenant="acme",
                                          prompt=prompt, max_tokens=max_tokens, deadline_s=DEADLINES[prio])))


async def drive(client: LeaseClient, plan: list[Arrival], *, drain_timeout_s: float) -> list[Result]:
    """Sends each request at its time (open loop) and waits for all of them (at most ``drain_timeout_s`` more)."""
    start = time.monotonic()
    tasks: list[asyncio.Task[Result]] = []
    for a in plan:
        delay = start + a.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.run(a.spec)))
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
    for p in pending:
        p.cancel()
    results = []
    for task in tasks:
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            spec = plan[tasks.index(task)].spec
            results.append(Result(spec=spec, arrival=0.0, outcome="unfinished",
                                  error="" if task not in done else repr(task.exception())))
    return results


def tokens_within(results: list[Result], t0: float, t1: float) -> float:
    """Output tokens generated between ``t0`` and ``t1``, each request's tokens spread evenly from its first token to
    its completion (the stream is not timed token by token).

    >>> r = Result(RequestSpec("r", "P2", "t", "x", 100, 1), 10.0, "ok", ttft_s=0.0, e2e_s=10.0)
    >>> tokens_within([r], 10.0, 15.0)
    50.0
    """
    total = 0.0
    for r in results:
        if r.outcome != "ok" or r.ttft_s is None or r.e2e_s is None:
            continue
        start, end = r.arrival + r.ttft_s, r.arrival + r.e2e_s
        if end <= start:
            total += r.spec.max_tokens if t0 <= end <= t1 else 0
            continue
        overlap = max(0.0, min(end, t1) - max(start, t0))
        total += r.spec.max_tokens * overlap / (end - start)
    return total


def analyse(results: list[Result], *, phase_s: float = 0.0) -> dict[str, Any]:
    """P0 TTFT, P2 output tokens/s (tokens over first arrival -> last P2 completion; and, with ``phase_s``, while
    arrivals last), outcomes per class.

    >>> spec = lambda p, n: RequestSpec("r", p, "t", "x", n, 1)
    >>> rs = [Result(spec("P0", 8), 10.0, "ok", ttft_s=0.1, e2e_s=0.5), Result(spec("P2", 100), 10.0, "ok",
    ...       ttft_s=1.0, e2e_s=4.0), Result(spec("P2", 100), 11.0, "ok", ttft_s=1.0, e2e_s=3.0)]
    >>> s = analyse(rs)
    >>> s["P2"]["output_tokens_per_s"], s["P0"]["ttft"]["p50_ms"], s["P2"]["success_rate"]
    (50.0, 100.0, 1.0)
    """
    out: dict[str, Any] = {}
    t0 = min((r.arrival for r in results if r.arrival), default=0.0)
    for c in ("P0", "P2"):
        rs = [r for r in results if r.spec.priority == c]
        ok = [r for r in rs if r.outcome == "ok"]
        tokens = sum(r.spec.max_tokens for r in ok)  # the simulated engine generates exactly max_tokens
        last = max((r.arrival + (r.e2e_s or 0.0) for r in ok), default=t0)
        out[c] = {
            "n": len(rs),
            "success_rate": len(ok) / len(rs) if rs else None,
            "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
            "output_tokens": tokens,
            "makespan_s": last - t0,
            "output_tokens_per_s": tokens / (last - t0) if last > t0 else None,
            "output_tokens_per_s_arrivals": tokens_within(ok, t0, t0 + phase_s) / phase_s if phase_s else None,
            "workers": dict(Counter(r.worker for r in ok).most_common()),
            "errors": Counter((r.error or r.outcome)[:120] for r in rs if r.outcome != "ok").most_common(5),
        }
    return out


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sim = {"time_scale": args.time_scale, "stream_every": 8, "max_batched_tokens": args.max_batched_tokens}
    plan = arrivals(args.seed, rate=args.rate, p0_share=args.p0_share, phase_s=args.phase_s)
    fleets = layouts(args)
    report: dict[str, Any] = {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "benchmark": "pools", "machine": machine_info(),
        "setup": {"workers": args.workers, "sim": sim, "rate_rps": args.rate, "p0_share": args.p0_share,
                  "phase_s": args.phase_s, "shapes": SHAPES, "requests": len(plan),
                  "requests_by_class": dict(Counter(a.spec.priority for a in plan)), "seed": args.seed,
                  "fleets": {name: [w.__dict__ for w in fleet] for name, fleet in fleets.items()},
                  "scheduler": {name: scheduler_env(fleet) for name, fleet in fleets.items()}},
        "configs": {},
    }
    for name in ("shared", "pools"):
        fleet = fleets[name]
        with PoolFleet(layout=fleet, base_port=args.base_port, sim=sim,
                       logdir=args.out.parent / "logs") as sims:
            sims.start_scheduler(scheduler_env(fleet), name=f"scheduler-{name}")
            await sims.wait_ready()
            client = LeaseClient(sims.scheduler_addr, rng=random.Random(args.seed))
            started = time.monotonic()
            results = await drive(client, plan, drain_timeout_s=args.drain_timeout_s)
            await client.close()
            stats = analyse(results, phase_s=args.phase_s)
            stats["wall_s"] = time.monotonic() - started
            report["configs"][name] = stats
            print(f"[{name}] P0 TTFT p50 {stats['P0']['ttft']['p50_ms'] or 0:.0f} ms p99 "
                  f"{stats['P0']['ttft']['p99_ms'] or 0:.0f} ms; P2 {stats['P2']['output_tokens_per_s'] or 0:.0f} "
                  f"tokens/s; {stats['wall_s']:.0f} s", flush=True)
    report["comparison"] = compare(report)
    return report


def compare(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios pools / shared: P0 TTFT (lower is better) and P2 output tokens/s (higher is better), and the goal."""
    s, p = report["configs"]["shared"], report["configs"]["pools"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {"p0_ttft_p50_ratio": ratio(p["P0"]["ttft"]["p50_ms"], s["P0"]["ttft"]["p50_ms"]),
           "p0_ttft_p99_ratio": ratio(p["P0"]["ttft"]["p99_ms"], s["P0"]["ttft"]["p99_ms"]),
           "p2_tokens_per_s_ratio": ratio(p["P2"]["output_tokens_per_s"], s["P2"]["output_tokens_per_s"]),
           "p2_tokens_per_s_arrivals_ratio": ratio(p["P2"].get("output_tokens_per_s_arrivals"),
                                                   s["P2"].get("output_tokens_per_s_arrivals"))}
    p0_better = out["p0_ttft_p99_ratio"] is not None and out["p0_ttft_p99_ratio"] < 1.0
    p2_better = out["p2_tokens_per_s_ratio"] is not None and out["p2_tokens_per_s_ratio"] > 1.0
    all_ok = all(c[k]["success_rate"] == 1.0 for c in (s, p) for k in ("P0", "P2"))
    return {**out, "p0_better": p0_better, "p2_better": p2_better, "all_completed": all_ok,
            "goal_met": p0_better and p2_better}


# ---- report ----------------------------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "—" if v is None else fmt.format(v)


def render_markdown(report: dict[str, Any]) -> str:
    s, cmp = report["setup"], report["comparison"]
    fleets = "; ".join(f"**{name}**: " + ", ".join(f"{w['pool']} ({w['classes'] or 'all classes'}, "
                                                    f"max_num_seqs {w['max_num_seqs']})" for w in fleet)
                       for name, fleet in s["fleets"].items())
    rows = []
    for name, c in report["configs"].items():
        rows.append([name, c["P0"]["n"], _f((c["P0"]["success_rate"] or 0) * 100, "{:.1f}%"),
                     _f(c["P0"]["ttft"]["p50_ms"]), _f(c["P0"]["ttft"]["p99_ms"]), _f(c["P0"]["e2e"]["p99_ms"]),
                     c["P2"]["n"], _f((c["P2"]["success_rate"] or 0) * 100, "{:.1f}%"),
                     _f(c["P2"]["output_tokens_per_s"]), _f(c["P2"].get("output_tokens_per_s_arrivals")),
                     _f(c["P2"]["makespan_s"], "{:.1f}"),
                     _f(c["P2"]["e2e"]["p50_ms"])])
    verdict = "**met**" if cmp["goal_met"] else "**missed**"
    lines = [
        "# Priority pools: two pools vs one shared pool of the same size",
        "",
        f"Generated {report.get('generated_at', '')} by `python -m loadtests.pools`. Simulated workers (A100 / 7B "
        f"calibration, `goodput_inference.sim_engine`), {s['workers']} workers in both configurations, "
        f"{s['sim']['max_batched_tokens']} tokens per engine step, simulated time x{s['sim']['time_scale']} (every "
        f"latency below is wall-clock, so also x{s['sim']['time_scale']} an A100's); real scheduler and worker "
        f"processes over gRPC on {report['machine'].get('cores_usable')} CPU cores "
        f"({cpu_label(report['machine'])}; load average at start "
        f"{' / '.join(str(x) for x in report['machine'].get('loadavg_1_5_15', []))}: other work shared the "
        "cores, so run-to-run noise of a few tens of ms in the tail is expected).",
        "",
        f"- Fleets: {fleets}.",
        f"- Arrivals (the same seeded list for both): Poisson {s['rate_rps']:g} req/s for {s['phase_s']:g} s, "
        f"{s['requests']} requests ({', '.join(f'{k} {v}' for k, v in s['requests_by_class'].items())}); "
        f"prompt/max_tokens {', '.join(f'{k} ~{c // 4}/{m}' for k, (c, m) in s['shapes'].items())}. Every "
        "request runs to completion; overload shedding is off in both (`SHED_P2_AT`/`SHED_P1_AT` 100).",
        f"- Scheduler settings: {', '.join(f'{k}: `{json.dumps(v)}`' for k, v in s['scheduler'].items())}.",
        "",
        "## Result",
        "",
        markdown_table(["config", "P0 n", "P0 ok", "P0 TTFT p50 ms", "P0 TTFT p99 ms", "P0 e2e p99 ms", "P2 n",
                        "P2 ok", "P2 output tokens/s", "while arriving", "P2 makespan s", "P2 e2e p50 ms"], rows),
        "",
        f"- P0 TTFT, pools / shared: p50 {_f(cmp['p0_ttft_p50_ratio'], '{:.2f}x')}, p99 "
        f"{_f(cmp['p0_ttft_p99_ratio'], '{:.2f}x')} (below 1 is better).",
        f"- P2 output tokens/s, pools / shared: {_f(cmp['p2_tokens_per_s_ratio'], '{:.2f}x')} to the last P2 "
        f"completion, {_f(cmp.get('p2_tokens_per_s_arrivals_ratio'), '{:.2f}x')} while arrivals last (above 1 is "
        "better).",
        f"- Goal (both better with pools): {verdict} — P0 p99 TTFT {'better' if cmp['p0_better'] else 'not better'}"
        f", P2 throughput {'better' if cmp['p2_better'] else 'not better'}"
        f"{'' if cmp['all_completed'] else '; not every request completed (see failures)'}.",
        "",
    ]
    failures = [f"- {name} {c}: " + "; ".join(f"{why} ({n})" for why, n in errs)
                for name, conf in report["configs"].items() for c in ("P0", "P2") if (errs := conf[c]["errors"])]
    if failures:
        lines += ["## Failures", "", *failures, ""]
    lines += [
        "## Reading it",
        "",
        "- P2 output tokens/s is every P2 token generated over the time from the first arrival to the last P2 "
        "completion: with the same arrivals offered at capacity, the configuration that drains the batch backlog "
        "sooner has the higher number; it includes the last requests' own latency (a large batch decodes each "
        "sequence more slowly). *While arriving* counts the tokens generated during the arrivals only (each "
        "request's tokens spread evenly from its first token to its completion): the rate each fleet sustains.",
        "- In the shared pool P0 shares engine steps with batch work: the scheduler keeps it fast with strict "
        "priority, class shares, the latency guard and the prefill gate, each of which also holds P2 back. With "
        "pools P0 runs on small batches of its own and P2 fills large batches with nothing held back for P0; the "
        "price is that the interactive pool's idle slots cannot serve P2 (a burst of P0 beyond its size waits, or "
        "falls back to the batch pool only if the interactive pool is down).",
        "- P0's p99 rests on about a hundred P0 requests, so it is close to their slowest few; rerun before reading "
        "a difference of a few tens of ms into it.",
        "- Pools pay off only because P0's protections stay off the batch pool (no class headroom, latency guard or "
        "decode-only reserve on a worker whose pool does not serve P0): with them, the guard cuts P2 on every worker "
        "whenever the one interactive worker's P0 tail rises. And the interactive pool must be sized for P0's "
        "bursts: every P0 prompt is prefilled there, so its p50 is no better than the shared pool's, where P0 "
        "prompts spread over every worker.",
        "- The plot `pools.png` shows both numbers side by side.",
    ]
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    names = list(report["configs"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    xs = range(len(names))
    for offset, key in ((-0.2, "p50_ms"), (0.2, "p99_ms")):
        ax1.bar([x + offset for x in xs], [report["configs"][n]["P0"]["ttft"][key] or 0 for n in names], width=0.4,
                label=key.removesuffix("_ms"))
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("P0 TTFT (ms)")
    ax1.set_title("P0 TTFT (lower is better)")
    ax1.legend()
    ax2.bar(list(xs), [report["configs"][n]["P2"]["output_tokens_per_s"] or 0 for n in names], color="tab:green")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("P2 output tokens/s")
    ax2.set_title("P2 throughput (higher is better)")
    fig.suptitle(f"Priority pools vs one shared pool ({report['setup']['workers']} simulated A100/7B workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.pools", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="simulated workers in each configuration")
    ap.add_argument("--interactive", type=int, default=1, help="of which serve P0/P1 in the pools configuration")
    ap.add_argument("--shared-seqs", type=int, default=32, help="max_num_seqs of the shared pool's workers")
    ap.add_argument("--interactive-seqs", type=int, default=32, help="max_num_seqs of the interactive pool")
    ap.add_argument("--batch-seqs", type=int, default=96, help="max_num_seqs of the batch pool")
    ap.add_argument("--rate", type=float, default=7.0,
                    help="arrivals per second (Poisson): at 7 both fleets end the arrivals with a batch backlog")
    ap.add_argument("--p0-share", type=float, default=0.3, help="share of the arrivals that are P0")
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--time-scale", type=float, default=4.0, help="simulated time multiplier")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="the engines' token budget per step")
    ap.add_argument("--drain-timeout-s", type=float, default=240.0)
    ap.add_argument("--base-port", type=int, default=26300)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path("loadtests/out/pools"))
    ap.add_argument("--smoke", action="store_true", help="2 workers, a few seconds of light arrivals (the test)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON", help="re-render a saved report")
    args = ap.parse_args(argv)
    if args.smoke:
        args.workers, args.interactive, args.phase_s, args.rate, args.time_scale = 2, 1, 3.0, 3.0, 0.5
        args.drain_timeout_s = 30.0
    if not 0 < args.interactive < args.workers:
        ap.error("--interactive must leave at least one worker to each pool")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = produce(args, benchmark, render_markdown, render_plot)
    served = sum((c[k]["success_rate"] or 0) * c[k]["n"] for c in report["configs"].values() for k in ("P0", "P2"))
    return 0 if served > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
