"""The faults, one at a time: how each is injected, how the platform is seen to notice it, and how it is undone.

A scenario's ``inject`` returns notes (which process, which pid); ``detect`` (polled from the fault on) says when the
platform has noticed the fault by itself (a new leader, the worker ejected); ``restore`` undoes it the way a cluster
would (Kubernetes restarts a killed container; a frozen process is let go) and returns once the component serves
again. ``expect_no_loss``: the suite asserts that no request is lost in it.

Example::

    scenario = SCENARIOS["scheduler-leader-kill"]
    notes = scenario.inject(ctx)      # kill -9 the leading scheduler replica
    ...
    scenario.restore(ctx, notes)      # start it again (it comes back as the standby)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_cli.supervisor import Platform

__all__ = ["SCENARIOS", "Ctx", "Scenario", "workers_view"]

Notes = dict[str, Any]
UNTIL_THE_END = 1e9  # restore_after_s: undone when the scenario's window ends


@dataclass
class Ctx:
    """What a scenario works with: the platform and the mode's timings."""

    platform: Platform
    freeze_s: float = 6.0  # how long a frozen worker stays frozen
    redis_down_s: float = 2.0  # how long Redis stays down between its stop and its start
    traffic: Any = None  # chaos.traffic.Traffic (the client-side scenarios switch its behaviour)
    log: Callable[[str], None] = print


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str  # what is done, in the report's words
    inject: Callable[[Ctx], Notes]
    restore: Callable[[Ctx, Notes], None]
    detect: Callable[[Ctx, Notes], bool] | None = None
    restore_after_s: float | None = None  # None: the mode's (a restart's delay); the freeze uses ctx.freeze_s
    expect_no_loss: bool = True
    needs: str = ""  # a feature (chaos.features) without which the scenario is "not available"
    why_loss: str = ""  # expect_no_loss False: why losses are expected
    observe_extra_s: float = 0.0  # observed longer than the mode's window (a freeze lasts longer than a restart)
    tags: tuple[str, ...] = field(default_factory=tuple)


# --- what the scheduler sees ----------------------------------------------------------------------------------------
def workers_view(platform: Platform) -> dict[str, scheduler_pb2.WorkerStatus]:
    """The workers as the leading scheduler lists them, by address (empty while no replica leads)."""
    leader = platform.leader()
    if leader is None:
        return {}
    try:
        with platform.internal_channel(platform.scheduler_grpc_at(leader)) as ch:
            reply = scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
    except grpc.RpcError:
        return {}
    return {w.address: w for w in reply.workers}


def _busiest_worker(ctx: Ctx, wait_s: float = 5.0) -> tuple[int, int]:
    """The worker with the most leases in flight (waiting a little for one to have any), and how many."""
    deadline = time.monotonic() + wait_s
    best = (0, 0)
    while True:
        view = workers_view(ctx.platform)
        for i in range(ctx.platform.workers):
            w = view.get(ctx.platform.worker_grpc(i))
            if w is not None and w.inflight > best[1]:
                best = (i, int(w.inflight))
        if best[1] > 0 or time.monotonic() > deadline:
            return best
        time.sleep(0.1)


def _worker_unhealthy(ctx: Ctx, notes: Notes) -> bool:
    w = workers_view(ctx.platform).get(ctx.platform.worker_grpc(notes["worker"]))
    return w is not None and not w.healthy


# --- kill -9 and restart ----------------------------------------------------------------------------------------------
def _kill(name: str) -> Callable[[Ctx], Notes]:
    def inject(ctx: Ctx) -> Notes:
        pid = ctx.platform.pid(name)
        ctx.platform.kill(name)
        return {"process": name, "pid": pid}
    return inject


def _kill_jobs_worker(ctx: Ctx, wait_s: float = 5.0) -> Notes:
    """kill -9 the jobs worker while it runs a job (waiting a little for the client to see one running)."""
    deadline = time.monotonic() + wait_s
    running: list[Any] = []
    while time.monotonic() < deadline:
        running = [o for o in list(ctx.traffic.outcomes) if o.kind == "batch" and o.status == "pending"
                   and o.job_state == "running"]
        if running:
            break
        time.sleep(0.05)
    notes = _kill("jobs-worker")(ctx)
    notes["jobs_running"] = len(running)
    return notes


def _restart(ctx: Ctx, notes: Notes) -> None:
    ctx.platform.restart(notes["process"], timeout_s=120)


def _kill_worker(ctx: Ctx) -> Notes:
    i, inflight = _busiest_worker(ctx)
    name = f"worker-{i}"
    pid = ctx.platform.pid(name)
    ctx.platform.kill(name)
    return {"process": name, "pid": pid, "worker": i, "leases_in_flight": inflight}


def _kill_leader(ctx: Ctx) -> Notes:
    leader = ctx.platform.leader()
    if leader is None:
        raise RuntimeError("no scheduler replica leads: nothing to kill")
    name = ctx.platform.scheduler_name(leader)
    pid = ctx.platform.pid(name)
    ctx.platform.kill(name)
    return {"process": name, "pid": pid, "replica": leader}


def _new_leader(ctx: Ctx, notes: Notes) -> bool:
    """A replica leads again: the standby, or the killed one when its restart won the lock first (either way a new
    process: the killed one is gone)."""
    return ctx.platform.leader() is not None


def _gateway_down(ctx: Ctx, notes: Notes) -> bool:
    return True  # nothing notices a gateway's death but its clients (there is no load balancer here)


# --- Redis: stopped as a pod is stopped, started again ---------------------------------------------------------------
def _stop_redis(ctx: Ctx) -> Notes:
    pid = ctx.platform.pid("redis")
    ctx.platform.terminate("redis", grace_s=10)  # SIGTERM: Redis writes its append-only file and exits
    return {"process": "redis", "pid": pid, "persistent": ctx.platform.redis_persistent}


def _start_redis(ctx: Ctx, notes: Notes) -> None:
    ctx.platform.restart("redis", timeout_s=30)


# --- a frozen worker ------------------------------------------------------------------------------------------------
def _freeze_worker(ctx: Ctx) -> Notes:
    """SIGSTOP the busiest worker's engine: vLLM's engine core process when the worker has one (the worker's gRPC
    server goes on answering, as with a hung GPU), else the whole worker (the simulated engine runs inside it)."""
    i, inflight = _busiest_worker(ctx)
    name = f"worker-{i}"
    below = ctx.platform.descendants(name)
    engines = [pid for pid, cmd in below if "EngineCore" in cmd or "engine_core" in cmd]
    if not engines:  # an engine process without its title: the worker's spawned child (not the resource tracker)
        engines = [pid for pid, cmd in below if "multiprocessing" in cmd and "resource_tracker" not in cmd][:1]
    if engines:
        ctx.platform.freeze(name, pids=engines)
        target = "engine core process"
    else:
        engines = ctx.platform.freeze(name)
        target = "whole worker process (its engine runs in it)"
    return {"process": name, "worker": i, "pids": engines, "target": target, "leases_in_flight": inflight}


def _thaw_worker(ctx: Ctx, notes: Notes) -> None:
    ctx.platform.thaw(notes["process"], pids=notes["pids"])
    # a worker whose engine ran in the frozen process answers again; let the scheduler see it
    deadline = time.monotonic() + 30
    while _worker_unhealthy(ctx, notes) and time.monotonic() < deadline:
        time.sleep(0.1)


# --- the client's own connection ------------------------------------------------------------------------------------
def _start_drops(ctx: Ctx) -> Notes:
    ctx.traffic.drop_every = 2
    return {"drop_every": 2}


def _stop_drops(ctx: Ctx, notes: Notes) -> None:
    ctx.traffic.drop_every = 0


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("worker-kill", "kill -9 the busiest inference worker mid-stream, restart it", _kill_worker, _restart,
             detect=_worker_unhealthy),
    Scenario("scheduler-leader-kill", "kill -9 the leading scheduler replica, restart it (it rejoins as standby)",
             _kill_leader, _restart, detect=_new_leader),
    Scenario("gateway-kill", "kill -9 gateway replica 1 (the client fails over to replica 0), restart it",
             _kill("gateway-1"), _restart, detect=_gateway_down, expect_no_loss=False,
             why_loss="a request in flight on the killed replica before its answer began (a non-streamed one, "
                      "a stream still in retrieval or admission) loses its connection with no error, and nothing "
                      "here retries a request already sent (no load balancer); a stream already under way is "
                      "resumed on the other replica when the gateways can resume streams"),
    Scenario("cache-kill", "kill -9 the response cache, restart it", _kill("cache"), _restart),
    Scenario("embedder-kill", "kill -9 the embedder, restart it", _kill("embedder"), _restart),
    Scenario("jobs-worker-kill", "kill -9 the Celery jobs worker (deferred P2 jobs), restart it",
             _kill_jobs_worker, _restart),
    Scenario("redis-restart", "stop Redis (SIGTERM), keep it down, start it again (append-only file)",
             _stop_redis, _start_redis),
    Scenario("worker-freeze", "SIGSTOP the busiest worker's engine, SIGCONT it later", _freeze_worker,
             _thaw_worker, detect=_worker_unhealthy, needs="hung-engine-detection", observe_extra_s=4.0),
    Scenario("client-drop-resume", "the client drops every 2nd stream after 3 events and resumes it with "
             "Last-Event-ID on the other gateway", _start_drops, _stop_drops, needs="stream-resume",
             restore_after_s=UNTIL_THE_END),
)}


def gateway_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False

