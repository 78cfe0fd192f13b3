"""The lease manager's Prometheus metrics, in one place (the placement pipeline keeps its step histogram)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from goodput_core.metrics import LATENCY_BUCKETS

from goodput_scheduler.registry import WorkerRegistry

__all__ = ["SchedulerMetrics"]


class SchedulerMetrics:
    """Every metric the scheduler exports (names are part of its contract: dashboards, alerts and the HPA read
    them). Gauges that read live state, and the idle-while-queued counter, are bound by the lease manager."""

    def __init__(self, registry: CollectorRegistry, workers: WorkerRegistry) -> None:
        gauge = partial(Gauge, registry=registry)
        counter = partial(Counter, registry=registry)
        self.queue_depth = gauge("goodput_scheduler_queue_depth", "Requests waiting for a worker.", ["priority"])
        self.queue_tenants = gauge("goodput_scheduler_queue_tenants", "Tenants with requests waiting (a bounded "
                                   "class's depth is shared out between them by weight).", ["priority"])
        self.queue_wait = Histogram("goodput_scheduler_queue_wait_seconds", "Time from admit to grant.",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=registry)
        self.admissions = counter("goodput_scheduler_admissions_total", "Requests granted a worker.", ["priority"])
        self.shed = counter("goodput_scheduler_shed_total", "Requests refused or dropped before a grant, by reason "
                            "(queue_full, tenant_share, overload, deadline, timeout, no_worker).",
                            ["priority", "reason"])
        self.inflight = gauge("goodput_scheduler_inflight", "Leases held per worker.", ["worker"])
        self.placements = counter("goodput_scheduler_placements_total", "Placement decisions.", ["worker", "reason"])
        self.releases = counter("goodput_scheduler_releases_total", "Leases released, by outcome.", ["outcome"])
        self.preemptions = counter("goodput_scheduler_preemptions_total", "Leases taken back before their first "
                                   "token from a tenant over its fair share of the slots, by class.", ["priority"])
        self.attached = counter("goodput_scheduler_leases_attached_total", "Leases a previous leader granted that "
                                "gateways brought to this one after a failover.")
        self.leader = gauge("goodput_scheduler_leader", "1 while this replica is the leader (admits and places).")
        self.leader_changes = counter("goodput_scheduler_leader_elections_total", "Times this replica became the "
                                      "leader.")
        self.saturation = gauge("goodput_scheduler_saturation", "Overload signal (1 = P2 shed by default).")
        self.shedding = gauge("goodput_scheduler_shedding", "1 while new requests of the class are shed.", ["priority"])
        self.guard_limit = gauge("goodput_scheduler_guard_limit", "P1/P2 leases one worker may hold now (latency "
                                 "guard).")
        self.p0_ttft_target = gauge("goodput_scheduler_p0_ttft_target_seconds", "P0 TTFT the latency guard "
                                    "defends (0 until learned).")
        self.p0_ready_workers = gauge("goodput_scheduler_p0_ready_workers", "Workers to keep free of P1/P2 prefill "
                                      "for P0 prompts now (0 without recent P0 traffic; the gate never reserves all "
                                      "workers).")
        self.drain_rate = gauge("goodput_scheduler_drain_rate", "Leases released per second (recent window).")
        # Scheduling-level waste (goodput_scheduler.efficiency): engine room left unused while work waited.
        self.idle_while_queued = _BoundCounter(
            "goodput_scheduler_idle_while_queued_seconds",
            "Worker-seconds in which a healthy worker had room (fewer leases than max_inflight_per_worker and, once "
            "it holds one, a KV cache below kv_full) while a request it could serve (its model, or none named) "
            "waited in a queue; by the most urgent class waiting, each worker-second counted once. Requests held "
            "back on purpose count too: P1/P2 by the class shares of the cap kept for P0, the latency guard and the "
            "prefill gate, and any class behind a more urgent one (strict priority). Nothing holds P0 back from a "
            "worker with room, so P0 worker-seconds are waste (head-of-line blocking, or the fifo policy).",
            "priority")
        registry.register(self.idle_while_queued)
        self.queued_with_idle_workers = gauge(
            "goodput_scheduler_queued_with_idle_workers", "1 while a healthy worker has room and a request it could "
            "serve waits (what goodput_scheduler_idle_while_queued_seconds_total counts), else 0.")
        workers_gauge = gauge("goodput_scheduler_workers", "Workers by state: healthy (new grants go there), "
                              "draining (a terminating or unready Kubernetes endpoint: no new grants, its leases "
                              "finish), unhealthy (failing its checks).", ["state"])
        workers_gauge.labels("healthy").set_function(lambda: len(workers.healthy()))
        workers_gauge.labels("draining").set_function(lambda: len(workers.draining()))
        workers_gauge.labels("unhealthy").set_function(
            lambda: len(workers.all()) - len(workers.healthy()) - len(workers.draining()))


class _BoundCounter(Collector):
    """A counter with one label whose values live state computes at scrape time (bound like a gauge's
    ``set_function``): an integral over time that is exact whenever it is read, not only after the last change."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self._read: Callable[[], Mapping[str, float]] = dict

    def set_function(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, total in self._read().items():
            family.add_metric([value], total)
        yield family
