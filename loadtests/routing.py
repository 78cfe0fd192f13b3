"""Routing benchmark (issue 19): placement by predicted finish time on a fleet of mixed speeds, and the gateway's
``model: "auto"`` versus always the large model, on simulated workers.

The fleet is real processes on localhost: ``python -m goodput_inference`` with the simulated engine
(``goodput_inference.sim_engine``, each worker its own ``SimParams``) and ``python -m goodput_scheduler``; only the
GPU is simulated. The client does for each request what the gateway does (lease -> stream -> release with the
request's tokens, so the scheduler learns every worker's speed from its finished leases).

**Part A, placement** (``placement``): one model on fast workers (the A100 / 7B calibration) and slow ones (the same
with every step and prefill time x ``--slow``, an older GPU). The same seeded Poisson arrivals (chat and long
requests, one class, ``--load-a`` of the fleet's capacity at full lease caps) go to the scheduler with a counts-only
profile (``least_loaded`` + ``least_prefill``) and with the default profile (which adds ``predicted_finish``: the
worker where the request is predicted to finish first, from its learned speed). Reported: TTFT and end-to-end
p50/p99, output tokens/s, the share of requests each worker type got, and the ratios default / counts-only.

**Part B, auto** (``auto``): two models, ``large`` (A100 / 7B calibration, ``--large-cost`` per worker-hour, an 8192
window) and ``small`` (step and prefill times x ``--small-speed``, ``--small-cost``, a 2048 window). A seeded mix
of P0 chat (short prompts, tight SLO) and P2 batch (long prompts, some beyond the small model's window, loose SLO),
at ``--load-b`` of the large pool's capacity, sent (1) always to ``large`` and (2) as ``auto``, routed by the
gateway's own functions (``goodput_gateway.autoroute.pools_from`` and ``choose`` on a ``ListWorkers`` snapshot
refreshed every 2 s, queue waits observed at each grant into a ``QueueWaits``), as the gateway does. Reported:
cost (engine-seconds at the pools' prices, defined in the report), SLO attainment per class, the share routed to
each model, the ratios auto / large, and the predictor's error on every auto request (actual / predicted TTFT and
TPOT per model).

Both parts warm up first (a few waves of short requests to every worker, the same in every configuration and not
measured), so each worker's speed is learned before the arrivals start, as it would be on a fleet that has been
serving.

    python -m loadtests.routing                  # full run, 4 workers per part, ~10 min on 2 cores
    python -m loadtests.routing --smoke          # 2 workers per part, a few seconds of arrivals (the test)
    python -m loadtests.routing --parts auto     # one part only
    python -m loadtests.routing --render loadtests/reports/routing.json   # the report again (templates/routing.md)

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from goodput.scheduler.v1 import scheduler_pb2

from goodput_gateway.autoroute import QueueWaits, choose, pools_from
from goodput_gateway.requests import estimate_tokens
from loadtests import bench
from loadtests.common import machine_info, percentile, summarize
from loadtests.simfleet import PRIORITY, LeaseClient, RequestSpec, Result, SimFleet, random_text

# The sim engine's A100 / 7B calibration (SimParams' defaults): what a worker's speed factor multiplies.
A100_7B = {"step_base_s": 0.012, "step_per_seq_s": 0.0003, "prefill_s_per_token": 0.00012}
# Part A: (share, prompt tokens, max_tokens) of one class; Part B: per class.
SHAPES_A = (("chat", 0.6, 256, 64), ("long", 0.4, 1024, 256))
SHAPES_B = {"P0": (("chat", 1.0, 256, 64),),
            "P2": (("doc", 0.5, 1024, 256), ("long_doc", 0.5, 2560, 256))}
DEADLINE_S = 600.0
# Simulated seconds (x time_scale on the wall clock): P0 chat tight, P2 batch loose.
SLO_B = {"P0": {"ttft_s": 0.5, "tpot_s": 0.05}, "P2": {"ttft_s": 20.0, "tpot_s": 0.2}}
COUNTS_ONLY = {"scorers": [{"name": "least_loaded", "weight": 1}, {"name": "least_prefill", "weight": 1}]}
# Every configuration: no overload shedding and no queue limits (every request runs; a shed one would measure the
# retry policy, not placement), the lease cap of each worker its own max_num_seqs.
SCHEDULER_ENV = {"SHED_P2_AT": "100", "SHED_P1_AT": "100", "P0_MAX_QUEUE": "0", "P0_TIMEOUT_S": "0",
                 "MAX_INFLIGHT_PER_WORKER": "0"}
LISTWORKERS_EVERY_S = 2.0  # the gateway's MODELS_CACHE_S


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker: what it serves, how fast (1 = A100 / 7B; 2.5 = every step 2.5x longer) and its price."""

    kind: str  # the report's label: fast / slow, large / small
    model: str  # served model name
    speed: float  # step and prefill times x this
    cost_per_hour: float
    max_model_len: int
    max_num_seqs: int


def worker_sim(sim: dict[str, Any], spec: WorkerSpec) -> dict[str, Any]:
    """The worker's ``GOODPUT_INFERENCE_SIM_CONFIG``: the shared settings with its step and prefill times scaled.

    >>> worker_sim({"time_scale": 4}, WorkerSpec("slow", "m", 2.5, 0, 4096, 32))["step_base_s"]
    0.03
    """
    return {**sim, **{k: round(v * spec.speed, 9) for k, v in A100_7B.items()}}


def capacity_rps(spec: WorkerSpec, shapes: Sequence[tuple[str, float, int, int]], *, time_scale: float) -> float:
    """Requests per wall-clock second one worker completes with every lease slot busy (``max_num_seqs`` running),
    from the engine model: each step decodes the batch and prefills the prompts arriving at that rate, so
    ``rate = B / (out x (base + per_seq x B) + prefill_per_token x prompt x B)`` (means over the shapes).

    >>> fast = WorkerSpec("fast", "m", 1.0, 0, 4096, 32)
    >>> round(capacity_rps(fast, (("x", 1.0, 1000, 100),), time_scale=1), 2)
    5.33
    """
    prompt = sum(share * p for _, share, p, _ in shapes)
    out = sum(share * o for _, share, _, o in shapes)
    b = spec.max_num_seqs
    base, per_seq, prefill = (A100_7B[k] * spec.speed for k in ("step_base_s", "step_per_seq_s",
                                                                "prefill_s_per_token"))
    return b / (out * (base + per_seq * b) + prefill * prompt * b) / time_scale


class RoutingFleet(SimFleet):
    """A :class:`SimFleet` whose workers each have their own model, speed, price and window, and an HTTP port
    (``base_port + 40 + i``) for their ``/metrics`` (the engine's busy seconds)."""

    def __init__(self, *, layout: list[WorkerSpec], **kw: Any) -> None:
        super().__init__(workers=len(layout), max_num_seqs=max(w.max_num_seqs for w in layout), **kw)
        self.layout = layout

    def metrics_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.base_port + 40 + i}/metrics"

    def start_workers(self) -> None:
        for i, (addr, spec) in enumerate(zip(self.worker_addrs, self.layout, strict=True)):
            env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_GRPC_PORT": addr.rsplit(":", 1)[1],
                   "GOODPUT_INFERENCE_HTTP_PORT": str(self.base_port + 40 + i),
                   "GOODPUT_INFERENCE_WORKER_ID": f"sim-{spec.kind}-{i}",
                   "GOODPUT_INFERENCE_SCHEDULING_POLICY": "priority", "GOODPUT_INFERENCE_LOG_LEVEL": "WARNING",
                   "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps(worker_sim(self.sim, spec)),
                   "GOODPUT_INFERENCE_SERVED_MODEL_NAME": spec.model,
                   "GOODPUT_INFERENCE_POOL": spec.kind,
                   "GOODPUT_INFERENCE_POOL_COST_PER_HOUR": str(spec.cost_per_hour),
                   "GOODPUT_INFERENCE_MAX_MODEL_LEN": str(spec.max_model_len),
                   "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(spec.max_num_seqs)}
            self.procs.append(self._spawn("goodput_inference", env, f"routing-worker-{i}"))

    async def engine_busy_s(self) -> list[float | None]:
        """Each worker's ``goodput_worker_engine_busy_seconds_total`` (None where it does not say)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: list[float | None] = []
        async with httpx.AsyncClient(timeout=5.0) as client:
            for i in range(self.n):
                try:
                    text = (await client.get(self.metrics_url(i))).text
                except httpx.HTTPError:
                    out.append(None)
                    continue
                found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                         if s.name == "goodput_worker_engine_busy_seconds_total"]
                out.append(sum(found) if found else None)
        return out


# ---- arrivals ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at_s: float
    spec: RequestSpec
    shape: str


def _pick(rng: random.Random, shapes: Sequence[tuple[str, float, int, int]]) -> tuple[str, int, int]:
    x, acc = rng.random(), 0.0
    for name, share, prompt, out in shapes:
        acc += share
        if x < acc:
            return name, prompt, out
    return shapes[-1][0], shapes[-1][2], shapes[-1][3]


def arrivals(seed: int, *, rate: float, phase_s: float, classes: dict[str, float],
             shapes: Mapping[str, Sequence[tuple[str, float, int, int]]], model: str = "",
             out_scale: float = 1.0) -> list[Arrival]:
    """Seeded Poisson arrivals at ``rate``/s for ``phase_s`` s: a class drawn by ``classes`` (class -> share), a
    shape of that class (its max_tokens x ``out_scale``: the smoke run's are shorter), a prompt of random words (no
    shared prefix: prefix affinity plays no part).

    >>> a = arrivals(1, rate=5, phase_s=10, classes={"P0": 0.5, "P2": 0.5}, shapes=SHAPES_B)
    >>> a == arrivals(1, rate=5, phase_s=10, classes={"P0": 0.5, "P2": 0.5}, shapes=SHAPES_B)
    True
    >>> sorted({x.shape for x in a}), {-(-len(x.spec.prompt) // 4) for x in a if x.shape == "chat"}  # tokens
    (['chat', 'doc', 'long_doc'], {256})
    """
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = 0.0
    names = list(classes)
    while True:
        t += rng.expovariate(rate)
        if t > phase_s:
            return out
        prio = rng.choices(names, weights=[classes[c] for c in names])[0]
        shape, prompt_tokens, max_tokens = _pick(rng, shapes[prio])
        max_tokens = max(int(max_tokens * out_scale), 8)
        prompt = random_text(rng, prompt_tokens * 4)
        out.append(Arrival(t, RequestSpec(request_id=f"{prio}-{shape}-{len(out)}", priority=prio, tenant="acme",
                                          prompt=prompt, max_tokens=max_tokens, deadline_s=DEADLINE_S, model=model),
                           shape))


def warmup_plan(layout: list[WorkerSpec], *, waves: Sequence[int]) -> list[list[RequestSpec]]:
    """Waves of concurrent short requests, ``k`` per worker of each model in wave ``k``: every worker finishes
    leases at a few batch sizes, so the scheduler has learned its speed (level and slope) before the arrivals.

    >>> fleet = [WorkerSpec("large", "large", 1, 4, 8192, 32), WorkerSpec("small", "small", .4, .8, 2048, 32)]
    >>> [len(w) for w in warmup_plan(fleet, waves=(1, 3))], warmup_plan(fleet, waves=(1,))[0][1].model
    ([2, 6], 'small')
    """
    rng = random.Random("warmup")
    per_model = Counter(w.model for w in layout)
    plan = []
    for k in waves:
        wave = []
        for model, n in per_model.items():
            for j in range(k * n):
                wave.append(RequestSpec(request_id=f"warmup-{k}-{model}-{j}", priority="P0", tenant="warmup",
                                        prompt=random_text(rng, 512 * 4), max_tokens=48, deadline_s=DEADLINE_S,
                                        model=model))
        plan.append(wave)
    return plan


# ---- the client: the gateway's route for model "auto" --------------------------------------------------------------


class WorkerSnapshot:
    """The gateway's cached ``ListWorkers`` answer, refreshed every :data:`LISTWORKERS_EVERY_S` in the background."""

    def __init__(self, client: LeaseClient) -> None:
        self.client = client
        self.workers: list[scheduler_pb2.WorkerStatus] = []
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> list[scheduler_pb2.WorkerStatus]:
        resp = await self.client.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        self.workers = list(resp.workers)
        return self.workers

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(LISTWORKERS_EVERY_S)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a failed refresh keeps the old list, as the gateway's does
                pass

    async def __aenter__(self) -> WorkerSnapshot:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass
class Route:
    """What ``auto`` chose for one request and what it predicted (wall-clock seconds, from the lease request)."""

    model: str
    pool: str = ""
    reason: str = "fixed"
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    predicted_cost: float | None = None
    predicted_queue_s: float | None = None  # the queue wait the prediction included (QueueWaits' recent mean)
    pending_prefill: int | None = None  # prompt tokens still prefilling on the worker it predicted for (snapshot)


class AutoRouter:
    """``model: "auto"`` exactly as the gateway's pipeline routes it: :func:`pools_from` on the latest snapshot,
    :func:`choose` with the class SLO and the measured queue waits."""

    def __init__(self, snapshot: WorkerSnapshot, waits: QueueWaits, *, slo: dict[str, dict[str, float]],
                 time_scale: float) -> None:
        self.snapshot, self.waits, self.slo, self.time_scale = snapshot, waits, slo, time_scale

    def __call__(self, spec: RequestSpec) -> tuple[RequestSpec, Route]:
        prio = PRIORITY[spec.priority]
        pools = pools_from(self.snapshot.workers, priority=prio)
        choice = choose(pools, prompt_tokens=estimate_tokens(len(spec.prompt)), output_tokens=spec.max_tokens,
                        ttft_slo_s=self.slo[spec.priority]["ttft_s"] * self.time_scale,
                        tpot_slo_s=self.slo[spec.priority]["tpot_s"] * self.time_scale,
                        queue_wait=lambda model: self.waits.get(model, prio))
        if choice is None:  # fits no window: the request is sent as it is and refused (none in this workload)
            return spec, Route(model="", reason="no_candidate")
        # for the report: the parts of the prediction (the queue wait choose() added; the chosen worker's backlog)
        pool = next(p for p in pools if (p.model, p.pool) == (choice.model, choice.pool))
        best = pool.best(estimate_tokens(len(spec.prompt)), spec.max_tokens)
        return replace(spec, model=choice.model), Route(
            model=choice.model, pool=choice.pool, reason=choice.reason, predicted_ttft_s=choice.prediction.ttft_s,
            predicted_tpot_s=choice.prediction.tpot_s, predicted_cost=choice.cost,
            predicted_queue_s=self.waits.get(choice.model, prio),
            pending_prefill=best[1].pending_prefill if best else None)


def fixed(model: str) -> Callable[[RequestSpec], tuple[RequestSpec, Route]]:
    return lambda spec: (replace(spec, model=model), Route(model=model))


async def drive(client: LeaseClient, plan: list[Arrival], route: Callable[[RequestSpec], tuple[RequestSpec, Route]],
                *, drain_timeout_s: float) -> list[tuple[Result, Route, str]]:
    """Routes and sends each request at its time (open loop); waits for all (at most ``drain_timeout_s`` more)."""
    start = time.monotonic()
    tasks: list[asyncio.Task[Result]] = []
    routes: list[tuple[RequestSpec, Route]] = []
    for a in plan:
        delay = start + a.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        spec, r = route(a.spec)
        routes.append((spec, r))
        tasks.append(asyncio.create_task(client.run(spec)))
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (set(), set())
    for p in pending:
        p.cancel()
    out = []
    for task, (spec, r), a in zip(tasks, routes, plan, strict=True):
        if task in done and task.exception() is None:
            res = task.result()
        else:
            res = Result(spec=spec, arrival=0.0, outcome="unfinished",
                         error="" if task not in done else repr(task.exception()))
        out.append((res, r, a.shape))
    return out


async def warm_up(client: LeaseClient, layout: list[WorkerSpec], *, waves: Sequence[int]) -> int:
    served = 0
    for wave in warmup_plan(layout, waves=waves):
        results = await asyncio.gather(*(client.run(s) for s in wave))
        served += sum(r.outcome == "ok" for r in results)
    return served


def _speed(w: scheduler_pb2.WorkerStatus) -> dict[str, Any]:
    return {"prefill_ms_per_token": w.speed.prefill_s_per_token * 1000, "tpot_base_ms": w.speed.tpot_base_s * 1000,
            "tpot_per_seq_ms": w.speed.tpot_per_seq_s * 1000, "samples": w.speed.samples, "lease_cap": w.lease_cap}


async def run_config(name: str, layout: list[WorkerSpec], *, scheduler: dict[str, str], plan: list[Arrival],
                     router: str, args: argparse.Namespace, sim: dict[str, Any], port: int) -> dict[str, Any]:
    """One configuration on a fresh fleet: warm up, the arrivals, the drain. Returns per-request rows and the
    fleet's numbers (engine busy seconds, learned speeds, lease caps)."""
    fleet = RoutingFleet(layout=layout, base_port=port, sim=sim, logdir=Path("loadtests/out/logs"))
    with fleet:
        fleet.start_scheduler({**SCHEDULER_ENV, **scheduler}, name=f"scheduler-{name}")
        await fleet.wait_ready()
        waits = QueueWaits()

        def on_grant(spec: RequestSpec, granted: scheduler_pb2.Granted) -> None:
            waits.observe(spec.model, PRIORITY[spec.priority], granted.queue_wait_s)

        client = LeaseClient(fleet.scheduler_addr, rng=random.Random(args.seed), report_usage=True, on_grant=on_grant)
        started = time.monotonic()
        warm = await warm_up(client, layout, waves=args.warmup_waves)
        kinds = dict(zip(fleet.worker_addrs, (w.kind for w in layout), strict=True))
        labels = {a: f"{k}-{i}" for i, (a, k) in enumerate(kinds.items())}  # one worker each: fast-0, slow-2...
        async with WorkerSnapshot(client) as snapshot:
            learned = {labels.get(w.address, w.address): _speed(w) for w in await snapshot.refresh()}
            busy0 = await fleet.engine_busy_s()
            route = AutoRouter(snapshot, waits, slo=SLO_B, time_scale=sim["time_scale"]) if router == "auto" \
                else fixed(router)
            t0 = time.monotonic()
            rows = await drive(client, plan, route, drain_timeout_s=args.drain_timeout_s)
            wall = time.monotonic() - t0
            busy1 = await fleet.engine_busy_s()
            final = await snapshot.refresh()
        await client.close()
    caps = {kinds.get(w.address, w.address): w.lease_cap for w in final}
    busy: dict[str, float | None] = {}
    for spec, b0, b1 in zip(layout, busy0, busy1, strict=True):
        prev = busy.get(spec.kind, 0.0)
        busy[spec.kind] = None if b0 is None or b1 is None or prev is None else prev + (b1 - b0)
    print(f"[{name}] {sum(r.outcome == 'ok' for r, _, _ in rows)}/{len(rows)} ok, warm-up {warm} ok, "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return {"rows": rows, "kinds": kinds, "busy_s": busy, "lease_caps": caps, "warmup_ok": warm,
            "speed_after_warmup": learned,
            "speed_at_end": {labels.get(w.address, w.address): _speed(w) for w in final}, "wall_s": wall,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}


# ---- analysis ------------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tpot(r: Result) -> float | None:
    if r.ttft_s is None or r.e2e_s is None or r.completion_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


def analyse_placement(rows: list[tuple[Result, Route, str]], kinds: dict[str, str]) -> dict[str, Any]:
    """TTFT / e2e percentiles, output tokens/s (first arrival -> last completion), requests per worker type.

    >>> spec = RequestSpec("r", "P0", "t", "x" * 40, 10, 1)
    >>> rows = [(Result(spec, 1.0, "ok", ttft_s=0.1, e2e_s=1.0, worker="a", completion_tokens=10), Route("m"), "chat"),
    ...         (Result(spec, 2.0, "ok", ttft_s=0.3, e2e_s=3.0, worker="b", completion_tokens=10), Route("m"), "chat")]
    >>> s = analyse_placement(rows, {"a": "fast", "b": "slow"})
    >>> s["output_tokens_per_s"], s["share_by_kind"], s["ttft"]["p50_ms"]
    (5.0, {'fast': 0.5, 'slow': 0.5}, 200.0)
    """
    ok = [r for r, _, _ in rows if r.outcome == "ok"]
    t0 = min((r.arrival for r in ok), default=0.0)
    last = max((r.arrival + (r.e2e_s or 0.0) for r in ok), default=t0)
    tokens = sum(r.completion_tokens for r in ok)
    by_kind = Counter(kinds.get(r.worker, r.worker) for r in ok)
    per_kind = {k: {"n": by_kind[k],
                    "ttft": summarize([r.ttft_s for r in ok if kinds.get(r.worker) == k and r.ttft_s is not None]),
                    "e2e": summarize([r.e2e_s for r in ok if kinds.get(r.worker) == k and r.e2e_s is not None])}
                for k in sorted(set(kinds.values()))}
    per_shape = {s: {"ttft": summarize([r.ttft_s for r, _, sh in rows if sh == s and r.outcome == "ok"
                                        and r.ttft_s is not None]),
                     "e2e": summarize([r.e2e_s for r, _, sh in rows if sh == s and r.outcome == "ok"
                                       and r.e2e_s is not None])}
                 for s in sorted({sh for _, _, sh in rows})}
    return {
        "n": len(rows), "ok": len(ok), "success_rate": len(ok) / len(rows) if rows else None,
        "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "queue_wait": summarize([r.queue_wait_s for r in ok]),
        "output_tokens": tokens, "makespan_s": last - t0,
        "output_tokens_per_s": tokens / (last - t0) if last > t0 else None,
        "share_by_kind": {k: by_kind[k] / len(ok) for k in sorted(set(kinds.values()))} if ok else {},
        "per_kind": per_kind, "per_shape": per_shape,
        "errors": Counter((r.error or r.outcome)[:120] for r, _, _ in rows if r.outcome != "ok").most_common(5),
        # per request, for the plot: TTFT ms, e2e ms, worker type
        "requests": [[round((r.ttft_s or 0) * 1000, 1), round((r.e2e_s or 0) * 1000, 1), kinds.get(r.worker, "")]
                     for r in ok],
    }


def analyse_auto(rows: list[tuple[Result, Route, str]], *, layout: list[WorkerSpec], lease_caps: dict[str, int],
                 busy_s: dict[str, float | None], slo: dict[str, dict[str, float]],
                 time_scale: float) -> dict[str, Any]:
    """Cost, SLO attainment per class, share per model, and (for auto) the predictor's error.

    Cost of a request = (last token - grant) / time_scale (simulated engine-seconds) x its pool's cost_per_hour /
    3600 / its lease cap; busy cost = each pool's engine-busy seconds / time_scale x its price / 3600.

    >>> fleet = [WorkerSpec("large", "large", 1, 3.6, 8192, 10)]
    >>> spec = RequestSpec("r", "P0", "t", "x" * 40, 11, 1, model="large")
    >>> r = Result(spec, 0.0, "ok", ttft_s=0.2, e2e_s=1.2, granted_s=0.1, completion_tokens=11, worker="w")
    >>> s = analyse_auto([(r, Route("large", predicted_ttft_s=0.1, predicted_tpot_s=0.1), "chat")], layout=fleet,
    ...                  lease_caps={"large": 10}, busy_s={"large": 2.0}, slo={"P0": {"ttft_s": 0.5, "tpot_s": 0.2}},
    ...                  time_scale=1.0)
    >>> round(s["cost"]["batch_share"], 6), s["cost"]["busy"], s["classes"]["P0"]["slo_attainment"]
    (0.00011, 0.002, 1.0)
    >>> s["prediction"]["large"]["ttft"]["bias"], s["prediction"]["large"]["tpot"]["median_abs_error"]
    (2.0, 0.0)
    """
    price = {w.model: w.cost_per_hour for w in layout}
    kind_of = {w.model: w.kind for w in layout}
    ok = [(r, rt, sh) for r, rt, sh in rows if r.outcome == "ok"]
    engine_s = dict.fromkeys(price, 0.0)
    cost_share = 0.0
    for r, _, _ in ok:
        model = r.spec.model
        service = max((r.e2e_s or 0.0) - (r.granted_s or 0.0), 0.0) / time_scale
        engine_s[model] += service
        cost_share += service * price[model] / 3600 / max(lease_caps.get(kind_of[model], 1), 1)
    busy_cost = None
    if all(v is not None for v in busy_s.values()):
        busy_cost = sum((busy_s[kind_of[m]] or 0.0) / time_scale * price[m] / 3600 for m in price)
    classes: dict[str, Any] = {}
    for c in sorted({r.spec.priority for r, _, _ in rows}):
        rs = [r for r, _, _ in rows if r.spec.priority == c]
        good = [r for r in rs if r.outcome == "ok"]
        ttft_ok = [r for r in good if r.ttft_s is not None and r.ttft_s <= slo[c]["ttft_s"] * time_scale]
        tpot_ok = [r for r in good if (t := _tpot(r)) is not None and t <= slo[c]["tpot_s"] * time_scale]
        both = [r for r in ttft_ok if r in tpot_ok]
        classes[c] = {
            "n": len(rs), "ok": len(good), "slo": slo[c],
            "slo_attainment": len(both) / len(rs) if rs else None,
            "ttft_within": len(ttft_ok) / len(rs) if rs else None,
            "tpot_within": len(tpot_ok) / len(rs) if rs else None,
            "ttft": summarize([r.ttft_s for r in good if r.ttft_s is not None]),
            "tpot": summarize([t for r in good if (t := _tpot(r)) is not None]),
            "by_model": dict(Counter(r.spec.model for r in rs)),
        }
    by_model = Counter(r.spec.model for r, _, _ in rows)
    prediction: dict[str, Any] = {}
    for model in sorted({rt.model for _, rt, _ in ok if rt.predicted_ttft_s is not None}):
        picked = [(r, rt) for r, rt, _ in ok if rt.model == model and rt.predicted_ttft_s]
        prediction[model] = {
            "n": len(picked),
            "ttft": _errors([(r.ttft_s, rt.predicted_ttft_s) for r, rt in picked]),
            "tpot": _errors([(_tpot(r), rt.predicted_tpot_s) for r, rt in picked]),
            # the TTFT's two parts: the wait for a grant, and grant -> first token (the worker's speed and backlog)
            "queue_wait": {"predicted": summarize([rt.predicted_queue_s or 0.0 for _, rt in picked]),
                           "actual": summarize([r.queue_wait_s for r, _ in picked])},
            "ttft_from_grant": _errors([(None if r.ttft_s is None or r.granted_s is None else r.ttft_s - r.granted_s,
                                         (rt.predicted_ttft_s or 0.0) - (rt.predicted_queue_s or 0.0))
                                        for r, rt in picked]),
            "pending_prefill_tokens": {f"p{q}": percentile([float(rt.pending_prefill or 0) for _, rt in picked], q)
                                       for q in (50, 90)},
        }
    return {
        "n": len(rows), "ok": len(ok),
        "cost": {"batch_share": cost_share, "busy": busy_cost,
                 "batch_share_per_request": cost_share / len(ok) if ok else None},
        "engine_s": {m: engine_s[m] for m in sorted(price)},
        "busy_engine_s": {kind_of[m]: None if (b := busy_s.get(kind_of[m])) is None else b / time_scale
                          for m in sorted(price)},
        "share_by_model": {m: by_model[m] / len(rows) for m in sorted(price)} if rows else {},
        "by_shape": {sh: dict(Counter(r.spec.model for r, _, s in rows if s == sh))
                     for sh in sorted({s for *_, s in rows})},
        "routes": dict(Counter(rt.reason for _, rt, _ in rows)),
        "classes": classes,
        "prediction": prediction,
        "errors": Counter((r.error or r.outcome)[:120] for r, _, _ in rows if r.outcome != "ok").most_common(5),
        # per auto request, for the plot: class, model, predicted / actual TTFT (ms)
        "requests": [[r.spec.priority, rt.model, round(rt.predicted_ttft_s * 1000, 1), round(r.ttft_s * 1000, 1)]
                     for r, rt, _ in ok if rt.predicted_ttft_s is not None and r.ttft_s is not None],
    }


def _errors(pairs: list[tuple[float | None, float | None]]) -> dict[str, Any]:
    """actual / predicted: the median and p90 of |ratio - 1|, and the bias (the median ratio).

    >>> _errors([(1.0, 1.0), (2.0, 1.0), (0.5, 1.0)])
    {'n': 3, 'median_abs_error': 0.5, 'p90_abs_error': 0.9, 'bias': 1.0}
    """
    ratios = [a / p for a, p in pairs if a is not None and p]
    errs = [abs(x - 1) for x in ratios]
    return {"n": len(ratios), "median_abs_error": percentile(errs, 50), "p90_abs_error": percentile(errs, 90),
            "bias": percentile(ratios, 50)}


# ---- the benchmark -------------------------------------------------------------------------------------------------


def layouts(args: argparse.Namespace) -> dict[str, list[WorkerSpec]]:
    """Part A's fleet (one model, fast and slow workers) and part B's (large and small models).

    >>> ns = bench.parse(BENCHMARK, ["--smoke"])
    >>> [(w.kind, w.speed) for w in layouts(ns)["placement"]], [w.model for w in layouts(ns)["auto"]]
    ([('fast', 1.0), ('slow', 2.5)], ['large', 'small'])
    """
    return {
        "placement": [WorkerSpec("fast", "sim-7b", 1.0, args.large_cost, 8192, args.seqs)] * args.fast
        + [WorkerSpec("slow", "sim-7b", args.slow, args.large_cost, 8192, args.seqs)] * args.slow_workers,
        "auto": [WorkerSpec("large", "large", 1.0, args.large_cost, 8192, args.seqs)] * args.large
        + [WorkerSpec("small", "small", args.small_speed, args.small_cost, args.small_len, args.seqs)] * args.small,
    }


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sim = {"time_scale": args.time_scale, "stream_every": 8, "max_batched_tokens": args.max_batched_tokens}
    fleets = layouts(args)
    report: dict[str, Any] = {
        "machine": machine_info(), "smoke": args.quick,
        "setup": {"sim": sim, "seed": args.seed, "phase_s": args.phase_s, "warmup_waves": list(args.warmup_waves),
                  "out_scale": args.out_scale,
                  "scheduler": SCHEDULER_ENV, "a100_7b": A100_7B},
    }
    if "placement" in args.parts:
        layout = fleets["placement"]
        capacity = sum(capacity_rps(w, SHAPES_A, time_scale=args.time_scale) for w in layout)
        rate = args.load_a * capacity
        plan = arrivals(args.seed, rate=rate, phase_s=args.phase_s, classes={"P0": 1.0}, shapes={"P0": SHAPES_A},
                        model="sim-7b", out_scale=args.out_scale)
        part: dict[str, Any] = {
            "setup": {"fleet": [asdict(w) for w in layout], "shapes": SHAPES_A, "capacity_rps": capacity,
                      "load": args.load_a, "rate_rps": rate, "requests": len(plan),
                      "profiles": {"counts_only": COUNTS_ONLY, "default": "the scheduler's default profile"}},
            "configs": {}}
        for name, profile in (("counts_only", COUNTS_ONLY), ("default", None)):
            env = {"PROFILE": json.dumps(profile)} if profile else {}
            run = await run_config(name, layout, scheduler=env, plan=plan, router="sim-7b", args=args, sim=sim,
                                   port=args.base_port)
            stats = analyse_placement(run["rows"], run["kinds"])
            stats.update({k: run[k] for k in ("speed_after_warmup", "speed_at_end", "warmup_ok", "wall_s",
                                              "loadavg_end")})
            part["configs"][name] = stats
            print(f"  TTFT p50 {stats['ttft']['p50_ms'] or 0:.0f} p99 {stats['ttft']['p99_ms'] or 0:.0f} ms, e2e p50 "
                  f"{stats['e2e']['p50_ms'] or 0:.0f} p99 {stats['e2e']['p99_ms'] or 0:.0f} ms, share "
                  f"{stats['share_by_kind']}", flush=True)
        part["comparison"] = compare_placement(part)
        report["placement"] = part
        print("placement, default / counts-only: " + ", ".join(f"{k.removesuffix('_ratio')} {v:.2f}x"
                                                                 for k, v in part["comparison"].items()
                                                                 if k.endswith("ratio") and v is not None), flush=True)
    if "auto" in args.parts:
        layout = fleets["auto"]
        large = [w for w in layout if w.model == "large"]
        mix = [s for c in SHAPES_B for s in _weighted(c, args.p0_share)]
        capacity = sum(capacity_rps(w, mix, time_scale=args.time_scale) for w in large)
        rate = args.load_b * capacity
        plan = arrivals(args.seed + 1, rate=rate, phase_s=args.phase_s,
                        classes={"P0": args.p0_share, "P2": 1 - args.p0_share}, shapes=SHAPES_B,
                        out_scale=args.out_scale)
        part = {"setup": {"fleet": [asdict(w) for w in layout], "shapes": SHAPES_B, "slo_sim_s": SLO_B,
                          "large_capacity_rps": capacity, "load": args.load_b, "rate_rps": rate,
                          "p0_share": args.p0_share, "requests": len(plan),
                          "requests_by_class": dict(Counter(a.spec.priority for a in plan)),
                          "beyond_small_window": sum(len(a.spec.prompt) // 4 + a.spec.max_tokens > args.small_len
                                                     for a in plan)},
                "configs": {}}
        for name in ("large", "auto"):
            run = await run_config(name, layout, scheduler={}, plan=plan, router=name, args=args, sim=sim,
                                   port=args.base_port)
            stats = analyse_auto(run["rows"], layout=layout, lease_caps=run["lease_caps"], busy_s=run["busy_s"],
                                 slo=SLO_B, time_scale=args.time_scale)
            stats.update({k: run[k] for k in ("speed_after_warmup", "speed_at_end", "warmup_ok", "wall_s",
                                              "lease_caps", "loadavg_end")})
            part["configs"][name] = stats
            print(f"  cost {stats['cost']['batch_share']:.4f} (busy {stats['cost']['busy'] or 0:.4f}), SLO "
                  + ", ".join(f"{c} {v['slo_attainment'] or 0:.0%}" for c, v in stats["classes"].items())
                  + f", share {stats['share_by_model']}", flush=True)
        part["comparison"] = compare_auto(part)
        report["auto"] = part
        print("auto / large: " + ", ".join(f"{k.removesuffix('_ratio')} {v:.2f}x" for k, v in part["comparison"].items()
                                           if k.endswith("ratio") and v is not None), flush=True)
    return report


def _weighted(prio: str, p0_share: float) -> list[tuple[str, float, int, int]]:
    share = p0_share if prio == "P0" else 1 - p0_share
    return [(n, s * share, p, o) for n, s, p, o in SHAPES_B[prio]]


def compare_placement(part: dict[str, Any]) -> dict[str, Any]:
    """Ratios default / counts-only (below 1 is better for latencies, above 1 for tokens/s)."""
    c, d = part["configs"]["counts_only"], part["configs"]["default"]
    out = {f"{m}_{q}_ratio": _ratio(d[m][f"{q}_ms"], c[m][f"{q}_ms"]) for m in ("ttft", "e2e") for q in ("p50", "p99")}
    out["tokens_per_s_ratio"] = _ratio(d["output_tokens_per_s"], c["output_tokens_per_s"])
    out["all_completed"] = all(x["success_rate"] == 1.0 for x in (c, d))
    return out


def compare_auto(part: dict[str, Any]) -> dict[str, Any]:
    """Ratios auto / large: cost (both definitions) and SLO attainment per class."""
    a, big = part["configs"]["auto"], part["configs"]["large"]
    out: dict[str, Any] = {"cost_batch_share_ratio": _ratio(a["cost"]["batch_share"], big["cost"]["batch_share"]),
                           "cost_busy_ratio": _ratio(a["cost"]["busy"], big["cost"]["busy"])}
    for c in big["classes"]:
        out[f"{c}_slo_attainment_ratio"] = _ratio(a["classes"][c]["slo_attainment"],
                                                  big["classes"][c]["slo_attainment"])
    out["all_completed"] = all(x["ok"] == x["n"] for x in (a, big))
    return out


# ---- goals, report and plot (the prose: templates/routing.md) ----------------------------------------------------


def _versus(part: str, config: str, baseline: str, *keys: str) -> Any:
    """A value of ``config`` in ``part`` and the same value of ``baseline`` in the same run (``keys`` its path)."""
    def measure(report: dict[str, Any]) -> tuple[float | None, float | None]:
        def at(c: dict[str, Any]) -> Any:
            for k in keys:
                c = c[k]
            return c
        configs = report[part]["configs"]
        return at(configs[config]), at(configs[baseline])
    return measure


GOALS = [  # issue 19's goals: no worse than the baseline of the same run (a ratio of 1)
    bench.Goal("A: e2e p99 with predicted_finish ≤ counts only", _versus("placement", "default", "counts_only",
               "e2e", "p99_ms"), 1.0, at_most=True, judged="ratio", digits=0),
    bench.Goal("A: TTFT p99 with predicted_finish ≤ counts only", _versus("placement", "default", "counts_only",
               "ttft", "p99_ms"), 1.0, at_most=True, judged="ratio", digits=0),
    bench.Goal("B: auto's batch-share cost ≤ always large", _versus("auto", "auto", "large", "cost", "batch_share"),
               1.0, at_most=True, judged="ratio", unit="", digits=4),
    *[bench.Goal(f"B: auto's {c} SLO attainment ≥ always large", _versus("auto", "auto", "large", "classes", c,
                 "slo_attainment"), 1.0, judged="ratio", unit="%", digits=1) for c in SLO_B],
]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Each part's fleet grouped (count, worker), its engine's configured speeds (wall-clock ms) and the load average
    at the end of each configuration."""
    ts = report["setup"]["sim"]["time_scale"]
    a100 = report["setup"].get("a100_7b", A100_7B)
    parts = {p: report[p] for p in ("placement", "auto") if p in report}
    return {
        "ts": ts, "parts": parts,
        "loads": [(name, c["loadavg_end"][0]) for part in parts.values() for name, c in part["configs"].items()
                  if c.get("loadavg_end")],
        "fleets": {p: [(n, dict(w)) for w, n in Counter(tuple(w.items()) for w in part["setup"]["fleet"]).items()]
                   for p, part in parts.items()},
        "engine": {p: [(kind, *(a100[k] * speed * ts * 1000 for k in ("prefill_s_per_token", "step_base_s",
                                                                       "step_per_seq_s")))
                       for kind, speed in sorted({(w["kind"], w["speed"]) for w in part["setup"]["fleet"]})]
                   for p, part in parts.items()},
    }


QUANTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 100)


def figure(report: dict[str, Any]) -> bench.Figure | None:
    """Part A's TTFT and e2e by percentile; part B's cost and SLO attainment, and auto's actual / predicted TTFT."""
    panels = []
    if "placement" in report:
        for col, title in ((0, "TTFT"), (1, "end-to-end")):
            series = [bench.Series(name, list(range(len(QUANTILES))),
                                   [percentile([r[col] for r in c["requests"]], q) for q in QUANTILES])
                      for name, c in report["placement"]["configs"].items()]
            panels.append(bench.Panel(f"A: {title} by percentile, fast+slow fleet", "percentile",
                                      f"{title} (ms, wall-clock, log)", series, xticks=[f"p{q}" for q in QUANTILES],
                                      yscale="log"))
    if "auto" in report:
        configs = report["auto"]["configs"]
        names, top = list(configs), max(c["cost"]["batch_share"] for c in configs.values()) or 1.0
        xs = list(range(len(names)))
        panels.append(bench.Panel("B: cost and SLO attainment", "", "share (cost: of the highest)", [
            bench.Series("batch-share cost (rel.)", xs, [configs[n]["cost"]["batch_share"] / top for n in names]),
            *[bench.Series(f"{c} SLO met", xs, [configs[n]["classes"].get(c, {}).get("slo_attainment")
                                                for n in names], style="--") for c in SLO_B]], xticks=names))
        rows = [r for r in configs.get("auto", {}).get("requests", []) if r[2]]
        panels.append(bench.Panel("B: auto's TTFT, actual / predicted", "predicted TTFT (ms)",
                                  "actual / predicted (log)", [
            bench.Series(model, [r[2] for r in pts], [r[3] / r[2] for r in pts], style=" ")
            for model in sorted({r[1] for r in rows}) for pts in [sorted((r for r in rows if r[1] == model),
                                                                         key=lambda r: r[2])]],
            lines=[(1.0, "as predicted", "-", "grey")], yscale="log"))
    return bench.Figure(f"Routing on the simulated fleet (time x{report['setup']['sim']['time_scale']:g})", panels,
                        panel_width=5.0) if panels else None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default="placement,auto", help="comma-separated: placement, auto")
    ap.add_argument("--fast", type=int, default=2, help="part A: fast (A100 / 7B) workers")
    ap.add_argument("--slow-workers", type=int, default=2, help="part A: slow workers")
    ap.add_argument("--slow", type=float, default=2.5, help="part A: the slow workers' step and prefill times x this")
    ap.add_argument("--load-a", type=float, default=0.8, help="part A: arrivals as a share of the fleet's capacity")
    ap.add_argument("--large", type=int, default=2, help="part B: workers of the large model")
    ap.add_argument("--small", type=int, default=2, help="part B: workers of the small model")
    ap.add_argument("--small-speed", type=float, default=0.4, help="part B: the small model's times x this")
    ap.add_argument("--large-cost", type=float, default=4.0, help="cost per hour of a large (A100) worker")
    ap.add_argument("--small-cost", type=float, default=0.8, help="cost per hour of a small worker")
    ap.add_argument("--small-len", type=int, default=2048, help="the small model's context window")
    ap.add_argument("--p0-share", type=float, default=0.6, help="part B: share of the arrivals that are P0 chat")
    ap.add_argument("--load-b", type=float, default=0.75,
                    help="part B: arrivals as a share of the large pool's capacity")
    ap.add_argument("--seqs", type=int, default=32, help="every worker's max_num_seqs (its lease cap)")
    ap.add_argument("--phase-s", type=float, default=90.0, help="seconds of arrivals per configuration")
    ap.add_argument("--time-scale", type=float, default=4.0, help="simulated time multiplier")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="the engines' token budget per step")
    ap.add_argument("--warmup-waves", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 4, 8),
                    help="warm-up waves: concurrent requests per worker in each")
    ap.add_argument("--drain-timeout-s", type=float, default=240.0)
    # below the kernel's ephemeral range (from 32768) and the range free_port() draws from (20000 up), so no
    # outgoing connection or test server takes one (scheduler +0 and +90, workers +1.., their metrics +40..)
    ap.add_argument("--base-port", type=int, default=19800)


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if set(args.parts) - {"placement", "auto"}:
        ap.error("--parts takes placement and/or auto")
    args.out_scale = 0.25 if args.quick else 1.0  # the smoke run's max_tokens / 4: the drain stays short


def served(report: dict[str, Any], args: argparse.Namespace) -> bool:
    return sum(c["ok"] for part in ("placement", "auto") for c in report.get(part, {}).get("configs", {}).values()) > 0


BENCHMARK = bench.Benchmark(
    name="routing", doc=__doc__ or "", run=benchmark, arguments=add_arguments, prepare=prepare, goals=GOALS,
    context=context, figure=figure, seed=19, ok=served,
    quick={"fast": 1, "slow_workers": 1, "large": 1, "small": 1, "phase_s": 3.0, "time_scale": 1.0,
           "warmup_waves": (1, 3), "drain_timeout_s": 40.0},
    quick_help="1 worker of each kind, 3 s of arrivals, max_tokens / 4 (the test)", reports=("routing",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
