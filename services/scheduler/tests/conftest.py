"""A stand-in inference worker for the scheduler's unit tests: a real gRPC server on localhost that answers the
health check, GetLoad and GetModelInfo the way a worker does, with a switchable health; and the client side of the
scheduler's lease stream, raw (:class:`Stream`) or one lease per stream, read like a call (:func:`open_lease`). (The
integration tests in tests/ run the scheduler against real vLLM workers.)"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry

from goodput_core.clients import make_channel
from goodput_core.errors import from_status

from goodput_scheduler.__main__ import build
from goodput_scheduler.clock import ManualClock
from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import DEFAULT_PROFILE


class StandInWorker(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.server = aio.server()
        self.health = HealthServicer()
        self.load = inference_pb2.WorkerLoad(max_num_seqs=8, ready=True)
        self.continues = True  # its engine takes continuations (ModelInfo.continues), as vLLM's adapter does
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
        return inference_pb2.ModelInfo(served_model_name="m", max_model_len=2048, continues=self.continues)


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


class Stream:
    """A raw ``LeaseBatches`` stream: each :meth:`send` is one batch of lease messages; :meth:`next` gives the events
    one by one, from as many batches as they come in."""

    def __init__(self, h: SchedulerHarness) -> None:
        self.out: asyncio.Queue[scheduler_pb2.LeaseMuxBatch | None] = asyncio.Queue()
        self.call = h.stub.LeaseBatches(self._requests())
        self._events: deque[scheduler_pb2.LeaseMuxEvent] = deque()

    async def _requests(self) -> AsyncIterator[scheduler_pb2.LeaseMuxBatch]:
        while (batch := await self.out.get()) is not None:
            yield batch

    def send(self, *requests: scheduler_pb2.LeaseMuxRequest) -> None:
        self.out.put_nowait(scheduler_pb2.LeaseMuxBatch(requests=requests))

    def close(self) -> None:
        """Closes this side (the scheduler gives back what the stream held, then ends it)."""
        self.out.put_nowait(None)

    def cancel(self) -> None:
        """The stream breaks (the gateway died): the scheduler releases what it held as ABANDONED."""
        self.close()
        self.call.cancel()

    async def next(self, kind: str | None = None, *, timeout: float | None = 5) -> scheduler_pb2.LeaseMuxEvent:
        """The next event (of ``kind``, skipping others)."""
        while True:
            while not self._events:
                batch = await asyncio.wait_for(self.call.read(), timeout)
                if batch is aio.EOF:
                    raise AssertionError("the lease stream ended")
                self._events.extend(batch.events)
            event = self._events.popleft()
            if kind is None or event.WhichOneof("kind") == kind:
                return event


class LeaseCall(Stream):
    """One lease on a stream of its own, read like a call: :meth:`read` gives its events (``queued``, ``granted``,
    ``released``) and raises a ``LeaseError`` as the GoodputError it stands for; :meth:`cancel` breaks the stream."""

    def __init__(self, h: SchedulerHarness, lease_id: str) -> None:
        super().__init__(h)
        self.lease_id = lease_id

    def send_one(self, **kind: object) -> None:
        self.send(scheduler_pb2.LeaseMuxRequest(lease_id=self.lease_id, **kind))  # type: ignore[arg-type]

    async def read(self) -> scheduler_pb2.LeaseMuxEvent:
        event = await self.next(timeout=None)
        if event.HasField("error"):
            e = event.error
            raise from_status(getattr(grpc.StatusCode, e.status), e.message, code=e.code or None,
                              param=e.param or None, retry_after_s=e.retry_after_s or None)
        return event

    def first_token(self, ttft_s: float = 0.05) -> None:
        self.send_one(first_token=scheduler_pb2.FirstToken(ttft_s=ttft_s))

    async def release(self, outcome: int = scheduler_pb2.OUTCOME_OK, **usage: float) -> None:
        """Releases the lease and waits for the scheduler's ``released``."""
        self.send_one(release=scheduler_pb2.Release(outcome=outcome, **usage))  # type: ignore[arg-type]
        while not (await self.read()).HasField("released"):
            pass


async def open_lease(h: SchedulerHarness, request_id: str, timeout: float | None = 10, *, skip_queued: bool = True,
                     **admit: object) -> tuple[LeaseCall, scheduler_pb2.LeaseMuxEvent]:
    """Admits a request (tenant "t", P0 unless ``admit`` says otherwise; ``timeout``: its deadline) on a stream of its
    own; returns the stream and the first event (past ``queued`` ones with ``skip_queued``)."""
    call = LeaseCall(h, request_id)
    fields: dict[str, object] = {"tenant": "t", "priority": types_pb2.PRIORITY_P0, **admit}
    call.send_one(admit=scheduler_pb2.Admit(request_id=request_id, **fields), timeout_s=timeout or 0.0)
    event = await call.read()
    while skip_queued and event.HasField("queued"):
        event = await call.read()
    return call, event


def profile_with(**parameters: dict[str, object]) -> str:
    """The default placement profile, as PROFILE JSON, with the given parameters for the named steps (a step's
    parameters are the profile's only: no setting stands in for them).

    >>> json.loads(profile_with(prefill_gate={"budget_tokens": 1000}))["filters"][-1]
    {'name': 'prefill_gate', 'parameters': {'budget_tokens': 1000}}
    """
    def step(entry: str | dict[str, Any]) -> str | dict[str, Any]:
        name = entry if isinstance(entry, str) else entry["name"]
        if name not in parameters:
            return entry
        return {**({"name": name} if isinstance(entry, str) else entry), "parameters": parameters[name]}

    doc = {key: [step(e) for e in value] if isinstance(value, list) else step(value)
           for key, value in DEFAULT_PROFILE.items()}
    unknown = set(parameters) - {s if isinstance(s, str) else s["name"] for key in ("filters", "scorers")
                                 for s in DEFAULT_PROFILE[key]} - {DEFAULT_PROFILE["picker"]}
    assert not unknown, f"not in the default profile: {unknown}"
    return json.dumps(doc)


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
