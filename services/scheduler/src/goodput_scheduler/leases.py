"""Admission, waiting for capacity, grant and release of requests: the scheduler's domain logic, free of gRPC.

A lease is held from grant to release. Capacity is counted in leases per worker (a cap from settings) on top of
the engines' own reported load; a request that finds every healthy worker full waits (late binding) until a lease
is released, its deadline passes, or the wait queue is full (then it is shed with a retry-after computed from the
observed release rate).

Example:
    >>> lease = await leases.acquire(PlacementRequest(...), deadline=time.monotonic() + 30)
    >>> ...  # the gateway streams from lease.worker.address
    >>> leases.release(lease, Outcome.OK)
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from goodput.scheduler.v1 import scheduler_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput_core.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from goodput_core.metrics import LATENCY_BUCKETS
from goodput_core.priority import priority_name

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import Decision, PlacementPipeline, PlacementRequest
from goodput_scheduler.registry import Worker, WorkerRegistry

log = logging.getLogger("goodput.scheduler.leases")


@dataclass
class Lease:
    request: PlacementRequest
    worker: Worker
    reason: str
    queue_wait_s: float
    granted_at: float = field(default_factory=time.monotonic)
    released: bool = False


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, workers: WorkerRegistry) -> None:
        self.queue_depth = Gauge("goodput_scheduler_queue_depth", "Requests waiting for a worker.", ["priority"],
                                 registry=registry)
        self.queue_wait = Histogram("goodput_scheduler_queue_wait_seconds", "Time from admit to grant.",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=registry)
        self.admissions = Counter("goodput_scheduler_admissions_total", "Requests granted a worker.", ["priority"],
                                  registry=registry)
        self.shed = Counter("goodput_scheduler_shed_total", "Requests refused.", ["priority", "reason"],
                            registry=registry)
        self.inflight = Gauge("goodput_scheduler_inflight", "Leases held per worker.", ["worker"],
                              registry=registry)
        self.placements = Counter("goodput_scheduler_placements_total", "Placement decisions.",
                                  ["worker", "reason"], registry=registry)
        self.releases = Counter("goodput_scheduler_releases_total", "Leases released, by outcome.", ["outcome"],
                                registry=registry)
        workers_gauge = Gauge("goodput_scheduler_workers", "Workers by state.", ["state"], registry=registry)
        workers_gauge.labels("healthy").set_function(lambda: len(workers.healthy()))
        workers_gauge.labels("unhealthy").set_function(lambda: len(workers.all()) - len(workers.healthy()))


class LeaseManager:
    def __init__(self, settings: SchedulerSettings, registry: WorkerRegistry, pipeline: PlacementPipeline,
                 metrics: SchedulerMetrics) -> None:
        self.settings = settings
        self.registry = registry
        self.pipeline = pipeline
        self.metrics = metrics
        self._waiting = 0
        self._capacity = asyncio.Condition()
        self._releases: collections.deque[float] = collections.deque(maxlen=1024)
        self.leases: dict[str, Lease] = {}
        registry.on_change.append(self._wake_soon)

    @property
    def waiting(self) -> int:
        return self._waiting

    def _wake_soon(self) -> None:
        asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    def retry_after_s(self) -> float:
        """Seconds until the queue ahead is likely drained, from the release rate of the last minute."""
        now = time.monotonic()
        recent = [t for t in self._releases if now - t <= 60.0]
        window = max(now - recent[0], 1.0) if recent else 60.0
        rate = len(recent) / window if recent else 0.0
        if rate <= 0:
            return 5.0
        return float(min(max((self._waiting + 1) / rate, 0.5), 120.0))

    async def acquire(self, req: PlacementRequest, *, deadline: float | None) -> Lease:
        """Grants a worker, waiting for capacity if needed. Raises ResourceExhausted, Unavailable or
        DeadlineExceeded."""
        start = time.monotonic()
        prio = priority_name(req.priority)
        decision = self._try_place(req)
        if decision is None:
            if self._waiting >= self.settings.max_queue:
                self.metrics.shed.labels(prio, "queue_full").inc()
                raise ResourceExhausted(f"scheduler queue is full ({self._waiting} waiting)",
                                        retry_after_s=self.retry_after_s())
            decision = await self._wait_for_placement(req, start, deadline)
        wait = time.monotonic() - start
        lease = Lease(request=req, worker=decision.worker, reason=decision.reason, queue_wait_s=wait)
        decision.worker.inflight += 1
        self.leases[req.request_id] = lease
        self.metrics.inflight.labels(decision.worker.worker_id).set(decision.worker.inflight)
        self.metrics.admissions.labels(prio).inc()
        self.metrics.queue_wait.labels(prio).observe(wait)
        self.metrics.placements.labels(decision.worker.worker_id, decision.reason).inc()
        return lease

    def _try_place(self, req: PlacementRequest) -> Decision | None:
        return self.pipeline.place(req, self.registry.all())

    async def _wait_for_placement(self, req: PlacementRequest, start: float, deadline: float | None) -> Decision:
        prio = priority_name(req.priority)
        self._waiting += 1
        self.metrics.queue_depth.labels(prio).inc()
        try:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self.metrics.shed.labels(prio, "deadline").inc()
                    raise DeadlineExceeded("the request's deadline passed while it waited for a worker")
                if not self.registry.healthy() and now - start >= self.settings.no_worker_wait_s:
                    self.metrics.shed.labels(prio, "no_worker").inc()
                    raise Unavailable("no healthy inference worker is available",
                                      retry_after_s=self.settings.health_interval_s * 2)
                timeout = 0.5 if deadline is None else max(min(deadline - now, 0.5), 0.0)
                async with self._capacity:
                    try:
                        await asyncio.wait_for(self._capacity.wait(), timeout)
                    except asyncio.TimeoutError:
                        pass
                decision = self._try_place(req)
                if decision is not None:
                    return decision
        finally:
            self._waiting -= 1
            self.metrics.queue_depth.labels(prio).dec()

    def release(self, lease: Lease, outcome: int) -> None:
        if lease.released:
            return
        lease.released = True
        self.leases.pop(lease.request.request_id, None)
        lease.worker.inflight = max(lease.worker.inflight - 1, 0)
        self.metrics.inflight.labels(lease.worker.worker_id).set(lease.worker.inflight)
        self.metrics.releases.labels(scheduler_pb2.Outcome.Name(outcome).removeprefix("OUTCOME_").lower()).inc()
        self._releases.append(time.monotonic())
        if outcome == scheduler_pb2.OUTCOME_WORKER_FAILED:
            asyncio.get_running_loop().create_task(
                self.registry.report_failure(lease.worker.worker_id, "reported by the gateway"))
        self._wake_soon()
