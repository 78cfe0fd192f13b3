"""A worker lost mid-stream, end to end: the gateway against a scheduler process and two simulated worker processes
over gRPC on localhost, the worker streaming the answers killed (SIGKILL) after some of their tokens reached the
callers.

* Killed while serving several requests (an operator's kill, a lost node): each answer goes on on the other worker
  from the tokens already sent (their continuation), so every caller reads its whole answer, every token once, with
  no error; the dead worker's leases are released as failed, and no request is quarantined.
* Killed while holding one request alone: the request is suspected of the crash (goodput_gateway.quarantine). It is
  not tried on the other worker; its caller gets ``request_quarantined``; sent again it is refused (422 on REST,
  FAILED_PRECONDITION on gRPC) without reaching any worker; a different request is served; the counter counts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.sampling import Sampling
from goodput_testing import ServiceProcess, async_wait_until, free_port, sim_worker_env

from goodput_gateway.__main__ import build
from goodput_gateway.auth import Principal
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.requests import Cost, GenerationRequest, Message
from goodput_gateway.stream import GenerationStream

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0
TOKENS = 1500  # about 3 s of 2 ms steps: the kill comes well inside the answer
SIM = '{"time_scale": 1.0, "step_base_s": 0.002, "step_per_seq_s": 0.0}'
KEY = "test-key-failover"


@pytest.fixture
async def fleet(service_processes) -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, dict[int, ServiceProcess],  # type: ignore[no-untyped-def]
                                                          str]]:
    """The scheduler's stub, the two workers by port, and the scheduler's address."""
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
    yield stub, workers, f"127.0.0.1:{port}"
    await channel.close()


def _port(worker_id: str) -> int:
    return int(worker_id.rsplit(":", 1)[1])


async def test_a_worker_killed_mid_stream_is_invisible_to_its_callers(fleet) -> None:  # type: ignore[no-untyped-def]
    stub, workers, _ = fleet
    pipeline = Pipeline(GatewaySettings(), scheduler=stub, channel_factory=aio.insecure_channel,
                        metrics=GatewayMetrics(registry := CollectorRegistry()))
    try:
        models = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        model = models.workers[0].model.served_model_name
        streams: list[tuple[GenerationStream, AsyncIterator[TextDelta | StreamEnd]]] = []
        for i in range(4):  # over two workers: one serves at least two of them
            request = GenerationRequest(model=model, messages=(Message("user", f"tell me everything, {i}"),),
                                        priority=P0, sampling=Sampling(max_tokens=TOKENS))
            now = time.monotonic()
            stream = await pipeline.open(Principal(tenant="acme", max_priority=P0, default_priority=P0), request,
                                         Cost(prompt_tokens=8, max_tokens=TOKENS), request_id=f"failover-{i}",
                                         model=model, arrived=now, deadline=now + 60)
            streams.append((stream, stream.events()))
        texts = ["" for _ in streams]
        for i, (_, events) in enumerate(streams):
            while len(texts[i]) < 100 * len(" tok"):  # some of each answer reached its caller
                event = await asyncio.wait_for(anext(events), timeout=30)
                assert isinstance(event, TextDelta)
                texts[i] += event.text
        ports = [_port(stream.start.worker_id) for stream, _ in streams]
        busiest = max(set(ports), key=ports.count)
        assert ports.count(busiest) >= 2
        workers[busiest].kill()
        for i, (_, events) in enumerate(streams):
            end = None
            async for event in events:
                if isinstance(event, TextDelta):
                    texts[i] += event.text
                else:
                    end = event
            assert isinstance(end, StreamEnd) and end.completion_tokens == TOKENS and end.finish_reason == "length"
            assert texts[i] == " tok" * TOKENS  # every token once: nothing lost or repeated across the failover
        assert pipeline.metrics.worker_failures.labels("mid_stream")._value.get() == ports.count(busiest)
        assert not [s for f in registry.collect() if f.name == "goodput_gateway_poison_requests" for s in f.samples]
    finally:
        await pipeline.close()


async def _seen(address: str) -> int:
    """Requests the worker at ``address`` has taken: finished, aborted or running."""
    async with grpc.aio.insecure_channel(address) as channel:
        load = await inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
    return load.finished_total + load.aborted_total + load.running


async def test_a_request_whose_worker_dies_holding_it_is_not_retried_and_is_then_refused_before_any_worker(  # type: ignore[no-untyped-def]
        fleet) -> None:
    stub, workers, scheduler_addr = fleet
    settings = GatewaySettings(api_keys=json.dumps({"keys": [{"key": KEY, "tenant": "acme", "max_priority": "P0"}]}),
                               scheduler_addr=scheduler_addr, http_port=free_port(), grpc_port=free_port(),
                               models_cache_s=0.0, drain_grace_s=0.5)
    registry = CollectorRegistry()
    runner = build(settings, registry, None)
    await runner.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=60,
                             headers={"Authorization": f"Bearer {KEY}"})
    try:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        poison = {"model": model, "messages": [{"role": "user", "content": "the prompt that crashes engines"}],
                  "max_tokens": TOKENS}
        lines: list[str] = []
        async with http.stream("POST", "/v1/chat/completions", json={**poison, "stream": True}) as resp:
            assert resp.status_code == 200
            stream = resp.aiter_lines()
            while sum(line.startswith("data: ") for line in lines) < 20:  # the answer is under way
                lines.append(await anext(stream))
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            serving = next(w.address for w in listed.workers if w.inflight)
            other = next(f"127.0.0.1:{p}" for p in workers if f"127.0.0.1:{p}" != serving)
            seen = await _seen(other)
            workers[_port(serving)].kill()  # the worker dies holding it alone
            lines += [line async for line in stream]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["code"] == "request_quarantined", events[-1]  # an error: not continued
        assert "data: [DONE]" not in lines
        assert await _seen(other) == seen  # the other worker never had it

        # Sent again, on either API: refused before any worker (nor the scheduler's queue) sees it.
        again = await http.post("/v1/chat/completions", json=poison)
        assert again.status_code == 422, again.text
        error = again.json()["error"]
        assert error["code"] == "request_quarantined" and error["type"] == "invalid_request_error"
        assert int(again.headers["Retry-After"]) > 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                model=model, messages=[types_pb2.ChatMessage(role="user", content=poison["messages"][0]["content"])],
                sampling=types_pb2.SamplingParams(max_tokens=TOKENS)),
                metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(refused.value.trailing_metadata() or ())["goodput-error-code"] == "request_quarantined"
        assert await _seen(other) == seen

        # Another request is served (by the other worker: the dead one is ejected, or refuses before accepting).
        fine = await http.post("/v1/chat/completions", json={**poison, "max_tokens": 4,
                                                              "messages": [{"role": "user", "content": "hello"}]})
        assert fine.status_code == 200, fine.text
        assert await _seen(other) == seen + 1

        counted = {s.labels["event"]: s.value for f in registry.collect() if f.name == "goodput_gateway_poison_requests"
                   for s in f.samples if s.name.endswith("_total")}
        assert counted == {"crashed_alone": 1.0, "refused": 2.0}
    finally:
        await http.aclose()
        await channel.close()
        await runner.stop()
