"""A Goodput service as its own process on localhost (``python -m <module>`` with settings in its environment), its
output in a log file, stopped with SIGTERM then SIGKILL. For tests that need the real process boundary: gRPC between
processes, a scheduler that outlives or loses its peers, a worker killed mid-stream."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from goodput_testing._ports import free_port
from goodput_testing._wait import wait_until

__all__ = ["ServiceProcess", "SimBackend", "sim_backend", "sim_worker_env"]


class ServiceProcess:
    def __init__(self, module: str, env: dict[str, str], log: Path) -> None:
        self.module = module
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env}, stdout=out,
                                         stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sim_worker_env(port: int, *, time_scale: float = 0.2, **settings: str) -> dict[str, str]:
    """The environment of an inference worker on the simulated engine (no model loads), plaintext, on ``port``;
    ``settings`` are more ``GOODPUT_INFERENCE_*`` settings by their short names (``MAX_NUM_SEQS="4"``)."""
    return {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_GRPC_PORT": str(port),
            "GOODPUT_INFERENCE_HTTP_PORT": str(free_port()), "GOODPUT_INFERENCE_INSECURE_INTERNAL": "true",
            "GOODPUT_INFERENCE_SIM_CONFIG": f'{{"time_scale": {time_scale}}}',
            **{f"GOODPUT_INFERENCE_{k}": v for k, v in settings.items()}}


@dataclass(frozen=True)
class SimBackend:
    scheduler_addr: str  # host:port of the scheduler, plaintext
    worker_metrics: str  # the worker's /metrics URL
    logs: Path


@contextlib.contextmanager
def sim_backend(logs: Path, *, time_scale: float = 0.2) -> Iterator[SimBackend]:
    """An inference worker on the simulated engine and a scheduler that sees it healthy, each its own process on free
    ports (plaintext): what a gateway built in the test's own process needs behind it."""
    import grpc
    from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    worker_port, worker_http, scheduler_port = free_port(), free_port(), free_port()
    worker = ServiceProcess("goodput_inference", sim_worker_env(worker_port, time_scale=time_scale,
                                                                HTTP_PORT=str(worker_http)), logs / "worker.log")
    scheduler = ServiceProcess("goodput_scheduler", {
        "GOODPUT_SCHEDULER_WORKERS": f"127.0.0.1:{worker_port}", "GOODPUT_SCHEDULER_INSECURE_INTERNAL": "true",
        "GOODPUT_SCHEDULER_GRPC_PORT": str(scheduler_port), "GOODPUT_SCHEDULER_HTTP_PORT": str(free_port()),
        "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.2"}, logs / "scheduler.log")

    def healthy(stub: scheduler_pb2_grpc.SchedulerStub) -> bool:
        try:
            return any(w.healthy for w in stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=1).workers)
        except grpc.RpcError:
            return False

    try:
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            wait_until(lambda: healthy(stub), timeout=60, interval=0.2, message=f"no healthy worker (logs in {logs})")
        yield SimBackend(f"127.0.0.1:{scheduler_port}", f"http://127.0.0.1:{worker_http}/metrics", logs)
    finally:
        scheduler.stop()
        worker.stop()
