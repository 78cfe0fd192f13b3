"""`goodput status`: health of every service and each worker's load, as the scheduler sees it.

Every gRPC service answers the standard health check (the internal ones over mutual TLS, checked with the operator's
``credentials``; the gateway's public port in plaintext); the gateway's REST side and the Celery workers (which serve
no gRPC) answer ``/healthz`` on their HTTP port. ``endpoints`` names what to check (``Platform.endpoints()``, or
the ``up.json`` a running `goodput up` writes).

Example::

    report = collect({"gateway": "127.0.0.1:50051", "gateway_http": "http://127.0.0.1:8080",
                      "scheduler": "127.0.0.1:50052", "index-worker": "http://127.0.0.1:9106"})
    report.ok
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import httpx
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["ServiceHealth", "StatusReport", "WorkerRow", "collect", "render"]

# Checked in this order; a name missing from the endpoints is not part of that platform.
GRPC_SERVICES = ("gateway", "scheduler", "embedder", "retriever", "cache")
HTTP_SERVICES = ("index-worker", "jobs-worker")


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
    draining: bool = False  # no new grants while its leases finish (a scale-down, a terminating pod)


@dataclass
class StatusReport:
    services: list[ServiceHealth] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    workers_error: str = ""

    @property
    def problems(self) -> list[str]:
        out = [f"{s.name} is {s.detail}" for s in self.services if not s.ok]
        out += [f"worker {w.worker_id} ({w.address}) is unhealthy" + (f": {w.last_error}" if w.last_error else "")
                for w in self.workers if not w.healthy and not w.draining]
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


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def grpc_health(name: str, address: str, timeout_s: float,
                credentials: grpc.ChannelCredentials | None = None) -> ServiceHealth:
    with _channel(address, credentials) as channel:
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


def collect(endpoints: dict[str, str], *, timeout_s: float = 2.0,
            credentials: grpc.ChannelCredentials | None = None) -> StatusReport:
    """``credentials``: the operator's, for the internal services (None: they serve plaintext)."""
    report = StatusReport()
    for name in GRPC_SERVICES:
        # the service, then its replicas (``scheduler-1``, ``gateway-1``...)
        replicas = sorted((n for n in endpoints if n.startswith(f"{name}-") and n[len(name) + 1:].isdigit()),
                          key=lambda n: int(n[len(name) + 1:]))
        for replica in [name, *replicas] if name in endpoints else replicas:
            report.services.append(grpc_health(replica, endpoints[replica], timeout_s,
                                               None if name == "gateway" else credentials))
        if name == "gateway" and "gateway_http" in endpoints:
            report.services.append(http_health("gateway (HTTP)", endpoints["gateway_http"].rstrip("/") + "/healthz",
                                               timeout_s))
        if name == "gateway" and "gateway_metrics" in endpoints:  # the scraper's port, apart from REST
            report.services.append(http_health("gateway (metrics)", endpoints["gateway_metrics"], timeout_s))
    for name in HTTP_SERVICES:
        if name in endpoints:
            report.services.append(http_health(name, endpoints[name].rstrip("/") + "/healthz", timeout_s))
    scheduler = endpoints.get("scheduler")
    if scheduler is None:
        return report
    with _channel(scheduler, credentials) as channel:
        try:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(scheduler_pb2.ListWorkersRequest(),
                                                                          timeout=timeout_s)
        except grpc.RpcError as err:
            report.workers_error = f"cannot list workers: scheduler is {_describe(err)}"
            return report
    if not reply.workers:
        report.workers_error = "the scheduler knows no workers"
    for w in reply.workers:
        health = grpc_health(w.worker_id, w.address, timeout_s, credentials)
        report.workers.append(WorkerRow(
            worker_id=w.worker_id, address=w.address, healthy=w.healthy, serving=health.detail,
            running=w.load.running, waiting=w.load.waiting, kv_cache_usage=w.load.kv_cache_usage,
            inflight=w.inflight, last_error=w.last_error, draining=w.draining))
    return report


def render(report: StatusReport, console: Console) -> None:
    """The services table, then the workers table (it fits 80 columns: each worker's last error goes on a line of
    its own below the table, where it may wrap)."""
    services = Table(title="services", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("service", "address", "health"):
        services.add_column(col, overflow="fold")
    for s in report.services:
        services.add_row(s.name, s.address, f"[green]{s.detail}[/]" if s.ok else f"[red]{s.detail}[/]")
    console.print(services)
    if not report.workers:
        return
    workers = Table(title="workers (load as the scheduler sees it)", title_justify="left", box=box.SIMPLE_HEAD,
                    pad_edge=False)
    workers.add_column("worker", no_wrap=True, max_width=16, overflow="ellipsis")
    workers.add_column("address", no_wrap=True, max_width=22, overflow="ellipsis")
    workers.add_column("state", no_wrap=True)
    for col in ("run", "wait", "KV", "infl"):
        workers.add_column(col, justify="right", no_wrap=True)
    errors = []
    for w in report.workers:
        state = "[yellow]draining[/]" if w.draining else "[green]healthy[/]" if w.healthy else "[red]unhealthy[/]"
        if w.serving != "serving":
            state += f" [red]({w.serving.split(' (')[0]})[/]"
        workers.add_row(w.worker_id, w.address, state, str(w.running), str(w.waiting), f"{w.kv_cache_usage:.0%}",
                        str(w.inflight))
        if w.last_error:
            errors.append(f"{w.worker_id}: last error: {w.last_error}")
    console.print(workers)
    for line in errors:
        console.print(line, markup=False, highlight=False)
