"""`goodput status`: health of every service and each worker's load, as the scheduler sees it.

Example:
    >>> report = collect(scheduler="127.0.0.1:50052", gateway_url="http://127.0.0.1:8080",
    ...                  gateway_grpc="127.0.0.1:50051")
    >>> report.ok
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import httpx
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ServiceHealth", "StatusReport", "WorkerRow", "collect"]


@dataclass
class ServiceHealth:
    name: str
    address: str
    ok: bool
    detail: str


@dataclass
class WorkerRow:
    worker_id: str
    address: str
    healthy: bool
    serving: str
    running: int
    waiting: int
    kv_cache_usage: float
    inflight: int
    last_error: str


@dataclass
class StatusReport:
    services: list[ServiceHealth] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    workers_error: str = ""

    @property
    def problems(self) -> list[str]:
        out = [f"{s.name} is {s.detail}" for s in self.services if not s.ok]
        out += [f"worker {w.worker_id} ({w.address}) is unhealthy" + (f": {w.last_error}" if w.last_error else "")
                for w in self.workers if not w.healthy]
        if self.workers_error:
            out.append(self.workers_error)
        return out

    @property
    def ok(self) -> bool:
        return not self.problems


def _describe(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return "down (not reachable)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "down (no answer in time)"
    return f"down ({code.name if code else 'error'})"


def grpc_health(name: str, address: str, timeout_s: float) -> ServiceHealth:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout_s)
        except grpc.RpcError as err:
            return ServiceHealth(name, address, False, _describe(err))
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ServiceHealth(name, address, reply.status == health_pb2.HealthCheckResponse.SERVING, status.lower())


def http_health(name: str, url: str, timeout_s: float) -> ServiceHealth:
    try:
        reply = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as err:
        return ServiceHealth(name, url, False, f"down ({type(err).__name__})")
    if reply.status_code == 200:
        return ServiceHealth(name, url, True, "ok")
    return ServiceHealth(name, url, False, f"HTTP {reply.status_code}")


def collect(*, scheduler: str, gateway_url: str, gateway_grpc: str, timeout_s: float = 2.0) -> StatusReport:
    report = StatusReport()
    report.services.append(grpc_health("gateway (gRPC)", gateway_grpc, timeout_s))
    report.services.append(http_health("gateway (HTTP)", gateway_url.rstrip("/") + "/healthz", timeout_s))
    sched = grpc_health("scheduler", scheduler, timeout_s)
    report.services.append(sched)
    with grpc.insecure_channel(scheduler) as channel:
        try:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(scheduler_pb2.ListWorkersRequest(),
                                                                          timeout=timeout_s)
        except grpc.RpcError as err:
            report.workers_error = f"cannot list workers: scheduler is {_describe(err)}"
            return report
    if not reply.workers:
        report.workers_error = "the scheduler knows no workers"
    for w in reply.workers:
        health = grpc_health(w.worker_id, w.address, timeout_s)
        report.workers.append(WorkerRow(
            worker_id=w.worker_id, address=w.address, healthy=w.healthy, serving=health.detail,
            running=w.load.running, waiting=w.load.waiting, kv_cache_usage=w.load.kv_cache_usage,
            inflight=w.inflight, last_error=w.last_error))
    return report
