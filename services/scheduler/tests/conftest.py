"""A stand-in inference worker for the scheduler's unit tests: a real gRPC server on localhost that answers the
health check, GetLoad and GetModelInfo the way a worker does, with a switchable health. (The integration tests in
tests/ run the scheduler against real vLLM workers.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry

from goodput_core.clients import make_channel

from goodput_scheduler.__main__ import build
from goodput_scheduler.clock import ManualClock
from goodput_scheduler.config import SchedulerSettings


class StandInWorker(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.server = aio.server()
        self.health = HealthServicer()
        self.load = inference_pb2.WorkerLoad(max_num_seqs=8, ready=True)
        inference_pb2_grpc.add_InferenceServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING if serving
                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def GetLoad(self, request: inference_pb2.GetLoadRequest, context: aio.ServicerContext
                      ) -> inference_pb2.WorkerLoad:
        return self.load

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest, context: aio.ServicerContext
                           ) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(served_model_name="m", max_model_len=2048)


@pytest.fixture
async def workers() -> AsyncIterator[Callable[[int], Awaitable[list[StandInWorker]]]]:
    started: list[StandInWorker] = []

    async def make(n: int) -> list[StandInWorker]:
        for _ in range(n):
            w = StandInWorker()
            await w.server.start()
            started.append(w)
        return started[-n:]

    yield make
    for w in started:
        await w.server.stop(None)


class SchedulerHarness:
    """The scheduler in-process. Its queues, deadlines and drain rate run on ``clock``, a manual clock the test moves
    (``await h.clock.advance(s)``); worker health checks run on real time against real gRPC servers. ``until``
    waits for a condition, woken by the scheduler's own change notifications instead of polling."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.registry = CollectorRegistry()
        self.clock = ManualClock(start=1000.0)
        self.runner, self.workers, self.leases, self.elector = build(settings, self.registry, None, clock=self.clock)
        self.channel: aio.Channel | None = None
        self._changed = asyncio.Event()
        self.workers.on_change.append(self._changed.set)
        self.leases.on_change.append(self._changed.set)

    async def until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Returns once ``predicate()`` holds; fails after ``timeout`` real seconds (a guard against hangs)."""
        async def wait() -> None:
            while True:
                self._changed.clear()
                if predicate():
                    return
                await self._changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError("condition not reached") from None

    async def __aenter__(self) -> SchedulerHarness:
        await self.workers.start()
        await self.runner.start()
        self.channel = make_channel(f"127.0.0.1:{self.runner.grpc_port}", None)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.channel is not None
        await self.channel.close()
        await self.runner.stop()

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def scheduler_settings(addresses: list[str], **overrides: object) -> SchedulerSettings:
    base: dict[str, object] = dict(grpc_port=0, http_port=0, workers=addresses, health_interval_s=0.1,
                                   health_timeout_s=0.5, drain_grace_s=0.5, no_worker_wait_s=0.5)
    base.update(overrides)
    return SchedulerSettings(**base)  # type: ignore[arg-type]


class SimWorker:
    """A simulated inference worker (goodput_inference's SimEngine behind the real worker servicer) on localhost:
    it generates, so leases can be driven end to end. ``time_scale`` shrinks the simulated GPU's durations."""

    def __init__(self, *, max_num_seqs: int = 8, time_scale: float = 0.05, **params: object) -> None:
        from goodput_inference.config import InferenceSettings
        from goodput_inference.servicer import InferenceServicer, WorkerMetrics
        from goodput_inference.sim_engine import SimEngine, SimParams

        settings = InferenceSettings(engine="sim", max_num_seqs=max_num_seqs, max_model_len=4096)
        self.engine = SimEngine(settings, params=SimParams(time_scale=time_scale, **params))  # type: ignore[arg-type]
        self.server = aio.server()
        self.health = HealthServicer()
        self.servicer = InferenceServicer(self.engine, worker_id="sim", metrics=WorkerMetrics(CollectorRegistry(),
                                                                                             self.engine))
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.engine.start()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)
        await self.engine.shutdown()


@pytest.fixture
async def sim_workers() -> AsyncIterator[Callable[..., Awaitable[list[SimWorker]]]]:
    started: list[SimWorker] = []

    async def make(n: int, **kw: object) -> list[SimWorker]:
        for _ in range(n):
            w = SimWorker(**kw)  # type: ignore[arg-type]
            await w.start()
            started.append(w)
        return started[-n:]

    yield make
    for w in started:
        await w.stop()
