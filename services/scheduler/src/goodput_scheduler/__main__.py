"""`python -m goodput_scheduler`: worker registry, admission and placement behind gRPC."""

from __future__ import annotations

from typing import NamedTuple

from goodput.scheduler.v1 import scheduler_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.bootstrap import bootstrap
from goodput_core.clients import make_channel
from goodput_core.server import ServiceRunner, run_main
from goodput_core.tls import channel_credentials

from goodput_scheduler.clock import Clock, SystemClock
from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.guard import LatencyGuard
from goodput_scheduler.leader import Election, KubernetesLease, LeaderElector, RedisLock, identity, pod_namespace
from goodput_scheduler.leases import LeaseManager
from goodput_scheduler.metrics import SchedulerMetrics
from goodput_scheduler.placement import Profile, build_pipeline
from goodput_scheduler.registry import WorkerRegistry
from goodput_scheduler.servicer import SchedulerServicer

SERVICE = "goodput.scheduler.v1.Scheduler"


class Scheduler(NamedTuple):
    runner: ServiceRunner
    workers: WorkerRegistry
    leases: LeaseManager
    elector: LeaderElector


def election(settings: SchedulerSettings) -> Election | None:
    """The leader election the settings ask for (None: this replica always leads)."""
    me = identity()
    if settings.leader_election == "redis":
        return RedisLock(settings.leader_redis_url, key=settings.leader_key, me=me, ttl_s=settings.leader_ttl_s)
    if settings.leader_election == "kubernetes":
        return KubernetesLease(namespace=settings.leader_namespace or pod_namespace(), name=settings.leader_lease_name,
                               me=me, ttl_s=settings.leader_ttl_s, api_url=settings.kube_api_url)
    return None


def build(settings: SchedulerSettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
          clock: Clock | None = None) -> Scheduler:
    """Wires the scheduler (also used by tests to run it in-process). ``clock`` times queues, deadlines, the drain
    rate and the latency guard (tests pass a manual one); worker health checks run on real time."""
    clock = clock or SystemClock()
    credentials = channel_credentials(settings)
    workers = WorkerRegistry(settings, channel_factory=lambda addr: make_channel(addr, provider,
                                                                                credentials=credentials))
    guard = LatencyGuard(settings, clock=clock)
    pipeline = build_pipeline(Profile.parse(settings.profile), settings, registry=registry, guard=guard, clock=clock)
    leases = LeaseManager(settings, workers, pipeline, SchedulerMetrics(registry, workers), guard=guard, clock=clock)
    servicer = SchedulerServicer(leases, workers, mux=settings.mux)
    runner = ServiceRunner(name="scheduler", settings=settings, registry=registry, provider=provider)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, SERVICE)
    metrics = leases.metrics

    async def elected() -> None:
        servicer.leading = True
        metrics.leader.set(1)
        metrics.leader_changes.inc()
        await runner.set_gate(SERVICE, True)

    async def lost() -> None:
        metrics.leader.set(0)
        await runner.set_gate(SERVICE, False)  # first: the gateways' channels stop sending calls here
        servicer.step_down()

    elect = election(settings)
    elector = LeaderElector(elect, ttl_s=settings.leader_ttl_s, renew_s=settings.leader_renew_s,
                            retry_s=settings.leader_retry_s, on_elected=elected, on_lost=lost)
    if elect is not None:  # a standby until elected
        servicer.leading = False
        runner._gates[SERVICE] = False  # noqa: SLF001 - before the server starts: never SERVING as a standby
    runner.on_drain.insert(0, elector.stop)  # step down (and free the lock) first on SIGTERM: a standby takes over
    runner.on_drain.append(leases.stop)
    runner.on_stop.append(workers.stop)
    return Scheduler(runner, workers, leases, elector)


async def serve() -> None:
    rt = bootstrap("scheduler", SchedulerSettings)
    runner, workers, _, elector = build(rt.settings, rt.registry, rt.provider)
    await workers.start()
    await runner.run(after_start=elector.start)


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
