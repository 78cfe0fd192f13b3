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
    python -m loadtests.pools --render loadtests/reports/pools.json   # the report again (templates/pools.md)

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
from typing import Any

from loadtests import bench
from loadtests.common import machine_info, summarize
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


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    sim = {"time_scale": args.time_scale, "stream_every": 8, "max_batched_tokens": args.max_batched_tokens}
    plan = arrivals(args.seed, rate=args.rate, p0_share=args.p0_share, phase_s=args.phase_s)
    fleets = layouts(args)
    report: dict[str, Any] = {
        "machine": machine_info(),
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
    return report


# ---- goals, report and plot (the prose: templates/pools.md) -----------------------------------------------------


def number(report: dict[str, Any], config: str, c: str, *keys: str) -> Any:
    """``report["configs"][config][c][key]...``; None where a report has no such field."""
    v = report["configs"][config][c]
    for k in keys:
        v = v.get(k)
    return v


def pools_vs_shared(c: str, *keys: str) -> Any:
    """A number of class ``c`` with pools, and the shared pool's (the baseline) in the same run."""
    return lambda report: (number(report, "pools", c, *keys), number(report, "shared", c, *keys))


GOALS = [
    bench.Goal("P0 TTFT p99 no higher with pools than in one shared pool", pools_vs_shared("P0", "ttft", "p99_ms"),
               1.0, at_most=True, judged="ratio", digits=0),
    bench.Goal("P2 output tokens/s no lower with pools than in one shared pool",
               pools_vs_shared("P2", "output_tokens_per_s"), 1.0, judged="ratio", unit="tokens/s", digits=0),
]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Pools / shared ratios (P0 TTFT p50 and p99, P2 tokens/s to the last completion and while arriving) and the
    failures (configuration, class, reasons)."""
    def ratio(*keys: str) -> float | None:
        p, s = pools_vs_shared(*keys)(report)
        return p / s if p and s else None

    return {"ratios": {"p0_p50": ratio("P0", "ttft", "p50_ms"), "p0_p99": ratio("P0", "ttft", "p99_ms"),
                       "p2": ratio("P2", "output_tokens_per_s"),
                       "p2_arriving": ratio("P2", "output_tokens_per_s_arrivals")},
            "failures": [(name, c, errs) for name, conf in report["configs"].items() for c in ("P0", "P2")
                         if (errs := conf[c]["errors"])]}


def figure(report: dict[str, Any]) -> bench.Figure:
    names = list(report["configs"])

    def series(label: str, c: str, *keys: str, color: str | None = None) -> bench.Series:
        return bench.Series(label, range(len(names)), [number(report, n, c, *keys) for n in names], color=color)

    return bench.Figure(
        f"Priority pools vs one shared pool ({report['setup']['workers']} simulated A100/7B workers)", [
            bench.Panel("P0 TTFT (lower is better)", "", "P0 TTFT (ms)",
                        [series("p50", "P0", "ttft", "p50_ms"), series("p99", "P0", "ttft", "p99_ms")], xticks=names),
            bench.Panel("P2 throughput (higher is better)", "", "P2 output tokens/s",
                        [series("to the last P2 completion", "P2", "output_tokens_per_s", color="tab:green"),
                         series("while arriving", "P2", "output_tokens_per_s_arrivals", color="tab:olive")],
                        xticks=names)], panel_width=4.5)


def add_arguments(ap: argparse.ArgumentParser) -> None:
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


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 < args.interactive < args.workers:
        ap.error("--interactive must leave at least one worker to each pool")


def served(report: dict[str, Any], args: argparse.Namespace) -> bool:
    return sum((c[k]["success_rate"] or 0) * c[k]["n"] for c in report["configs"].values() for k in ("P0", "P2")) > 0


BENCHMARK = bench.Benchmark(
    name="pools", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare, goals=GOALS,
    context=context, figure=figure, seed=11,
    quick={"workers": 2, "interactive": 1, "phase_s": 3.0, "rate": 3.0, "time_scale": 0.5, "drain_timeout_s": 30.0},
    quick_help="2 workers, a few seconds of light arrivals (the test)", ok=served, reports=("pools",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
