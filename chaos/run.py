"""The chaos suite: a whole platform on this machine under steady mixed traffic, one fault at a time, and what became
of every request (``python -m chaos``; the short mode also runs in ``make test``: chaos/tests).

The platform: two inference workers, two scheduler replicas electing their leader through Redis, two gateway
replicas, the response cache, the embedder, the retriever, the Celery indexing and jobs workers, and a Redis of its
own (a ``redis-server`` on a free port with an append-only file, started by the platform, so that restarting it
disturbs no other Redis on the machine and brings its data back). Internal gRPC is mutual TLS, as by default.

Modes:

- ``short`` (``make test``): workers on the simulated engine (no model; a token every ~50 ms), 2 s before each fault,
  10 s observed after it, restarts 2 s after a kill: about three minutes on 2 cores.
- ``full``: the same platform on vLLM (the dev model on CPU) with longer windows: 5 s before, 30 s after, restarts
  5 s after a kill (a pod's restart backoff), a freeze past the worker's ``STALL_AFTER_S``.

For each scenario (:mod:`chaos.scenarios`): the platform is checked healthy, traffic runs, the fault is injected,
traffic goes on, the fault is undone (a restart as Kubernetes would do it), and the window closes; then the next.
The report (:mod:`chaos.report`) is written as JSON and Markdown.

Example::

    python -m chaos                                  # short mode, chaos/reports/chaos-short.{json,md}
    python -m chaos --mode full --out chaos/reports/chaos-full
    python -m chaos --scenarios worker-kill,redis-restart
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from goodput_testing import free_port

from chaos.features import Feature, available
from chaos.report import bucket_seconds, good, good_share, latency_bounds, markdown, owner, summarize_window
from chaos.scenarios import SCENARIOS, UNTIL_THE_END, Ctx, Scenario, gateway_ready, workers_view
from chaos.traffic import Keys, Mix, Outcome, Traffic
from goodput_cli.supervisor import Platform, PlatformError
from loadtests.common import machine_info, write_report

__all__ = ["MODES", "Mode", "main", "run_suite"]

PORT_OFFSET = 4600  # no other test or benchmark uses it (tests: 1000, 2300-3900, 4400; loadtests: 300-500, 3000-4260)
TEST_PORT_OFFSET = 4700  # the short mode under pytest: a run by hand may go on beside it
KEY_P0, KEY_P2 = "chaos-key-interactive", "chaos-key-batch"
KB = "chaos-town"
DOCS = [
    {"id": "zorblat", "title": "The Zorblat festival",
     "text": "The Zorblat festival is held every year in the town of Quenby on the first Sunday of May. "
             "Visitors eat blue pancakes and race wooden ducks on the river."},
    {"id": "quenby-trains", "title": "Trains to Quenby",
     "text": "Trains to Quenby leave from Central Station every hour; the journey takes forty minutes."},
    {"id": "faq", "type": "faq",
     "text": "Q: Can I bring a dog to the festival?\nA: Dogs on a leash are welcome.\n"
             "Q: Is there parking?\nA: Parking is at the old mill, two euros a day."},
]


@dataclass(frozen=True)
class Mode:
    name: str
    engine: str  # sim | vllm
    mix: Mix
    warmup_s: float  # traffic before the baseline (the cache fills, connections settle)
    baseline_s: float
    pre_s: float  # traffic before each fault
    observe_s: float  # traffic after each fault
    restart_after_s: float  # a killed process is started again this long after the kill
    freeze_s: float
    redis_down_s: float
    sim_time_scale: float = 4.0  # the simulated engine's pace: 4 x the A100 calibration (~50 ms a token)
    stall_after_s: float = 3.0  # the workers' STALL_AFTER_S (hung engine detection)
    start_timeout_s: float = 300.0

    @property
    def engine_label(self) -> str:
        if self.engine == "sim":
            return (f"workers on the simulated engine (GOODPUT_INFERENCE_ENGINE=sim, time_scale "
                    f"{self.sim_time_scale:g}: no model)")
        return "workers on vLLM (CPU build) serving the dev model SmolLM2-135M-Instruct"


MODES = {
    "short": Mode("short", "sim", Mix(), warmup_s=3, baseline_s=6, pre_s=2, observe_s=10, restart_after_s=2,
                  freeze_s=6, redis_down_s=2),
    # rates a vLLM CPU platform on 2 cores serves without a queue building up (the dev model decodes ~16 tokens/s a
    # stream on one core)
    "full": Mode("full", "vllm", Mix(chat=0.5, cached=0.5, rag=0.2, embed=0.3, batch=0.1, max_tokens=16,
                                     deadline_s=60, job_deadline_s=240, grace_s=10),
                 warmup_s=20, baseline_s=30, pre_s=5, observe_s=30, restart_after_s=5, freeze_s=20, redis_down_s=5,
                 stall_after_s=10, start_timeout_s=900),
}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def _port_lock(port_offset: int) -> Iterator[None]:
    """One suite per port offset on this machine at a time (a second one waits)."""
    with open(Path(tempfile.gettempdir()) / f"goodput-chaos-{port_offset}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def platform_for(mode: Mode, *, workdir: Path, port_offset: int, resume: bool) -> Platform:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing answers there: the platform starts its own Redis
    env = {
        "GOODPUT_REDIS_URL": redis_url,
        "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5",
        "GOODPUT_INFERENCE_STALL_AFTER_S": str(mode.stall_after_s),
        # deferred jobs: a dead worker's claim lapses in seconds, not a minute, and the sweeper looks every second
        "GOODPUT_GATEWAY_JOBS__LEASE_S": "5", "GOODPUT_GATEWAY_JOBS__SWEEP_INTERVAL_S": "1",
        "GOODPUT_GATEWAY_JOBS__LOST_AFTER_S": "15", "GOODPUT_GATEWAY_JOBS__RETRY_BASE_S": "0.5",
        "GOODPUT_GATEWAY_JOBS__RETRY_CAP_S": "5",
        "GOODPUT_GATEWAY_JOBS__DEADLINE_S": str(mode.mix.job_deadline_s - mode.mix.grace_s),
    }
    if mode.engine == "sim":
        env["GOODPUT_INFERENCE_SIM_CONFIG"] = json.dumps({"time_scale": mode.sim_time_scale})
    else:
        env["GOODPUT_INFERENCE_ENFORCE_EAGER"] = "true"
    if resume:
        env["GOODPUT_GATEWAY_RESUME__WINDOW_S"] = "60"
    keys = [{"key_sha256": _sha(KEY_P0), "tenant": "chaos-interactive", "max_priority": "P0",
             "default_priority": "P0"},
            {"key_sha256": _sha(KEY_P2), "tenant": "chaos-batch", "max_priority": "P2", "default_priority": "P2"}]
    return Platform(workdir=workdir, workers=2, port_offset=port_offset, env=env, api_keys=keys, gateways=2,
                    scheduler_replicas=2, engine=mode.engine, redis_persistent=True)


def health(platform: Platform) -> list[str]:
    """What is wrong with the platform now (empty: every child runs, a scheduler leads, every worker is healthy,
    every gateway is ready)."""
    problems = [f"{name} exited ({rc})" for name, rc in platform.exited().items()]
    if platform.leader() is None:
        problems.append("no scheduler replica leads")
    else:
        view = workers_view(platform)
        sick = [f"worker-{i}" for i in range(platform.workers)
                if not (w := view.get(platform.worker_grpc(i))) or not w.healthy]
        if sick:
            problems.append(f"unhealthy as the scheduler sees them: {', '.join(sick)}")
    problems += [f"gateway {i} not ready" for i in range(platform.gateways)
                 if not gateway_ready(platform.gateway_http_at(i))]
    return problems


def wait_healthy(platform: Platform, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (problems := health(platform)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return problems


def _index_kb(platform: Platform) -> dict[str, Any]:
    r = httpx.post(f"{platform.gateway_http}/v1/knowledge-bases/{KB}/documents", json={"documents": DOCS},
                   headers={"Authorization": f"Bearer {KEY_P0}"}, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def _probe_resume(platform: Platform) -> bool:
    """Whether the running gateway numbers a stream's events (SSE ``id:``), i.e. a broken stream can be resumed."""
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "stream": True,
            "temperature": 0.8}
    try:
        with httpx.stream("POST", platform.gateway_http + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY_P0}"}) as r:
            return r.status_code == 200 and any(line.startswith("id:") for line in r.iter_lines())
    except httpx.HTTPError:
        return False


def _scenario_row(scenario: Scenario) -> dict[str, Any]:
    return {"name": scenario.name, "title": scenario.title, "expect_no_loss": scenario.expect_no_loss,
            "why_loss": scenario.why_loss, "needs": scenario.needs}


def _run_scenario(scenario: Scenario, ctx: Ctx, mode: Mode, log: Callable[[str], None]) -> dict[str, Any]:
    platform = ctx.platform
    row = _scenario_row(scenario)
    problems = wait_healthy(platform)
    if problems:
        log(f"  not healthy before {scenario.name}: {'; '.join(problems)}")
        row["health_before"] = "; ".join(problems)
    start = time.monotonic()
    time.sleep(mode.pre_s)
    fault = time.monotonic()
    notes = scenario.inject(ctx)
    log(f"  fault: {scenario.title} ({notes})")
    observe = mode.observe_s + scenario.observe_extra_s
    detected: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and time.monotonic() < fault + observe:
            try:
                if scenario.detect is not None and scenario.detect(ctx, notes):
                    detected.append(time.monotonic() - fault)
                    return
            except Exception:  # noqa: BLE001 - a probe that fails says nothing yet
                pass
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    after = scenario.restore_after_s
    if after is None:
        after = mode.freeze_s if scenario.name == "worker-freeze" else (
            mode.redis_down_s if scenario.name == "redis-restart" else mode.restart_after_s)
    restore_at = min(fault + after, fault + observe)
    time.sleep(max(0.0, restore_at - time.monotonic()))
    restored = time.monotonic()
    error = ""
    try:
        scenario.restore(ctx, notes)
    except (PlatformError, RuntimeError) as err:
        error = str(err)
        log(f"  restore failed: {err}")
    back = time.monotonic()
    time.sleep(max(0.0, fault + observe - time.monotonic()))
    end = time.monotonic()
    done.set()
    watcher.join(2)
    row.update(status="ran", start=start, fault=fault, end=end, notes=notes, fault_at_s=fault - start,
               fault_lasts_window=scenario.restore_after_s == UNTIL_THE_END,
               restored_at_s=restored - fault, back_s=back - fault, observed_s=end - fault,
               detected_s=detected[0] if detected else None)
    if error:
        row["restore_error"] = error[:500]
    log(f"  restored after {restored - fault:.1f} s, serving again after {back - fault:.1f} s"
        + (f", detected after {detected[0]:.1f} s" if detected else ""))
    return row


def run_suite(mode: Mode, *, workdir: Path, port_offset: int = PORT_OFFSET, only: list[str] | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the suite and returns the report (see :mod:`chaos.report`); ``only``: these scenarios, in this order."""
    began = time.monotonic()
    names = only or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios: {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    features: dict[str, Feature] = {n: available(n) for n in {SCENARIOS[s].needs for s in names} if n}
    resume = features.get("stream-resume", available("stream-resume")).present
    platform = platform_for(mode, workdir=workdir, port_offset=port_offset, resume=resume)
    rows: list[dict[str, Any]] = []
    with _port_lock(port_offset):
        log(f"chaos ({mode.name}): starting the platform in {workdir} (port offset {port_offset})")
        platform.start(timeout_s=mode.start_timeout_s)
        start_s = time.monotonic() - began
        log(f"  platform serving after {start_s:.1f} s: {', '.join(platform.names())}")
        try:
            indexed = _index_kb(platform)
            if resume and not _probe_resume(platform):
                resume = False
                features["stream-resume"] = Feature("stream-resume", False,
                                                    "the gateway's streams carry no event ids (SSE id:)")
            traffic = Traffic([platform.gateway_http_at(i) for i in range(platform.gateways)],
                              keys=Keys(p0=KEY_P0, p2=KEY_P2), kb=KB, mix=mode.mix, resume=resume)
            ctx = Ctx(platform=platform, freeze_s=mode.freeze_s, redis_down_s=mode.redis_down_s, traffic=traffic,
                      log=log)
            traffic.start()
            time.sleep(mode.warmup_s)
            base_start = time.monotonic()
            time.sleep(mode.baseline_s)
            base_end = time.monotonic()
            log(f"  baseline: {sum(1 for o in traffic.outcomes if base_start <= o.arrival < base_end)} requests")
            for name in names:
                scenario = SCENARIOS[name]
                feature = features.get(scenario.needs) if scenario.needs else None
                if feature is not None and not feature.present:
                    log(f"- {name}: not available ({feature.why})")
                    rows.append({**_scenario_row(scenario), "status": "not available", "why": feature.why})
                    continue
                log(f"- {name}")
                rows.append(_run_scenario(scenario, ctx, mode, log))
            for row in rows:
                if row["status"] == "ran":
                    row["health_after"] = "; ".join(health(platform))
            drain = max(mode.mix.deadline_s, mode.mix.job_deadline_s) + mode.mix.grace_s
            log(f"  draining the requests in flight (at most {drain:.0f} s)")
            traffic.stop(drain_s=drain)
        finally:
            platform.stop()
    outcomes = list(traffic.outcomes)
    return build_report(mode, outcomes, rows, base_start=base_start, base_end=base_end, features=features,
                        start_s=start_s, runtime_s=time.monotonic() - began, indexed=indexed, platform=platform)


def build_report(mode: Mode, outcomes: list[Outcome], rows: list[dict[str, Any]], *, base_start: float,
                 base_end: float, features: dict[str, Feature], start_s: float, runtime_s: float,
                 indexed: dict[str, Any], platform: Platform) -> dict[str, Any]:
    ran = [row for row in rows if row["status"] == "ran"]
    windows = [(base_start, base_end, None), *((row["start"], row["end"], row["fault"]) for row in ran)]
    owned: list[list[Outcome]] = [[] for _ in windows]
    for o in outcomes:
        if (i := owner(o, windows)) >= 0:
            owned[i].append(o)
    baseline = owned[0]
    bounds = latency_bounds(baseline, default_s=mode.mix.deadline_s)
    baseline_good = good_share(baseline, bounds)
    bucket_s = bucket_seconds(sum(mode.mix.rates().values()))
    base_summary = summarize_window(baseline, start=base_start, end=base_end, fault=None, bounds=bounds,
                                    baseline_good=baseline_good)
    for row, mine in zip(ran, owned[1:], strict=True):
        row["summary"] = summarize_window(mine, start=row["start"], end=row["end"], fault=row["fault"],
                                          bounds=bounds, baseline_good=baseline_good, bucket_s=bucket_s)
    for row in rows:  # relative times only in the report
        for key in ("start", "fault", "end"):
            row.pop(key, None)
    t0 = outcomes[0].arrival if outcomes else 0.0
    rates = mode.mix.rates()
    return {
        "mode": {**asdict(mode), "mix": asdict(mode.mix), "engine_label": mode.engine_label},
        "machine": machine_info(),
        "platform": {"summary": "2 inference workers, 2 scheduler replicas (leader election in Redis), 2 gateways, "
                                "response cache, embedder, retriever, Celery indexing and jobs workers, a Redis of "
                                "its own with an append-only file; internal gRPC over mutual TLS",
                     "start_s": start_s, "children": platform.names() or None, "kb_indexed": indexed},
        "traffic": {"summary": ", ".join(f"{k} {v:g}/s" for k, v in rates.items() if v)
                    + f"; P0 deadline {mode.mix.deadline_s:g} s (lost past {mode.mix.deadline_s + mode.mix.grace_s:g}"
                    f" s), jobs {mode.mix.job_deadline_s:g} s; {mode.mix.max_tokens} tokens an answer; "
                    "requests spread over both gateways, refused connections failed over, nothing sent retried",
                    "rates": rates, "requests": len(outcomes)},
        "features": {n: asdict(f) for n, f in features.items()},
        "latency_bounds_s": {k: round(v, 3) for k, v in bounds.items()},
        "recovery_bucket_s": bucket_s,
        "baseline": {**base_summary, "good_share": round(baseline_good, 3), "window_s": base_end - base_start},
        "scenarios": rows,
        "runtime_s": runtime_s,
        # every request that was not a good answer (failed, lost, or completed late), its arrival from the first
        "outcomes_not_good": [{**o.as_dict(), "arrival": round(o.arrival - t0, 3), "late": o.status == "completed"}
                              for o in outcomes if not good(o, bounds)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="short")
    ap.add_argument("--engine", choices=["sim", "vllm"], help="override the mode's engine")
    ap.add_argument("--scenarios", help="comma-separated names (default: all): " + ", ".join(SCENARIOS))
    ap.add_argument("--out", type=Path, help="report path without suffix (default chaos/reports/chaos-MODE)")
    ap.add_argument("--port-offset", type=int, default=PORT_OFFSET)
    ap.add_argument("--workdir", type=Path, help="the platform's state folder (default: a temporary one)")
    args = ap.parse_args(argv)
    mode = MODES[args.mode]
    if args.engine:
        mode = replace(mode, engine=args.engine)
    only = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else None
    out = args.out or Path("chaos/reports") / f"chaos-{mode.name}"
    with tempfile.TemporaryDirectory(prefix="goodput-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        report = run_suite(mode, workdir=workdir, port_offset=args.port_offset, only=only,
                           log=lambda line: print(line, flush=True))
    json_path, md_path = write_out(out, report)
    print(f"wrote {json_path} and {md_path}")
    lost = [r["name"] for r in report["scenarios"] if r["status"] == "ran" and r["expect_no_loss"]
            and r["summary"]["lost"]]
    if report["baseline"]["lost"]:
        lost.insert(0, "baseline")
    if lost:
        print(f"requests lost in: {', '.join(lost)}", file=sys.stderr)
        return 1
    return 0


def write_out(out: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """``<out>.json`` and ``<out>.md``, with the findings and the time of writing."""
    report["generated_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["findings"] = findings(report)
    return write_report(out, report, markdown(report))


def findings(report: dict[str, Any]) -> list[str]:
    """One line per scenario that lost requests, failed some or did not recover in its window (for the report)."""
    out = []
    for row in report["scenarios"]:
        if row["status"] != "ran":
            continue
        s = row["summary"]
        if s["lost"]:
            reasons = "; ".join(f"{r['count']} {r['kind']} {r['reason']}" for r in s["lost_reasons"])
            out.append(f"{row['name']}: {s['lost']} lost ({reasons})"
                       + (" — expected: " + row["why_loss"] if row["why_loss"] else ""))
        if s["recovery_s"] is None and not row.get("fault_lasts_window"):
            out.append(f"{row['name']}: answers were not back to the baseline by the end of its "
                       f"{row['observed_s']:.0f} s window")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
