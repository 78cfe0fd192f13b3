"""Mid-stream failover, end to end: the gateway's pipeline against a scheduler process and two simulated worker
processes over gRPC on localhost. The worker streaming an answer is killed (SIGKILL) after some of its tokens reached
the caller: the answer goes on on the other worker from the tokens already sent (their continuation), so the caller
reads the whole answer, every token once, with no error; the dead worker's lease is released as failed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.sampling import Sampling
from goodput_testing import ServiceProcess, async_wait_until, free_port, sim_worker_env

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.requests import Cost, GenerationRequest, Message

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0
TOKENS = 1500  # about 3 s of 2 ms steps: the kill comes well inside the answer
SIM = '{"time_scale": 1.0, "step_base_s": 0.002, "step_per_seq_s": 0.0}'


@pytest.fixture
async def fleet(service_processes) -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, dict[int, ServiceProcess]]]:
    ports = [free_port(), free_port()]
    workers = {port: service_processes("goodput_inference", f"worker-{port}",
                                       **{**sim_worker_env(port), "GOODPUT_INFERENCE_SIM_CONFIG": SIM})
               for port in ports}
    port = free_port()
    service_processes("goodput_scheduler", "scheduler",
                      GOODPUT_SCHEDULER_WORKERS=",".join(f"127.0.0.1:{p}" for p in ports),
                      GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(port),
                      GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def both_healthy() -> bool:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return sum(w.healthy for w in listed.workers) == 2

    await async_wait_until(both_healthy, timeout=30, interval=0.1, message="the scheduler's two workers are healthy")
    yield stub, workers
    await channel.close()


async def test_a_worker_killed_mid_stream_is_invisible_to_the_caller(fleet) -> None:
    stub, workers = fleet
    pipeline = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                        metrics=GatewayMetrics(CollectorRegistry()))
    try:
        models = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        model = models.workers[0].model.served_model_name
        request = GenerationRequest(model=model, messages=(Message("user", "tell me everything"),), priority=P0,
                                    sampling=Sampling(max_tokens=TOKENS))
        now = time.monotonic()
        stream = await pipeline.open(Principal(tenant="acme", max_priority=P0, default_priority=P0), request,
                                     Cost(prompt_tokens=8, max_tokens=TOKENS), request_id="failover-1", model=model,
                                     arrived=now, deadline=now + 60)
        events = stream.events()
        text = ""
        while len(text) < 200 * len(" tok"):  # some of the answer reached the caller
            event = await asyncio.wait_for(anext(events), timeout=30)
            assert isinstance(event, TextDelta)
            text += event.text
        serving = next(port for port in workers if stream.start.worker_id.endswith(f":{port}"))
        workers[serving].kill()
        end = None
        async for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            else:
                end = event
        assert isinstance(end, StreamEnd) and end.completion_tokens == TOKENS and end.finish_reason == "length"
        assert text == " tok" * TOKENS  # every token once: nothing lost or repeated across the failover
        assert pipeline.metrics.worker_failures.labels("mid_stream")._value.get() == 1
    finally:
        await pipeline.close()
