"""The server bootstrap against a real grpc.aio server on localhost: error mapping (unary and streaming, with
retry-after), health, reflection, metrics and trace propagation from client to server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from goodput_core.clients import make_channel
from goodput_core.errors import InvalidArgument, ResourceExhausted, from_rpc_error
from goodput_core.server import ServiceRunner
from goodput_core.settings import ServiceSettings, service_config
from goodput_testing import async_wait_until


class _Settings(ServiceSettings):
    model_config = service_config("GOODPUT_TESTSVC_")


class _Servicer(inference_pb2_grpc.InferenceServicer):
    async def GetLoad(self, request: inference_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> None:
        raise ResourceExhausted("busy", retry_after_s=2.5)

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(served_model_name="m")

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateChunk]:
        yield inference_pb2.GenerateChunk(delta=inference_pb2.Delta(text="a"))
        raise InvalidArgument("bad prompt")


@pytest.fixture
async def served() -> AsyncIterator[tuple[ServiceRunner, InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = _Settings(grpc_port=0, http_port=0, drain_grace_s=1)
    runner = ServiceRunner(name="test", settings=settings, registry=CollectorRegistry(), provider=provider)
    runner.add(inference_pb2_grpc.add_InferenceServicer_to_server, _Servicer(), "goodput.inference.v1.Inference")
    await runner.start()
    yield runner, exporter, provider
    await runner.stop()


async def test_domain_errors_map_to_status_and_retry_after(served) -> None:  # type: ignore[no-untyped-def]
    runner, _, provider = served
    async with make_channel(f"127.0.0.1:{runner.grpc_port}", provider) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.GetLoad(inference_pb2.GetLoadRequest())
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = from_rpc_error(exc.value)
        assert isinstance(err, ResourceExhausted) and err.retry_after_s == pytest.approx(2.5)
        assert err.http_status == 429 and err.openai_body()["error"]["type"] == "rate_limit_error"

        call = stub.Generate(inference_pb2.GenerateRequest())
        first = await call.read()
        assert first.delta.text == "a"
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details() == "bad prompt"


async def test_health_reflection_and_drain(served) -> None:  # type: ignore[no-untyped-def]
    runner, _, provider = served
    async with make_channel(f"127.0.0.1:{runner.grpc_port}", provider) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "goodput.inference.v1.Inference"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        services = [s.name async for r in refl.ServerReflectionInfo(ask()) for s in r.list_services_response.service]
        assert "goodput.inference.v1.Inference" in services
        await runner.set_serving(False)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_trace_context_crosses_the_hop(served) -> None:  # type: ignore[no-untyped-def]
    runner, exporter, provider = served
    tracer = provider.get_tracer("test")
    async with make_channel(f"127.0.0.1:{runner.grpc_port}", provider) as ch:
        with tracer.start_as_current_span("caller") as parent:
            await inference_pb2_grpc.InferenceStub(ch).GetModelInfo(inference_pb2.GetModelInfoRequest())
    trace_id = parent.get_span_context().trace_id

    def kinds() -> set[str]:
        return {s.kind.name for s in exporter.get_finished_spans()
                if s.context.trace_id == trace_id and "GetModelInfo" in s.name}

    # the server's span ends in the server's task, after the response has reached the client
    await async_wait_until(lambda: kinds() == {"CLIENT", "SERVER"}, timeout=5,
                           message=f"one trace across the hop, got {kinds()}")


async def test_metrics_count_calls_by_code() -> None:
    registry = CollectorRegistry()
    settings = _Settings(grpc_port=0, http_port=0)
    runner = ServiceRunner(name="t", settings=settings, registry=registry, provider=None)
    runner.add(inference_pb2_grpc.add_InferenceServicer_to_server, _Servicer(), "goodput.inference.v1.Inference")
    await runner.start()
    try:
        async with make_channel(f"127.0.0.1:{runner.grpc_port}", None) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await inference_pb2_grpc.InferenceStub(ch).GetLoad(inference_pb2.GetLoadRequest())
        # The server counts the call once its handler returned, which the client may see the status before.
        await async_wait_until(lambda: registry.get_sample_value("goodput_grpc_server_handled_total", {
            "service": "goodput.inference.v1.Inference", "method": "GetLoad", "code": "RESOURCE_EXHAUSTED"}) == 1,
            timeout=5, message="the call was not counted as RESOURCE_EXHAUSTED")
    finally:
        await runner.stop()


async def test_http_side_port_serves_metrics_and_healthz(unused_tcp_port: int) -> None:
    registry = CollectorRegistry()
    settings = _Settings(grpc_port=0, http_port=unused_tcp_port)
    runner = ServiceRunner(name="t", settings=settings, registry=registry, provider=None)
    await runner.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{unused_tcp_port}") as client:
            async def healthz() -> httpx.Response | None:
                try:
                    return await client.get("/healthz")
                except httpx.ConnectError:
                    return None  # the side port's server starts in the background

            r = await async_wait_until(healthz, timeout=5, message="/healthz never answered")
            assert r.status_code == 200
            assert (await client.get("/metrics")).status_code == 200
    finally:
        await runner.stop()
