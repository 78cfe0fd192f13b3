"""The worker's gRPC API on a localhost socket, with the simulated engine behind the real servicer: what a caller (the
gateway) reads in the stream's usage."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_inference.config import InferenceSettings
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.sim_engine import SimEngine, SimParams


@pytest.fixture
async def worker() -> AsyncIterator[tuple[inference_pb2_grpc.InferenceStub, CollectorRegistry]]:
    engine = SimEngine(InferenceSettings(engine="sim", max_model_len=4096), params=SimParams(time_scale=0.01))
    registry = CollectorRegistry()
    server = aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(engine, worker_id="w1", metrics=WorkerMetrics(registry, engine)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await engine.start()
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield inference_pb2_grpc.InferenceStub(channel), registry
    finally:
        await channel.close()
        await server.stop(None)
        await engine.shutdown()


async def _usage(stub: inference_pb2_grpc.InferenceStub, request_id: str, prompt: str) -> types_pb2.Usage:
    request = inference_pb2.GenerateRequest(request_id=request_id, prompt=prompt, tenant="acme",
                                            sampling=types_pb2.SamplingParams(max_tokens=3))
    chunks = [chunk async for chunk in stub.Generate(request)]
    assert chunks[-1].WhichOneof("kind") == "finished"
    return chunks[-1].finished.usage


async def test_generate_reports_the_prompt_tokens_served_from_the_prefix_cache_in_its_usage(
        worker: tuple[inference_pb2_grpc.InferenceStub, CollectorRegistry]) -> None:
    stub, registry = worker
    prompt = "You are the support assistant of the handbook. " * 30
    first = await _usage(stub, "r1", prompt)
    second = await _usage(stub, "r2", prompt)
    assert first.cached_tokens == 0 and first.prompt_tokens == second.prompt_tokens > 300
    assert 0 < second.cached_tokens < second.prompt_tokens  # part of the prompt, never all of it
    assert second.total_tokens == second.prompt_tokens + second.completion_tokens  # cached tokens are not extra
    assert registry.get_sample_value("goodput_worker_cached_prompt_tokens_total") == second.cached_tokens
