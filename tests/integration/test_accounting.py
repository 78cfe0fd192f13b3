"""Every way an answer leaves the gateway is accounted the same: chat and completions over REST, the Responses API,
gRPC, a resumed stream and a job run by the jobs worker each count once against their class's SLO (and as goodput
when they meet it), take a feedback record under the id the caller was given, and are offered to the workload trace.
The generation records its own outcome when it is closed, so an API that forgets to ask cannot skip it.

Real processes: an inference worker on the simulated engine and the scheduler; one gateway in this process, its
feedback and stream buffers in Redis; the jobs worker's runner in this process too, as the Celery task runs it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from prometheus_client import CollectorRegistry

from goodput_testing import SimBackend, async_wait_until, free_port, sim_backend

from goodput_gateway.__main__ import build
from goodput_gateway.config import GatewaySettings
from goodput_gateway.jobs import JobQueue
from goodput_gateway.worker import JobRunner, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "test-key-accounting"
KEYS = json.dumps({"keys": [{"key": KEY, "tenant": "acme", "max_priority": "P0"}]})
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimBackend]:
    with sim_backend(tmp_path_factory.mktemp("accounting-logs")) as running:
        yield running


@pytest.fixture
def settings(backend: SimBackend, redis_url: str, redis_prefix: str, tmp_path: Path) -> GatewaySettings:
    """The gateway's settings, which its jobs worker shares: every answer traced, feedback and streams in Redis."""
    return GatewaySettings(**{  # type: ignore[arg-type]
        "api_keys": KEYS, "scheduler_addr": backend.scheduler_addr, "http_port": free_port(),
        "grpc_port": free_port(), "models_cache_s": 0.0, "drain_grace_s": 0.5, "redis_url": redis_url,
        "quota_redis_url": redis_url, "quotas": {"prefix": f"{redis_prefix}:quota"},
        "metering": {"usage_prefix": f"{redis_prefix}:usage"}, "responses": {"prefix": f"{redis_prefix}:responses"},
        "feedback": {"prefix": f"{redis_prefix}:feedback", "flush_s": 0.05},
        "resume": {"prefix": f"{redis_prefix}:streams", "window_s": 30.0},
        "jobs": {"prefix": f"{redis_prefix}:jobs", "park_shed_p2": False},
        "trace": {"path": str(tmp_path / "trace.jsonl"), "sample": 1.0}})


class Gateway:
    def __init__(self, settings: GatewaySettings, registry: CollectorRegistry, http: httpx.AsyncClient,
                 grpc_stub: gateway_pb2_grpc.GatewayStub) -> None:
        self.settings, self.registry, self.http, self.grpc = settings, registry, http, grpc_stub

    def answered(self, registry: CollectorRegistry | None = None) -> tuple[float, float]:
        """Answers judged against their SLO (met or missed), and the goodput tokens, so far."""
        slo = goodput = 0.0
        for family in (registry or self.registry).collect():
            for sample in family.samples:
                if sample.name == "goodput_gateway_slo_requests_total":
                    slo += sample.value
                elif sample.name == "goodput_gateway_goodput_tokens_total":
                    goodput += sample.value
        return slo, goodput

    async def traced(self, max_tokens: int) -> bool:
        """Whether the workload trace holds an answer that asked for ``max_tokens``."""
        path = Path(self.settings.trace.path)
        lines = path.read_text().splitlines() if path.exists() else []
        return any(json.loads(line).get("max_tokens") == max_tokens for line in lines)

    async def feedback(self, answer_id: str) -> bool:
        """Whether the answer takes feedback under ``answer_id`` (on its way to Redis, it may take a flush)."""
        resp = await self.http.post("/v1/feedback", json={"request_id": answer_id, "verdict": "used"})
        return resp.status_code == 200


@pytest.fixture
async def gateway(settings: GatewaySettings, backend: SimBackend) -> AsyncIterator[Gateway]:
    registry = CollectorRegistry()
    runner = build(settings, registry, None)
    await runner.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=60, headers=AUTH)
    try:
        async def serving() -> bool:
            return bool((await http.get("/v1/models")).json().get("data"))
        await async_wait_until(serving, timeout=60, interval=0.2, message=f"no model (logs in {backend.logs})")
        yield Gateway(settings, registry, http, gateway_pb2_grpc.GatewayStub(channel))
    finally:
        await http.aclose()
        await channel.close()
        await runner.stop()


async def accounted(gw: Gateway, before: tuple[float, float], answer_id: str, max_tokens: int, *,
                    completion_tokens: int, registry: CollectorRegistry | None = None) -> None:
    """One more answer judged against its SLO (its tokens goodput when it met it), a feedback record under the id
    its caller was given, and a trace line."""
    slo, goodput = gw.answered(registry)
    assert slo == before[0] + 1
    assert goodput in (before[1], before[1] + completion_tokens)
    assert await async_wait_until(lambda: gw.feedback(answer_id), timeout=10, interval=0.1) is True
    assert await async_wait_until(lambda: gw.traced(max_tokens), timeout=10, interval=0.1) is True


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens, **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions_are_accounted(gateway: Gateway, stream: bool) -> None:
    before, max_tokens = gateway.answered(), 11 + stream
    resp = await gateway.http.post("/v1/chat/completions", json=chat(max_tokens, stream=stream))
    assert resp.status_code == 200, resp.text
    first = next(line for line in resp.text.splitlines() if line.startswith("data: ")) if stream else ""
    answer_id = json.loads(first[6:])["id"] if stream else resp.json()["id"]
    await accounted(gateway, before, answer_id, max_tokens, completion_tokens=max_tokens)


async def test_completions_are_accounted(gateway: Gateway) -> None:
    before = gateway.answered()
    resp = await gateway.http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 13})
    assert resp.status_code == 200, resp.text
    await accounted(gateway, before, resp.json()["id"], 13, completion_tokens=13)


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_are_accounted_with_their_deadline_and_request_metric(gateway: Gateway, stream: bool) -> None:
    before, max_tokens = gateway.answered(), 14 + stream
    resp = await gateway.http.post("/v1/responses", json={"input": "Say something.", "max_output_tokens": max_tokens,
                                                          "stream": stream})
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"] if not stream else resp.headers["x-goodput-stream-id"]
    await accounted(gateway, before, rid, max_tokens, completion_tokens=max_tokens)
    assert gateway.registry.get_sample_value("goodput_gateway_requests_total",
                                             {"route": "responses", "code": "200", "priority": "P0"}) >= 1
    # the caller's deadline holds here as on chat: one no class can meet is refused before a worker is asked
    late = await gateway.http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 5},
                                   headers={"X-Goodput-Deadline-Ms": "0.001"})
    assert late.status_code in (429, 504), late.text
    assert gateway.registry.get_sample_value("goodput_gateway_requests_total",
                                             {"route": "responses", "code": str(late.status_code),
                                              "priority": "unspecified"}) == 1


async def test_grpc_answers_are_accounted(gateway: Gateway) -> None:
    before = gateway.answered()
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="Say something.")],
                                          sampling=types_pb2.SamplingParams(max_tokens=16))
    answer = await gateway.grpc.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
    assert answer.usage.completion_tokens == 16
    await accounted(gateway, before, answer.request_id, 16, completion_tokens=16)


async def test_a_resumed_stream_is_accounted_once(gateway: Gateway) -> None:
    before = gateway.answered()
    async with gateway.http.stream("POST", "/v1/chat/completions", json=chat(40, stream=True)) as resp:
        stream_id = resp.headers["x-goodput-stream-id"]
        lines = resp.aiter_lines()
        for _ in range(3):  # a few events, then the connection drops
            await anext(lines)
    async with gateway.http.stream("GET", f"/v1/streams/{stream_id}",
                                   headers={"Last-Event-ID": f"{stream_id}:0"}) as rest:
        assert rest.status_code == 200
        assert "[DONE]" in "".join([line async for line in rest.aiter_lines()])
    await accounted(gateway, before, stream_id, 40, completion_tokens=40)


async def test_a_job_is_accounted_by_the_jobs_worker(gateway: Gateway, settings: GatewaySettings,
                                                     redis_url: str) -> None:
    queue = JobQueue(settings, redis.Redis.from_url(redis_url), send=lambda *_: None)  # run here, not via Celery
    job = queue.submit(tenant="acme", route="chat", body=chat(17))
    registry = CollectorRegistry()  # the jobs worker's /metrics
    runner = JobRunner(settings, registry=registry)
    before = gateway.answered(registry)
    try:
        done = await asyncio.to_thread(run_job, queue, job.id, runner=runner, dispatch=1)
        assert done is not None and done.state == "completed", done
        await accounted(gateway, before, done.result["id"], 17, completion_tokens=17, registry=registry)
    finally:
        await asyncio.to_thread(runner.close)
