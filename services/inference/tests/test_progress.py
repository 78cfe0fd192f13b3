"""A hung engine is noticed by its lack of progress, not by liveness: while a generation runs and no output comes
for STALL_AFTER_S, GetLoad reports it stalled and the watchdog turns the worker NOT_SERVING (the scheduler then
places nothing there); when output comes again it serves again. The engine here is the simulated one behind a gate
that freezes it (its process keeps answering gRPC, as a worker whose engine core is stopped does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import GenEvent, GenRequest, Started
from goodput_inference.progress import Progress
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.sim_engine import SimEngine, SimParams


class Freezable(SimEngine):
    """The simulated engine, whose output stops while ``running`` is cleared."""

    def __init__(self) -> None:
        super().__init__(InferenceSettings(engine="sim", max_model_len=4096), params=SimParams(time_scale=0.05))
        self.running = asyncio.Event()
        self.running.set()

    async def generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        async for event in super().generate(req):
            await self.running.wait()
            yield event


async def test_a_frozen_engine_is_reported_stalled_and_the_worker_stops_serving_until_it_moves() -> None:
    engine = Freezable()
    progress = Progress(stall_after_s=0.5)
    server = aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(engine, worker_id="w1", metrics=WorkerMetrics(CollectorRegistry(), engine),
                          progress=progress), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await engine.start()
    await server.start()
    changes: list[bool] = []

    async def on_change(stalled: bool) -> None:
        changes.append(stalled)

    watchdog = asyncio.ensure_future(progress.watch(on_change, interval_s=0.1))
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    try:
        await asyncio.sleep(1.0)
        assert changes == [] and (await stub.GetLoad(inference_pb2.GetLoadRequest())).stalled_s == 0  # idle
        call = stub.Generate(inference_pb2.GenerateRequest(request_id="r1", prompt="hello " * 20,
                                                           sampling=types_pb2.SamplingParams(max_tokens=400)))
        await call.read()  # started
        await call.read()  # a token
        engine.running.clear()  # the engine freezes; the worker still answers
        await asyncio.sleep(1.2)
        load = await stub.GetLoad(inference_pb2.GetLoadRequest())
        assert load.stalled_s > 0.5 and changes == [True]
        engine.running.set()  # it moves again
        await call.read()
        await asyncio.sleep(0.4)
        assert changes == [True, False]
        assert (await stub.GetLoad(inference_pb2.GetLoadRequest())).stalled_s == 0
        call.cancel()
    finally:
        watchdog.cancel()
        await channel.close()
        await server.stop(None)
        await engine.shutdown()


class FrozenCore(Freezable):
    """Like vLLM's adapter: a request is accepted (``Started``) by the worker's process before the engine core sees
    it, so while only the core is frozen new requests still start."""

    async def generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        async for event in SimEngine.generate(self, req):
            if not isinstance(event, Started):
                await self.running.wait()
            yield event


async def test_requests_that_keep_arriving_at_a_frozen_engine_do_not_count_as_its_progress() -> None:
    engine = FrozenCore()
    progress = Progress(stall_after_s=0.5)
    servicer = InferenceServicer(engine, worker_id="w1", metrics=WorkerMetrics(CollectorRegistry(), engine),
                                 progress=progress)
    server = aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await engine.start()
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    calls = []

    def generate(request_id: str) -> aio.UnaryStreamCall:
        call = stub.Generate(inference_pb2.GenerateRequest(request_id=request_id, prompt="hello " * 20,
                                                           sampling=types_pb2.SamplingParams(max_tokens=400)))
        calls.append(call)
        return call

    try:
        first = generate("r0")
        await first.read()  # started
        await first.read()  # a token
        engine.running.clear()  # the engine core freezes; the worker goes on accepting requests
        for i in range(1, 8):  # steady traffic: a new request every 0.2 s, each answered with its Started
            await generate(f"r{i}").read()
            await asyncio.sleep(0.2)
        assert progress.stalled(), "new requests' Started events hid the frozen engine"
        engine.running.set()
        await first.read()
        assert not progress.stalled()
    finally:
        for call in calls:
            call.cancel()
        await channel.close()
        await server.stop(None)
        await engine.shutdown()
