"""The gateway's worker calls (one ``Inference/Generate`` per request), against a scheduler process and a simulated
worker process, and against in-process simulated workers (the real servicer) over gRPC on localhost: concurrent
answers are whole, a worker's refusal keeps its code and parameter, a caller that leaves aborts its request in the
engine, the token gate changes the relay's order and not the answers, a worker that dies fails its open generations
as worker-lost (retried on another before the first token), and a worker that stops answering does not hold a
request past its deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.errors import DeadlineExceeded, ErrorInterceptor, InvalidArgument, Unavailable
from goodput_core.sampling import Sampling
from goodput_testing import async_wait_until, free_port, sim_worker_env

from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.requests import Cost, GenerationRequest, Message
from goodput_gateway.stream import GenerationStream, Lease, WorkerLost
from goodput_gateway.tokengate import TokenGate
from goodput_inference.config import InferenceSettings
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.sim_engine import SimEngine, SimParams

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0
PRINCIPAL = Principal(tenant="t", max_priority=P0, default_priority=P0)


def _request(model: str, i: int, *, max_tokens: int = 4, words: int = 1) -> GenerationRequest:
    return GenerationRequest(model=model, messages=(Message("user", f"question {i} " + "word " * words),),
                             priority=P0, sampling=Sampling(max_tokens=max_tokens))


async def _answer(pipeline: Pipeline, model: str, i: int, **kw: int) -> tuple[str, StreamEnd]:
    request = _request(model, i, **kw)
    now = time.monotonic()
    stream = await pipeline.open(PRINCIPAL, request, Cost(prompt_tokens=8, max_tokens=request.sampling.max_tokens),
                                 request_id=f"r{i}", model=model, arrived=now, deadline=now + 30)
    text, ended = "", None
    async for event in stream.events():
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, StreamEnd):
            ended = event
    assert ended is not None
    return text, ended


@pytest.fixture
async def fleet(service_processes) -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, str]]:  # type: ignore[no-untyped-def]
    """A scheduler with one simulated worker process."""
    worker, port = free_port(), free_port()
    service_processes("goodput_inference", "worker", **sim_worker_env(worker, MAX_NUM_SEQS="64"))
    service_processes("goodput_scheduler", "scheduler", GOODPUT_SCHEDULER_WORKERS=f"127.0.0.1:{worker}",
                      GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(port),
                      GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def ready() -> bool:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return any(w.healthy for w in listed.workers)

    await async_wait_until(ready, timeout=30, interval=0.1, message="the scheduler's worker is healthy")
    yield stub, f"127.0.0.1:{worker}"
    await channel.close()


async def _load(address: str) -> inference_pb2.WorkerLoad:
    async with grpc.aio.insecure_channel(address) as channel:
        return await inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)


async def test_concurrent_answers_are_whole_refusals_keep_their_code_and_a_caller_gone_aborts(fleet) -> None:  # type: ignore[no-untyped-def]
    stub, worker = fleet
    model = (await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)).workers[0].model.served_model_name
    pipeline = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                        metrics=GatewayMetrics(CollectorRegistry()))
    try:
        answers = await asyncio.gather(*(_answer(pipeline, model, i, max_tokens=3 + i % 5) for i in range(16)))
        assert [end.completion_tokens for _, end in answers] == [3 + i % 5 for i in range(16)]
        assert all(text for text, _ in answers)

        # the worker's refusal reaches the caller with its code and parameter kept
        with pytest.raises(InvalidArgument) as refused:
            await _answer(pipeline, model, 99, words=200_000)
        assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"

        # a caller that goes away mid-stream aborts the request in the engine
        aborted = (await _load(worker)).aborted_total
        now = time.monotonic()
        stream = await pipeline.open(PRINCIPAL, _request(model, 7, max_tokens=2000), Cost(prompt_tokens=8,
                                     max_tokens=2000), request_id="gone", model=model, arrived=now, deadline=now + 30)
        events = stream.events()
        await anext(events)
        await events.aclose()
        await async_wait_until(lambda: _aborted_since(worker, aborted), timeout=10, interval=0.05,
                               message="the abandoned request aborted in the engine")
    finally:
        await pipeline.close()


async def test_a_token_gate_changes_the_order_of_the_relay_not_the_answers(fleet) -> None:  # type: ignore[no-untyped-def]
    """A gate of one later token per event-loop turn: a burst of later tokens waits its turns; every answer is still
    whole and the same as through the default gate."""
    stub, _ = fleet
    model = (await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)).workers[0].model.served_model_name
    gated = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                     metrics=GatewayMetrics(CollectorRegistry()))
    gated.token_gate = TokenGate(per_turn=1, on_park=gated.metrics.token_gate_parked.inc)
    plain = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                     metrics=GatewayMetrics(CollectorRegistry()))
    try:
        answers = await asyncio.gather(*(_answer(gated, model, i, max_tokens=4 + i % 4) for i in range(16)))
        expected = await asyncio.gather(*(_answer(plain, model, i, max_tokens=4 + i % 4) for i in range(16)))
        assert [(text, end.completion_tokens, end.finish_reason) for text, end in answers] == \
            [(text, end.completion_tokens, end.finish_reason) for text, end in expected]
        assert all(end.completion_tokens == 4 + i % 4 for i, (_, end) in enumerate(answers))
        assert gated.token_gate.parked > 0  # sixteen streams' tokens came together: some waited a turn
        assert gated.metrics.token_gate_parked._value.get() == gated.token_gate.parked
    finally:
        await gated.close()
        await plain.close()


async def _aborted_since(worker: str, before: int) -> bool:
    load = await _load(worker)
    return load.aborted_total == before + 1 and load.running == 0


class _Worker:
    """An in-process simulated worker (the real servicer) on a localhost port."""

    def __init__(self, servicer_class: type[InferenceServicer] = InferenceServicer, port: int = 0) -> None:
        self.engine = SimEngine(InferenceSettings(engine="sim", max_model_len=4096), params=SimParams(time_scale=0.05))
        self.servicer = servicer_class(self.engine, worker_id="w", metrics=WorkerMetrics(CollectorRegistry(),
                                                                                         self.engine))
        self.server = aio.server(interceptors=[ErrorInterceptor()])
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> _Worker:
        await self.engine.start()
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)
        await self.engine.shutdown()


def _pipeline(**settings: int) -> Pipeline:
    nowhere = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel("127.0.0.1:1"))  # no scheduler is asked here
    return Pipeline(GatewaySettings(**settings), scheduler=nowhere,
                    channel_factory=aio.insecure_channel, metrics=GatewayMetrics(CollectorRegistry()))


async def _stream_on(pipeline: Pipeline, address: str, i: int, *, max_tokens: int = 4,
                     deadline_s: float = 30.0) -> AsyncIterator[TextDelta | StreamEnd]:
    """Generation on the worker at ``address`` as if the scheduler had granted it (the pipeline's worker hop)."""
    return (await _generation(pipeline, address, i, max_tokens=max_tokens, deadline_s=deadline_s)).events()


async def _generation(pipeline: Pipeline, address: str, i: int, *, max_tokens: int = 4,
                      deadline_s: float = 30.0) -> GenerationStream:
    lease = Lease(worker_id="w", address=address)
    now = time.monotonic()
    call, start, span = await pipeline.start_worker(PRINCIPAL, _request("", i, max_tokens=max_tokens), lease,
                                                     request_id=f"r{i}", model="", deadline=now + deadline_s)
    lease.released = True  # no scheduler here: nothing to release
    return GenerationStream(pipeline, lease=lease, call=call, start=start, arrived=now, span=span)


async def test_a_worker_that_dies_fails_its_open_generations_as_worker_lost() -> None:
    pipeline = _pipeline()
    try:
        async with _Worker() as worker:
            streams = [await _stream_on(pipeline, worker.address, i, max_tokens=2000) for i in range(3)]
            for s in streams:
                await anext(s)
            await worker.server.stop(None)  # the worker goes away mid-stream
            for s in streams:
                with pytest.raises(Unavailable, match="failed mid-stream"):
                    async for _ in s:
                        pass
        # before it accepted a request, a dead worker is a worker lost (the pipeline retries that on another)

        with pytest.raises(WorkerLost):
            await _stream_on(pipeline, worker.address, 9)
    finally:
        await pipeline.close()


class _Silent(InferenceServicer):
    """A worker that takes generations and never answers (a stand-in for a hung worker process)."""

    cancelled: list[str]

    async def Generate(self, request, context):  # type: ignore[no-untyped-def, override]
        self.cancelled = []
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        yield  # pragma: no cover - never reached: an async generator that yields nothing


async def test_a_worker_that_stops_answering_does_not_hold_a_request_past_its_deadline() -> None:
    pipeline = _pipeline()
    try:
        async with _Worker(_Silent) as worker:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await _stream_on(pipeline, worker.address, 1, deadline_s=0.5)
            assert time.monotonic() - started < 5
            await async_wait_until(lambda: len(getattr(worker.servicer, "cancelled", [])) == 1, timeout=5,
                                   interval=0.02, message="the expired generation cancelled at the worker")
    finally:
        await pipeline.close()
