"""What the scheduler benchmarks share: a fleet of simulated inference workers and a scheduler as real processes on
localhost, and a client that does what the gateway does for one request (lease -> stream from the granted worker
-> release), timing TTFT and end-to-end latency.

The workers are ``python -m goodput_inference`` with ``GOODPUT_INFERENCE_ENGINE=sim`` (A100 / 7B calibration, see
``goodput_inference.sim_engine``) and the scheduler is ``python -m goodput_scheduler``: the production code paths,
over gRPC. Only the GPU is simulated.

Example::

    with SimFleet(workers=4, base_port=26100, sim={"time_scale": 2}) as fleet:
        fleet.start_scheduler({"QUEUE_POLICY": "fifo"})
        client = LeaseClient(fleet.scheduler_addr)
        result = await client.run(RequestSpec(...))
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio

from goodput_core.errors import DeadlineExceeded, GoodputError, ResourceExhausted

from goodput_gateway.jobs import retry_delay
from goodput_gateway.leasemux import LeaseStream

__all__ = ["LeaseClient", "RequestSpec", "Result", "SimFleet", "random_text"]

PRIORITY = {"P0": types_pb2.PRIORITY_P0, "P1": types_pb2.PRIORITY_P1, "P2": types_pb2.PRIORITY_P2}
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def random_text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    priority: str  # "P0", "P1", "P2"
    tenant: str
    prompt: str
    max_tokens: int
    deadline_s: float  # per attempt, like the gateway's request timeout
    prefix_chars: int = 512  # how much of the prompt goes to the scheduler as the prefix hint (the gateway's cut)
    session_id: str = ""  # the conversation it belongs to (Admit.session_id: session affinity); empty = none
    retry_shed: bool = False  # park and retry when shed (deferred P2 work)
    send_priority: bool = True  # False: the worker sees no priority (a FIFO baseline)
    give_up_after_s: float = 3600.0
    model: str = ""  # the served model name asked for (Admit.model, GenerateRequest.model); empty = any


@dataclass
class Result:
    spec: RequestSpec
    arrival: float
    outcome: str = "pending"  # ok, shed, expired, error
    ttft_s: float | None = None
    e2e_s: float | None = None
    attempts: int = 0
    sheds: int = 0
    retry_after_s: list[float] = field(default_factory=list)
    deltas: list[tuple[float, int]] = field(default_factory=list)  # per Delta: (s from arrival, tokens so far)
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (its Finished usage)
    queue_wait_s: float = 0.0
    worker: str = ""
    reason: str = ""
    error: str = ""
    granted_s: float | None = None  # from arrival to the grant of the attempt that ran
    prompt_tokens: int = 0  # as the worker counted them (its Finished usage)
    completion_tokens: int = 0


class LeaseClient:
    """Does for one request what the gateway's pipeline does, against the scheduler and the granted worker.

    ``report_usage``: the release carries the request's prompt and completion tokens, as the gateway's does, so the
    scheduler learns each worker's speed (and its service-time predictor learns) from the finished leases; off by
    default, as the benchmarks written before that measured without it. ``on_grant(spec, granted)`` is called at
    each grant (the gateway's model ``auto`` observes the grant's queue wait there)."""

    def __init__(self, scheduler_addr: str, *, rng: random.Random | None = None, report_usage: bool = False,
                 on_grant: Callable[[RequestSpec, scheduler_pb2.Granted], None] | None = None) -> None:
        options = [("grpc.max_concurrent_streams", 10_000)]
        self._channel = aio.insecure_channel(scheduler_addr, options=options)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self.leases = LeaseStream(self.scheduler)  # every request's lease on one stream, as the gateway's
        self._workers: dict[str, inference_pb2_grpc.InferenceStub] = {}
        self._channels: list[aio.Channel] = [self._channel]
        self.rng = rng or random.Random(0)
        self.report_usage = report_usage
        self.on_grant = on_grant

    def _worker(self, address: str) -> inference_pb2_grpc.InferenceStub:
        stub = self._workers.get(address)
        if stub is None:
            channel = aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._workers[address] = inference_pb2_grpc.InferenceStub(channel)
        return stub

    async def close(self) -> None:
        await self.leases.close()
        for c in self._channels:
            await c.close(grace=None)

    async def run(self, spec: RequestSpec) -> Result:
        result = Result(spec=spec, arrival=time.monotonic())
        while True:
            result.attempts += 1
            outcome = await self._attempt(spec, result)
            if outcome != "shed" or not spec.retry_shed:
                result.outcome = outcome
                return result
            result.sheds += 1
            if time.monotonic() - result.arrival > spec.give_up_after_s:
                result.outcome = "shed"
                return result
            await asyncio.sleep(retry_delay(result.sheds, result.retry_after_s[-1] if result.retry_after_s
                                            else None, rng=self.rng))

    async def _attempt(self, spec: RequestSpec, result: Result) -> str:
        prio = PRIORITY[spec.priority]
        lease_id = f"{spec.request_id}.{result.attempts}"
        admit = scheduler_pb2.Admit(request_id=lease_id, tenant=spec.tenant, priority=prio, model=spec.model,
                                    prompt_tokens_estimate=len(spec.prompt) // 4, max_tokens=spec.max_tokens,
                                    prefix_hint=spec.prompt[:spec.prefix_chars], session_id=spec.session_id)
        try:
            granted = await self.leases.acquire(lease_id, admit, timeout_s=spec.deadline_s)
        except ResourceExhausted as err:
            if err.retry_after_s is not None:
                result.retry_after_s.append(err.retry_after_s)
            return "shed"
        except DeadlineExceeded:
            return "expired"
        except GoodputError as err:
            result.error = f"{err.grpc_code.name}: {err.message}"
            return "error"
        result.queue_wait_s = granted.queue_wait_s
        result.granted_s = time.monotonic() - result.arrival
        if self.on_grant is not None:
            self.on_grant(spec, granted)
        result.worker, result.reason = granted.worker_id, granted.reason
        outcome = scheduler_pb2.OUTCOME_ERROR
        try:
            gen = inference_pb2.GenerateRequest(
                request_id=lease_id, model=spec.model, prompt=spec.prompt, tenant=spec.tenant,
                priority=prio if spec.send_priority else types_pb2.PRIORITY_UNSPECIFIED,
                sampling=types_pb2.SamplingParams(max_tokens=spec.max_tokens))
            async for chunk in self._worker(granted.address).Generate(gen, timeout=spec.deadline_s):
                if chunk.HasField("delta"):
                    result.deltas.append((time.monotonic() - result.arrival, chunk.delta.completion_tokens))
                if chunk.HasField("delta") and result.ttft_s is None:
                    result.ttft_s = time.monotonic() - result.arrival
                    # as the gateway does: the scheduler's prefill gate and latency guard act on it
                    self.leases.first_token(lease_id, result.ttft_s)
                elif chunk.HasField("finished"):
                    result.e2e_s = time.monotonic() - result.arrival
                    result.cached_tokens = chunk.finished.usage.cached_tokens
                    result.prompt_tokens = chunk.finished.usage.prompt_tokens
                    result.completion_tokens = chunk.finished.usage.completion_tokens
            outcome = scheduler_pb2.OUTCOME_OK
            return "ok" if result.e2e_s is not None else "error"
        except aio.AioRpcError as err:
            result.error = f"{err.code().name}: {err.details()}"
            return "error"
        finally:
            usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens} \
                if self.report_usage and outcome == scheduler_pb2.OUTCOME_OK else {}
            await self.leases.release(lease_id, scheduler_pb2.Release(outcome=outcome, ttft_s=result.ttft_s or 0.0,
                                                                      **usage))


class SimFleet:
    """N simulated workers (processes) and, on demand, a scheduler process in front of them. ``engine="vllm"`` starts
    real vLLM workers instead (the small-scale check on CPU)."""

    def __init__(self, *, workers: int, base_port: int, sim: dict[str, Any], max_num_seqs: int = 32,
                 max_model_len: int = 4096, logdir: Path | None = None, engine: str = "sim",
                 worker_env: dict[str, str] | None = None) -> None:
        self.engine = engine
        self.worker_env = dict(worker_env or {})
        self.n = workers
        self.base_port = base_port
        self.sim = sim
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.logdir = logdir or Path("loadtests/out/logs")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.scheduler_addr = f"127.0.0.1:{base_port}"
        self.scheduler_metrics_url = f"http://127.0.0.1:{base_port + 90}/metrics"

    @property
    def worker_addrs(self) -> list[str]:
        return [f"127.0.0.1:{self.base_port + 1 + i}" for i in range(self.n)]

    def _spawn(self, module: str, env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        self.logdir.mkdir(parents=True, exist_ok=True)
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
        # Plaintext between the fleet's processes, said explicitly (they warn at start): the benchmark measures
        # scheduling policies, and its client dials the scheduler and the workers directly without certificates.
        full = {**os.environ, "GOODPUT_INSECURE_INTERNAL": "true", **env}
        return subprocess.Popen([sys.executable, "-m", module], env=full, stdout=log, stderr=subprocess.STDOUT)

    def start_workers(self) -> None:
        for i, addr in enumerate(self.worker_addrs):
            port = addr.rsplit(":", 1)[1]
            env = {"GOODPUT_INFERENCE_ENGINE": self.engine, "GOODPUT_INFERENCE_GRPC_PORT": port,
                   "GOODPUT_INFERENCE_HTTP_PORT": "0", "GOODPUT_INFERENCE_WORKER_ID": f"sim-{i}",
                   "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(self.max_num_seqs),
                   "GOODPUT_INFERENCE_MAX_MODEL_LEN": str(self.max_model_len),
                   "GOODPUT_INFERENCE_SCHEDULING_POLICY": "priority",
                   "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps(self.sim), "GOODPUT_INFERENCE_LOG_LEVEL": "WARNING",
                   **self.worker_env}
            self.procs.append(self._spawn("goodput_inference", env, f"{self.engine}-worker-{i}"))

    def start_scheduler(self, overrides: dict[str, str], *, name: str = "scheduler") -> None:
        self.stop_scheduler()
        env = {"GOODPUT_SCHEDULER_GRPC_PORT": str(self.base_port),
               "GOODPUT_SCHEDULER_HTTP_PORT": str(self.base_port + 90),
               "GOODPUT_SCHEDULER_WORKERS": ",".join(self.worker_addrs),
               "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.25", "GOODPUT_SCHEDULER_DRAIN_GRACE_S": "1",
               "GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER": str(self.max_num_seqs),
               "GOODPUT_SCHEDULER_LOG_LEVEL": "WARNING"}
        env.update({f"GOODPUT_SCHEDULER_{k}": v for k, v in overrides.items()})
        self.scheduler = self._spawn("goodput_scheduler", env, name)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aio.insecure_channel(self.scheduler_addr) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while time.monotonic() < deadline:
                try:
                    resp = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
                    if sum(1 for w in resp.workers if w.healthy) == self.n:
                        return
                except aio.AioRpcError:
                    pass
                for p in [*self.procs, self.scheduler]:
                    if p is not None and p.poll() is not None:
                        raise RuntimeError(f"a fleet process exited with {p.returncode}; see {self.logdir}")
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the fleet was not ready in {timeout_s:.0f} s; see {self.logdir}")

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            _stop(self.scheduler)
            self.scheduler = None

    def restart_workers(self) -> None:
        """Fresh worker processes (empty engines and caches), so one run's leftovers cannot affect the next."""
        for p in self.procs:
            _stop(p)
        self.procs.clear()
        self.start_workers()

    def stop(self) -> None:
        self.stop_scheduler()
        for p in self.procs:
            _stop(p)
        self.procs.clear()

    def __enter__(self) -> SimFleet:
        self.start_workers()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
