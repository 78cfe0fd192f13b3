"""Overload benchmark: P0/P1/P2 under open-loop Poisson arrivals ramping to 3x capacity, on simulated workers.

One run drives three schedulers over the same simulated fleet (real scheduler and worker processes, gRPC; only the
GPU is simulated, see goodput_inference.sim_engine):

* ``goodput``: priority classes, tenant fairness, overload shedding, the default placement profile;
* ``fifo``: one arrival-order queue, no priority anywhere (the worker sees none either) — the baseline;
* ``round_robin``: the goodput queues with round-robin placement instead of the scoring profile.

First it measures, in the same run, P0's unloaded TTFT (one request at a time) and the fleet's capacity (closed
loop, every slot busy, completions per second). Then each offered load (a multiple of capacity) runs for
``--phase-s`` seconds of Poisson arrivals with a P0/P1/P2 and multi-tenant mix; shed P2 requests are parked and
re-submitted with the deferred-retry policy of ``goodput_gateway.jobs`` until they complete. Per class it reports
TTFT and end-to-end p50/p95/p99, success/shed/expired rates and goodput (requests within SLO per second), and plots
P0 p99 TTFT against offered load.

    python -m loadtests.overload                       # full run, 4 simulated workers, ~15 min on 2 cores
    python -m loadtests.overload --workers 2 --out loadtests/reports/overload-2workers
    python -m loadtests.overload --quick               # small smoke run (~3 min)
    python -m loadtests.overload --render loadtests/reports/overload.json   # the report again (templates/overload.md)

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from loadtests import bench
from loadtests.common import machine_info, percentile, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result, SimFleet, random_text

CLASSES = ("P0", "P1", "P2")
MIX = {"P0": 0.2, "P1": 0.3, "P2": 0.5}
TENANTS = {"acme": 0.6, "globex": 0.25, "initech": 0.15}  # acme is the bursty big tenant
SHAPES = {"P0": (1024, 32), "P1": (2048, 64), "P2": (4096, 128)}  # (prompt chars ~ 4 per token, max_tokens)
DEADLINES = {"P0": 30.0, "P1": 60.0, "P2": 300.0}
CONFIGS: dict[str, dict[str, Any]] = {
    "goodput": {"env": {"QUEUE_POLICY": "priority"}, "send_priority": True},
    "fifo": {"env": {"QUEUE_POLICY": "fifo", "FIFO_MAX_QUEUE": "0"}, "send_priority": False},
    "round_robin": {"env": {"QUEUE_POLICY": "priority",
                            "PROFILE": json.dumps({"scorers": [{"name": "least_loaded", "weight": 1.0}],
                                                   "picker": "round_robin"})},
                    "send_priority": True},
}


def make_spec(rng: random.Random, i: int, prio: str, *, send_priority: bool, systems: dict[str, str]) -> RequestSpec:
    tenant = rng.choices(list(TENANTS), weights=list(TENANTS.values()))[0]
    chars, max_tokens = SHAPES[prio]
    prompt = systems[tenant] + random_text(rng, chars - len(systems[tenant]))
    return RequestSpec(request_id=f"{prio}-{i}", priority=prio, tenant=tenant, prompt=prompt, max_tokens=max_tokens,
                       deadline_s=DEADLINES[prio], retry_shed=prio == "P2", send_priority=send_priority)


async def unloaded_ttft(client: LeaseClient, rng: random.Random, systems: dict[str, str], n: int) -> list[float]:
    out = []
    for i in range(n):
        r = await client.run(make_spec(rng, i, "P0", send_priority=True, systems=systems))
        if r.ttft_s is not None:
            out.append(r.ttft_s)
    return out


async def capacity(client: LeaseClient, rng: random.Random, systems: dict[str, str], *, concurrency: int,
                   warmup_s: float, measure_s: float) -> float:
    """Closed loop with every slot busy: completions per second of the class mix."""
    done: list[float] = []
    stop = time.monotonic() + warmup_s + measure_s
    counter = iter(range(10**9))

    async def loop() -> None:
        while time.monotonic() < stop:
            prio = rng.choices(CLASSES, weights=[MIX[c] for c in CLASSES])[0]
            spec = make_spec(rng, next(counter), prio, send_priority=False, systems=systems)
            r = await client.run(RequestSpec(**{**spec.__dict__, "retry_shed": False}))
            if r.outcome == "ok":
                done.append(time.monotonic())

    start = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    window = [t for t in done if start + warmup_s <= t <= start + warmup_s + measure_s]
    return len(window) / measure_s


async def run_level(client: LeaseClient, rng: random.Random, systems: dict[str, str], *, rate: float,
                    phase_s: float, send_priority: bool, drain_timeout_s: float,
                    on_arrivals_done: Callable[[], None] | None = None) -> tuple[list[Result], float]:
    tasks: list[asyncio.Task[Result]] = []
    start = time.monotonic()
    t = start
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t - start > phase_s:
            break
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        prio = rng.choices(CLASSES, weights=[MIX[c] for c in CLASSES])[0]
        tasks.append(asyncio.create_task(client.run(make_spec(rng, i, prio, send_priority=send_priority,
                                                              systems=systems))))
        i += 1
    arrivals_done = time.monotonic()
    if on_arrivals_done is not None:
        on_arrivals_done()
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
    for p in pending:
        p.cancel()
    results = []
    for task in done:
        try:
            results.append(task.result())
        except Exception as err:  # noqa: BLE001 - a client bug must not lose the whole run
            results.append(Result(spec=RequestSpec("?", "P2", "?", "", 0, 0), arrival=0, outcome="error",
                                  error=repr(err)))
    results += [Result(spec=RequestSpec("?", "P2", "?", "", 0, 0), arrival=0, outcome="unfinished")
                for _ in pending]
    return results, time.monotonic() - arrivals_done


class SchedulerSampler:
    """Polls the scheduler's /metrics during a load level: what its latency guard and queues did, for the report."""

    GAUGES = ("goodput_scheduler_guard_limit", "goodput_scheduler_p0_ttft_target_seconds",
              "goodput_scheduler_saturation", "goodput_scheduler_p0_ready_workers")

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                try:
                    text = (await http.get(self.url)).text
                    for family in text_string_to_metric_families(text):
                        for sample in family.samples:
                            if sample.name in self.GAUGES:
                                self.samples[sample.name].append(sample.value)
                            elif sample.name == "goodput_scheduler_inflight":
                                self.samples["inflight_per_worker"].append(sample.value)
                except (httpx.HTTPError, ValueError):
                    pass  # a missed sample is not worth failing a run for
                await asyncio.sleep(self.interval_s)

    def __enter__(self) -> SchedulerSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, Any]:
        return {name.removeprefix("goodput_scheduler_"): {"mean": sum(values) / len(values),
                                                          **{f"p{q}": percentile(values, q) for q in (10, 50, 90)},
                                                          "n": len(values)}
                for name, values in self.samples.items()}


def analyse(results: list[Result], *, phase_s: float, slo_ttft: dict[str, float]) -> dict[str, Any]:
    by_class: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_class[r.spec.priority].append(r)
    out: dict[str, Any] = {}
    for c in CLASSES:
        rs = by_class.get(c, [])
        n = len(rs)
        ok = [r for r in rs if r.outcome == "ok"]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        in_slo = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft[c]]
        shed_first = [r for r in rs if r.sheds > 0 or r.outcome == "shed"]
        retry_after = [ra for r in rs for ra in r.retry_after_s]
        out[c] = {
            "n": n,
            "success_rate": len(ok) / n if n else None,
            "shed_rate": len(shed_first) / n if n else None,  # refused at least once (P2: then retried)
            "final_shed_rate": sum(1 for r in rs if r.outcome == "shed") / n if n else None,
            "expired_rate": sum(1 for r in rs if r.outcome == "expired") / n if n else None,
            "error_rate": sum(1 for r in rs if r.outcome in ("error", "unfinished")) / n if n else None,
            "ttft": summarize(ttft),
            "e2e": summarize(e2e),
            "queue_wait": summarize([r.queue_wait_s for r in ok]),
            "goodput_rps": len(in_slo) / phase_s,
            "slo_ttft_s": slo_ttft[c],
            "mean_attempts": sum(r.attempts for r in rs) / n if n else None,
            "retry_after_s": summarize(retry_after) if retry_after else None,
            "tenants": {t: sum(1 for r in ok if r.spec.tenant == t) for t in TENANTS},
            # why requests failed, most frequent first (a report must say what its failures were)
            "errors": Counter((r.error or r.outcome)[:120] for r in rs
                              if r.outcome in ("error", "unfinished", "expired")).most_common(5),
        }
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system_chars = min(480, SHAPES["P0"][0] // 2)
    systems = {t: f"system: you are the {t} assistant. " + random_text(random.Random(t), system_chars) + "\n"
               for t in TENANTS}
    sim = {"time_scale": args.time_scale, "stream_every": 8, "max_batched_tokens": args.max_batched_tokens}
    levels: list[float] = args.levels
    slo = {"P0": args.slo_p0_s, "P1": args.slo_p1_s, "P2": float("inf")}
    report: dict[str, Any] = {
        "machine": machine_info(),
        "setup": {"workers": args.workers, "max_num_seqs": args.max_num_seqs, "sim": sim, "phase_s": args.phase_s,
                  "levels": levels, "mix": MIX, "tenants": TENANTS, "shapes": SHAPES, "deadlines_s": DEADLINES,
                  "slo_ttft_s": {"P0": args.slo_p0_s, "P1": args.slo_p1_s, "P2": "completes"},
                  "seed": args.seed},
        "configs": {},
    }
    worker_env = {}
    if args.engine == "vllm":
        worker_env = {"GOODPUT_INFERENCE_KV_CACHE_SPACE_GB": "1", "GOODPUT_INFERENCE_MAX_MODEL_LEN": "2048"}
        report["setup"]["engine"] = "vllm (CPU build, the dev model SmolLM2-135M-Instruct)"
    with SimFleet(workers=args.workers, base_port=args.base_port, sim=sim, max_num_seqs=args.max_num_seqs,
                  engine=args.engine, worker_env=worker_env, max_model_len=2048 if args.engine == "vllm" else 4096,
                  logdir=args.out.parent / "logs") as fleet:
        fleet.start_scheduler(CONFIGS["fifo"]["env"], name="scheduler-calibrate")
        await fleet.wait_ready(timeout_s=900 if args.engine == "vllm" else 60)
        client = LeaseClient(fleet.scheduler_addr, rng=random.Random(args.seed + 1))
        unloaded = await unloaded_ttft(client, rng, systems, args.unloaded_n)
        cap = await capacity(client, rng, systems, concurrency=int(args.workers * args.max_num_seqs * 1.25),
                             warmup_s=args.warmup_s, measure_s=args.capacity_s)
        await client.close()
        report["unloaded_p0_ttft"] = summarize(unloaded)
        report["capacity_rps"] = cap
        print(f"unloaded P0 TTFT p50 {report['unloaded_p0_ttft']['p50_ms']:.1f} ms, "
              f"p99 {report['unloaded_p0_ttft']['p99_ms']:.1f} ms; capacity {cap:.1f} req/s", flush=True)
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            if args.engine == "sim":  # every scheduler starts on fresh simulated workers (cold, idle engines)
                fleet.restart_workers()
            fleet.start_scheduler(cfg["env"], name=f"scheduler-{name}")
            await fleet.wait_ready()
            client = LeaseClient(fleet.scheduler_addr, rng=random.Random(args.seed + 2))
            per_level = []
            for level in levels:
                with SchedulerSampler(fleet.scheduler_metrics_url) as sampler:
                    results, drain_s = await run_level(client, random.Random(f"{args.seed}-{level}"), systems,
                                                       rate=level * cap, phase_s=args.phase_s,
                                                       send_priority=cfg["send_priority"],
                                                       drain_timeout_s=args.drain_timeout_s,
                                                       on_arrivals_done=sampler.stop)
                stats = analyse(results, phase_s=args.phase_s, slo_ttft=slo)
                t0 = min((r.arrival for r in results if r.arrival), default=0.0)
                p0_trace = sorted((round(r.arrival - t0, 3), round((r.ttft_s or 0) * 1000, 1), r.worker, r.reason)
                                  for r in results if r.spec.priority == "P0" and r.outcome == "ok")
                per_level.append({"load": level, "offered_rps": level * cap, "drain_s": drain_s, "classes": stats,
                                  "scheduler": sampler.summary(), "p0_requests": p0_trace})
                p0 = stats["P0"]
                p1_ok = (stats["P1"]["success_rate"] or 0) * 100
                print(f"[{name}] {level:.2f}x: P0 ttft p99 {p0['ttft']['p99_ms'] or 0:.0f} ms, success "
                      f"{(p0['success_rate'] or 0) * 100:.1f}%; P1 success {p1_ok:.1f}%"
                      f"; P2 completed {(stats['P2']['success_rate'] or 0) * 100:.1f}% (drain {drain_s:.0f} s)",
                      flush=True)
            await client.close()
            report["configs"][name] = per_level
        fleet.stop_scheduler()
    return report


# ---- goals, report and plot (the prose: templates/overload.md) --------------------------------------------------


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """At the top load: P0's p99 TTFT against its unloaded p99 and against FIFO's, P0's success; P2 at every load."""
    top = report["configs"]["goodput"][-1]["load"] if "goodput" in report["configs"] else None

    def p0_p99(r: dict[str, Any], config: str) -> float | None:
        return r["configs"][config][-1]["classes"]["P0"]["ttft"]["p99_ms"]

    return [
        bench.Goal(f"P0 p99 TTFT at {top:g}x ≤ 1.5x unloaded p99", lambda r: (p0_p99(r, "goodput"),
                   r["unloaded_p0_ttft"]["p99_ms"]), 1.5, at_most=True, judged="ratio", digits=0),
        bench.Goal(f"P0 success at {top:g}x ≥ 99.9%", lambda r: (
            r["configs"]["goodput"][-1]["classes"]["P0"]["success_rate"], None), 0.999, unit="%", digits=1),
        bench.Goal("every P2 request eventually completes (all levels)", lambda r: (min(
            (s for lv in r["configs"]["goodput"] if (s := lv["classes"]["P2"]["success_rate"]) is not None),
            default=None), None), 1.0, unit="%", digits=1),
        bench.Goal(f"P0 p99 TTFT ≥ 10x better than FIFO at {top:g}x", lambda r: (p0_p99(r, "goodput"),
                   p0_p99(r, "fifo")), 10.0, judged="speedup", digits=0),
    ] if top is not None else []


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Per scheduler and level P0's placement reasons, most frequent first; whether the scheduler was sampled; the
    failures (scheduler, load, class, reasons)."""
    configs = report["configs"]
    return {"classes": CLASSES,
            "placed": {name: [Counter(r[3] for r in lv.get("p0_requests", [])).most_common() for lv in levels]
                       for name, levels in configs.items()},
            "sampled": any(lv.get("scheduler") for levels in configs.values() for lv in levels),
            "failures": [(name, lv["load"], c, errors) for name, levels in configs.items() for lv in levels
                         for c in CLASSES if (errors := lv["classes"][c].get("errors"))]}


def figure(report: dict[str, Any]) -> bench.Figure:
    unloaded = report["unloaded_p0_ttft"]["p99_ms"]
    series = [bench.Series(name, [lv["load"] for lv in levels],
                           [lv["classes"]["P0"]["ttft"]["p99_ms"] for lv in levels])
              for name, levels in report["configs"].items()]
    return bench.Figure("", [bench.Panel(
        "P0 p99 TTFT under overload (simulated A100 fleet)", "offered load (x measured capacity)",
        "P0 p99 TTFT (ms, log)", series, yscale="log",
        lines=[(unloaded, "unloaded p99", ":", "grey"), (1.5 * unloaded, "goal: 1.5x unloaded", "--", "red")])],
        panel_width=7.0)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-batched-tokens", type=int, default=512,
                    help="the engines' token budget per step (vLLM's max_num_batched_tokens): small chunks keep a "
                         "long prompt's prefill from stalling everyone's next token")
    ap.add_argument("--phase-s", type=float, default=30.0, help="seconds of arrivals per load level")
    ap.add_argument("--configs", default="goodput,fifo,round_robin")
    ap.add_argument("--slo-p0-s", type=float, default=0.5)
    ap.add_argument("--slo-p1-s", type=float, default=5.0)
    ap.add_argument("--unloaded-n", type=int, default=30)
    ap.add_argument("--capacity-s", type=float, default=15.0)
    ap.add_argument("--drain-timeout-s", type=float, default=400.0)


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        global SHAPES
        SHAPES = {c: (chars // 4, max(tokens // 4, 4)) for c, (chars, tokens) in SHAPES.items()}
        args.workers, args.max_num_seqs = 2, args.max_num_seqs if args.max_num_seqs != 32 else 4


def served(report: dict[str, Any], args: argparse.Namespace) -> bool:
    return sum(lv["classes"][c]["n"] * (lv["classes"][c]["success_rate"] or 0)
               for levels in report["configs"].values() for lv in levels for c in CLASSES) > 0


BENCHMARK = bench.Benchmark(
    name="overload", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare, goals=goals,
    context=context, figure=figure, engines=("sim", "vllm"),
    engine_help="vllm: the same scenario at small scale on real vLLM CPU workers (the dev model; prompts and "
                "answers scaled down 4x, 2 workers of 4 sequences)",
    fleet=bench.Fleet(workers=4, max_num_seqs=32, time_scale=4.0, base_port=26100), seed=7,
    levels=bench.Option("0.5,1,2,3", "offered loads, multiples of the capacity measured in the same run"),
    warmup=bench.Option(8.0, "seconds of closed-loop load before the capacity is measured (not counted)",
                        aliases=("--capacity-warmup-s",)),
    quick={"workers": 2, "levels": [1.0, 3.0], "phase_s": 8.0, "unloaded_n": 10, "capacity_s": 6.0, "warmup_s": 4.0},
    quick_help="2 workers, 2 levels, short phases (a smoke run, ~3 min)", ok=served,
    reports=("overload-house3", "overload", "overload-2workers", "overload-vllm"))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
