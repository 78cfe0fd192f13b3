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
from goodput_scheduler.leases import LeaseManager
from goodput_scheduler.metrics import SchedulerMetrics
from goodput_scheduler.placement import Profile, build_pipeline
from goodput_scheduler.registry import WorkerRegistry
from goodput_scheduler.servicer import SchedulerServicer


class Scheduler(NamedTuple):
    runner: ServiceRunner
    workers: WorkerRegistry
    leases: LeaseManager


def build(settings: SchedulerSettings, registry: CollectorRegistry, provider: TracerProvider | None, *,
          clock: Clock | None = None) -> Scheduler:
    """Wires the scheduler (also used by tests to run it in-process). ``clock`` times queues, deadlines, the drain
    rate and the latency guard (tests pass a manual one); worker health checks run on real time."""
    clock = clock or SystemClock()
    credentials = channel_credentials(settings)
    workers = WorkerRegistry(settings, channel_factory=lambda addr: make_channel(addr, provider,
                                                                                credentials=credentials))
    guard = LatencyGuard(settings, clock=clock)
    pipeline = build_pipeline(Profile.parse(settings.profile), settings, registry=registry, guard=guard,
                              clock=clock)
    leases = LeaseManager(settings, workers, pipeline, SchedulerMetrics(registry, workers), guard=guard,
                          clock=clock)
    servicer = SchedulerServicer(leases, workers, admit_timeout_s=settings.admit_timeout_s,
                                 mux_max_leases=settings.mux_max_leases)
    runner = ServiceRunner(name="scheduler", settings=settings, registry=registry, provider=provider)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "goodput.scheduler.v1.Scheduler")
    runner.on_drain.append(leases.stop)
    runner.on_stop.append(workers.stop)
    return Scheduler(runner, workers, leases)


async def serve() -> None:
    rt = bootstrap("scheduler", SchedulerSettings)
    runner, workers, _ = build(rt.settings, rt.registry, rt.provider)
    await workers.start()
    await runner.run()


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
