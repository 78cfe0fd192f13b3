"""The gateway's speculative start (SPECULATIVE_START): the worker call starts while the lease is being granted, on
the worker the scheduler granted last, where its latest grant left lease slots to spare. Against a scheduler process
and simulated worker processes (no model loads), over gRPC on localhost: a right guess serves the answer from the
early call, a wrong one is cancelled and the worker aborts it, so is one whose lease waits in the scheduler's queue
or is refused, a worker with no slot left is not guessed, and none leaves a lease held or a request running
anywhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from prometheus_client import CollectorRegistry

from goodput_core.errors import GoodputError
from goodput_core.sampling import Sampling
from goodput_testing import async_wait_until, free_port, sim_worker_env

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.requests import Cost, GenerationRequest, Message
from goodput_gateway.speculation import MAX_INFLIGHT, MIN_FREE_SLOTS

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0
CAP = MIN_FREE_SLOTS + 2  # the scheduler's worker's lease slots
PRINCIPAL = Principal(tenant="t", max_priority=P0, default_priority=P0)


def counted(metrics: GatewayMetrics, result: str) -> float:
    return metrics.speculative_starts.labels(result)._value.get()  # type: ignore[attr-defined, no-any-return]


async def answer(pipeline: Pipeline, model: str, i: int, *, deadline_s: float = 30.0) -> str:
    request = GenerationRequest(model=model, messages=(Message("user", f"question {i}"),), priority=P0,
                                sampling=Sampling(max_tokens=4))
    now = time.monotonic()
    stream = await pipeline.open(PRINCIPAL, request, Cost(prompt_tokens=8, max_tokens=4), request_id=f"r{i}",
                                 model=model, arrived=now, deadline=now + deadline_s)
    text, ended = "", None
    async for event in stream.events():
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, StreamEnd):
            ended = event
    assert ended is not None and ended.completion_tokens == 4
    return text


@pytest.fixture
async def fleet(service_processes) -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, str, str]]:  # type: ignore[no-untyped-def]
    """A scheduler with one simulated worker, and a second worker it does not know (a guess it never grants)."""
    known, unknown, port = free_port(), free_port(), free_port()
    service_processes("goodput_inference", "worker", **sim_worker_env(known))
    service_processes("goodput_inference", "stranger", **sim_worker_env(unknown))
    service_processes("goodput_scheduler", "scheduler", GOODPUT_SCHEDULER_WORKERS=f"127.0.0.1:{known}",
                      GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(port),
                      GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2",
                      GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER=str(CAP))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def ready() -> bool:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return any(w.healthy for w in listed.workers)

    await async_wait_until(ready, timeout=30, interval=0.1, message="the scheduler's worker is healthy")
    yield stub, f"127.0.0.1:{known}", f"127.0.0.1:{unknown}"
    await channel.close()


async def load(address: str) -> inference_pb2.GetLoadResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)


async def test_a_right_guess_serves_the_answer_and_a_wrong_one_is_aborted_with_nothing_leaked(fleet) -> None:  # type: ignore[no-untyped-def]
    stub, known, stranger = fleet
    metrics = GatewayMetrics(CollectorRegistry())
    # the scheduler's worker has CAP lease slots (MAX_INFLIGHT_PER_WORKER): MIN_FREE_SLOTS to spare, and one more (a
    # finished request's release may reach the scheduler after the next grant)
    pipeline = Pipeline(GatewaySettings(speculative_start=True), scheduler=stub,
                        channel_factory=grpc.aio.insecure_channel, metrics=metrics)
    async with grpc.aio.insecure_channel(known) as channel:
        model = (await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=5)).served_model_name
    try:
        # the first request has nothing to guess from; the next ones start on the worker granted last
        for i in range(4):
            assert await answer(pipeline, model, i)
        assert counted(metrics, "hit") == 3 and counted(metrics, "miss") == 0

        # a wrong guess (a worker the scheduler never grants): the answer comes from the granted worker, and the
        # early call is cancelled
        # its channel open
        await inference_pb2_grpc.InferenceStub(pipeline.channel(stranger)).GetLoad(inference_pb2.GetLoadRequest(),
                                                                                   timeout=5)
        aborted = (await load(stranger)).aborted_total
        pipeline.speculation.granted(model, P0, "", worker_id="stranger", address=stranger, free_slots=CAP)
        assert await answer(pipeline, model, 10)
        assert counted(metrics, "miss") == 1 and counted(metrics, "hit") == 3
        # the early call was cancelled before it reached the worker, or reached it and was aborted there
        await async_wait_until(lambda: _running_none(stranger), timeout=10, interval=0.05,
                               message="nothing left running on the guessed worker")
        assert (await load(stranger)).aborted_total in (aborted, aborted + 1)

        # wrong twice in a row: the gateway stops guessing, but for one request in ten (a probe, which hits here)
        pipeline.speculation.granted(model, P0, "", worker_id="stranger", address=stranger, free_slots=CAP)
        assert await answer(pipeline, model, 11)
        assert counted(metrics, "miss") == 2
        for i in range(9):
            assert await answer(pipeline, model, 12 + i)
        assert counted(metrics, "hit") == 3 and counted(metrics, "miss") == 2
        assert await answer(pipeline, model, 21)
        assert counted(metrics, "hit") == 4

        # a busy gateway does not guess
        hits = counted(metrics, "hit")
        assert pipeline.speculation.guess(model, P0, "", inflight=MAX_INFLIGHT) is not None
        assert pipeline.speculation.guess(model, P0, "", inflight=MAX_INFLIGHT + 1) is None

        # the worker holds all its leases (its cap): its latest grant said no slot was left, so the next request is
        # not started early (it waits in the scheduler's queue and starts on its grant)
        async def held_pair(tag: str) -> list:  # type: ignore[type-arg]
            now = time.monotonic()
            return [await pipeline.open(PRINCIPAL, GenerationRequest(
                model=model, messages=(Message("user", f"{tag} {k}"),), priority=P0, sampling=Sampling(max_tokens=4)),
                Cost(prompt_tokens=8, max_tokens=4), request_id=f"{tag}-{k}", model=model, arrived=now,
                deadline=now + 30, speculate=False) for k in range(CAP)]

        async def finish(streams: list) -> None:  # type: ignore[type-arg]
            for stream in streams:
                async for _ in stream.events():
                    pass

        held = await held_pair("held")
        assert pipeline.speculation.guess(model, P0, "", inflight=1) is None  # no slot to spare there
        waiting = asyncio.ensure_future(answer(pipeline, model, 31))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await finish(held)
        assert await waiting
        assert counted(metrics, "hit") == hits and counted(metrics, "queued") == 0

        # the same with a stale word of spare slots: the early call starts, the scheduler queues the lease, and the
        # early call is cancelled the moment it says so; the request starts on its grant (nothing ran unadmitted)
        held = await held_pair("again")
        pipeline.speculation.granted(model, P0, "", worker_id="worker", address=known, free_slots=CAP)
        waiting = asyncio.ensure_future(answer(pipeline, model, 32))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await finish(held)
        assert await waiting
        assert counted(metrics, "queued") == 1 and counted(metrics, "hit") == hits

        # a lease not granted (no worker serves the model: its deadline passes waiting) cancels the early call too
        # slots to spare there (the last grant's word may predate a release)
        pipeline.speculation.granted("no-such-model", P0, "", worker_id="worker", address=known, free_slots=CAP)
        with pytest.raises(GoodputError):
            await answer(pipeline, "no-such-model", 40, deadline_s=1.0)
        assert counted(metrics, "refused") == 1

        # nothing held anywhere: no lease at the scheduler, no request running on either worker
        async def idle() -> bool:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            loads = [await load(known), await load(stranger)]
            return sum(w.inflight for w in listed.workers) == 0 and all(w.running == 0 for w in loads)

        await async_wait_until(idle, timeout=10, interval=0.05, message="no lease held, no request running")
        assert pipeline.inflight == 0
    finally:
        await pipeline.close()


async def _running_none(address: str) -> bool:
    return (await load(address)).running == 0
