"""Fair share of the slots with no limits configured, end to end: the gateway's pipeline against a scheduler process
and a simulated worker process over gRPC on localhost. Tenant A fills every slot (and more waits), tenant B then sends
requests: B is served, because A gets no new slot while B waits below its share and a lease of A is preempted for
B's request at once: its youngest still prefilling, else (every answer of A streaming) its youngest resumable one,
whose answer the gateway continues on a new lease from the tokens already sent. A's preempted work goes back to the
queue and finishes whole, its caller seeing at most a pause."""

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
from goodput_testing import async_wait_until, free_port, sim_worker_env

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.requests import Cost, GenerationRequest, Message

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0
SLOTS = 4
# A's prompts (1000 tokens at 0.5 ms each, about 2 s for the four that fit) are still prefilling when B comes.
SIM = '{"time_scale": 1.0, "prefill_s_per_token": 0.0005, "step_base_s": 0.002, "step_per_seq_s": 0.0}'


@pytest.fixture
async def fleet(service_processes) -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, str]]:
    worker, port = free_port(), free_port()
    service_processes("goodput_inference", "worker", **{**sim_worker_env(worker, MAX_NUM_SEQS=str(SLOTS)),
                                                        "GOODPUT_INFERENCE_SIM_CONFIG": SIM})
    service_processes("goodput_scheduler", "scheduler", GOODPUT_SCHEDULER_WORKERS=f"127.0.0.1:{worker}",
                      GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(port),
                      GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def model() -> str:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return ""
        return next((w.model.served_model_name for w in listed.workers if w.healthy and w.lease_cap == SLOTS), "")

    async def ready() -> bool:
        return bool(await model())

    await async_wait_until(ready, timeout=30, interval=0.1, message="the scheduler's worker is healthy")
    yield stub, await model()
    await channel.close()


async def answer(pipeline: Pipeline, tenant: str, i: int, model: str, *, prompt_words: int,
                 max_tokens: int) -> tuple[int, float, float]:
    """Completion tokens, time to first token and monotonic end time of one request, read to its end."""
    principal = Principal(tenant=tenant, max_priority=P0, default_priority=P0)
    request = GenerationRequest(model=model, messages=(Message("user", f"{tenant} {i} " + "word " * prompt_words),),
                                priority=P0, sampling=Sampling(max_tokens=max_tokens))
    now = time.monotonic()
    stream = await pipeline.open(principal, request, Cost(prompt_tokens=prompt_words * 5 // 4, max_tokens=max_tokens),
                                 request_id=f"{tenant}-{i}", model=model, arrived=now, deadline=now + 60)
    ttft, end = 0.0, None
    async for event in stream.events():
        if isinstance(event, TextDelta) and not ttft:
            ttft = time.monotonic() - now
        elif isinstance(event, StreamEnd):
            end = event
    assert end is not None
    return end.completion_tokens, ttft, time.monotonic()


async def test_a_tenant_filling_every_slot_cannot_starve_another(fleet) -> None:
    stub, model = fleet
    pipeline = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                        metrics=GatewayMetrics(CollectorRegistry()))
    a: list[asyncio.Future[tuple[int, float, float]]] = []
    b: list[asyncio.Future[tuple[int, float, float]]] = []
    try:
        a += [asyncio.ensure_future(answer(pipeline, "a", i, model, prompt_words=800, max_tokens=40))
              for i in range(2 * SLOTS)]  # every slot, and as many again waiting
        await asyncio.sleep(0.2)
        b += [asyncio.ensure_future(answer(pipeline, "b", i, model, prompt_words=8, max_tokens=8))
              for i in range(2)]
        served_b = await asyncio.wait_for(asyncio.gather(*b), timeout=30)
        assert [tokens for tokens, _, _ in served_b] == [8, 8]
        assert pipeline.metrics.preempted.labels("before_first_token")._value.get() >= 1  # a slot taken back for B
        finished_a = await asyncio.wait_for(asyncio.gather(*a), timeout=60)
        assert [tokens for tokens, _, _ in finished_a] == [40] * (2 * SLOTS)  # preempted work went back and finished
        # B did not wait for any of A's answers to end (a slot's turnover): it was served first
        assert max(end for _, _, end in served_b) < min(end for _, _, end in finished_a)
    finally:
        for task in a + b:
            task.cancel()
        await asyncio.gather(*a, *b, return_exceptions=True)
        await pipeline.close()


async def test_a_tenant_streaming_in_every_slot_is_paused_for_another_and_its_answers_end_whole(fleet) -> None:
    stub, model = fleet
    pipeline = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                        metrics=GatewayMetrics(CollectorRegistry()))
    principal = Principal(tenant="a", max_priority=P0, default_priority=P0)
    streaming = asyncio.Event()
    first_tokens = 0

    async def long_answer(i: int) -> tuple[str, int, float]:
        """A's answer of 1500 tokens (about 3 s of 2 ms steps), read whole: its text, tokens and end time."""
        nonlocal first_tokens
        request = GenerationRequest(model=model, messages=(Message("user", f"a {i} tell me everything"),),
                                    priority=P0, sampling=Sampling(max_tokens=1500))
        now = time.monotonic()
        stream = await pipeline.open(principal, request, Cost(prompt_tokens=8, max_tokens=1500),
                                     request_id=f"a-{i}", model=model, arrived=now, deadline=now + 60)
        text, tokens = "", 0
        async for event in stream.events():
            if isinstance(event, TextDelta):
                if not text:
                    first_tokens += 1
                    if first_tokens == SLOTS:
                        streaming.set()
                text += event.text
            elif isinstance(event, StreamEnd):
                tokens = event.completion_tokens
        return text, tokens, time.monotonic()

    a = [asyncio.ensure_future(long_answer(i)) for i in range(SLOTS)]
    b: list[asyncio.Future[tuple[int, float, float]]] = []
    try:
        await asyncio.wait_for(streaming.wait(), timeout=30)  # every slot holds an answer of A past its first token
        b += [asyncio.ensure_future(answer(pipeline, "b", i, model, prompt_words=8, max_tokens=8)) for i in range(2)]
        served_b = await asyncio.wait_for(asyncio.gather(*b), timeout=30)
        assert [tokens for tokens, _, _ in served_b] == [8, 8]
        assert pipeline.metrics.preempted.labels("mid_stream")._value.get() >= 1  # an answer of A was paused
        finished_a = await asyncio.wait_for(asyncio.gather(*a), timeout=60)
        # each answer of A whole: every token once, nothing lost or repeated across the pause
        assert [(text, tokens) for text, tokens, _ in finished_a] == [(" tok" * 1500, 1500)] * SLOTS
        assert max(end for _, _, end in served_b) < min(end for _, _, end in finished_a)  # B did not wait for A's ends
    finally:
        for task in a + b:
            task.cancel()
        await asyncio.gather(*a, *b, return_exceptions=True)
        await pipeline.close()
