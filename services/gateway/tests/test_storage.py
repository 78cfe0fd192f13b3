"""Per-tenant storage quotas (goodput_gateway.storage) against the real Redis: a tenant's flood is refused by its own
quota before anything is written, while another tenant keeps working; deleting or expiring gives the place back;
two gateway replicas share the count; each store kind's limit holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from goodput.common.v1 import types_pb2
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.errors import ResourceExhausted
from goodput_testing import RedisServer

from goodput_gateway.__main__ import compose
from goodput_gateway.api import create_app
from goodput_gateway.auth import ApiKeyStore, parse_keys_document
from goodput_gateway.config import GatewaySettings
from goodput_gateway.feedback import FeedbackStore, _Answer
from goodput_gateway.jobs import JobQueue
from goodput_gateway.jobs.parking import Parked, park
from goodput_gateway.profile import LatencyProfile
from goodput_gateway.requests import GenerationRequest, Message
from goodput_gateway.responses import ResponseStore
from goodput_gateway.storage import StorageLedger, StorageQuota
from goodput_gateway.timing import TimingMetrics

from .helpers import FakeClock, assert_openai_error

LIMITS = {"files": 3, "file_bytes": 4096, "batches": 1, "batch_lines": 3, "jobs": 2, "responses": 1}
KEYS = json.dumps({"defaults": {"storage": LIMITS},
                   "keys": [{"key": "k-a", "tenant": "a", "max_priority": "P2"},
                            {"key": "k-b", "tenant": "b", "max_priority": "P2"}]})
A, B = {"Authorization": "Bearer k-a"}, {"Authorization": "Bearer k-b"}


def settings(redis_url: str, prefix: str) -> GatewaySettings:
    return GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1", redis_url=redis_url,
                           jobs={"prefix": f"{prefix}:jobs"}, quotas={"prefix": f"{prefix}:quota"},
                           responses={"prefix": f"{prefix}:responses"}, feedback={"prefix": f"{prefix}:feedback"})


@pytest.fixture
async def replicas(redis_url: str, redis_prefix: str) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Two gateway apps (each its own clients, as two replicas) over the same Redis; job messages go nowhere."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(2):
            s = settings(redis_url, redis_prefix)
            client = redis.Redis.from_url(redis_url)
            stack.callback(client.close)
            queue = JobQueue(s, client, send=lambda job_id, dispatch, delay_s: None)
            registry = CollectorRegistry()
            wiring = compose(s, registry, None, jobs=queue)
            stack.push_async_callback(wiring.close)
            app = create_app(wiring.service, tracer=TracerProvider().get_tracer("test"),
                             ready=lambda: True, jobs_queue=queue, responses_store=wiring.responses)
            clients.append(await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")))
        yield clients


def batch_line(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


async def upload(http: httpx.AsyncClient, headers: dict[str, str], content: bytes | None = None) -> httpx.Response:
    content = content if content is not None else json.dumps(batch_line("x")).encode() + b"\n"
    return await http.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)},
                           data={"purpose": "batch"})


async def test_a_file_flood_is_refused_by_its_tenants_quota_while_another_tenant_keeps_working(
        replicas: list[httpx.AsyncClient]) -> None:
    one, two = replicas
    kept = [await upload(replicas[i % 2], A) for i in range(3)]  # both replicas count into one ledger
    assert all(r.status_code == 200 for r in kept), [r.text for r in kept]
    for http in replicas:
        error = assert_openai_error(await upload(http, A), 429)
        assert error["code"] == "insufficient_quota"
        assert "3 of its 3 files" in error["message"] and "of its 4096" in error["message"]
    listed = (await one.get("/v1/files", headers=A)).json()["data"]
    assert sorted(f["id"] for f in listed) == sorted(r.json()["id"] for r in kept)  # the refused were not written

    other = await upload(two, B)  # tenant B: its own quota, untouched by A's flood
    assert other.status_code == 200, other.text
    batch = await two.post("/v1/batches", headers=B, json={"input_file_id": other.json()["id"],
                                                           "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"})
    assert batch.status_code == 200, batch.text

    assert (await two.delete(f"/v1/files/{kept[0].json()['id']}", headers=A)).status_code == 200
    assert (await one.post("/v1/files", headers=A, files={"file": ("in.jsonl", b"{}\n")},
                           data={"purpose": "batch"})).status_code == 200  # the delete gave the place back
    assert_openai_error(await upload(two, A), 429)


async def test_a_file_larger_than_its_tenants_byte_limit_is_413_naming_the_limit(
        replicas: list[httpx.AsyncClient]) -> None:
    error = assert_openai_error(await upload(replicas[0], A, b"x" * 5000), 413)
    assert error["code"] == "object_too_large" and "file_bytes limit is 4096" in error["message"]
    assert (await replicas[0].get("/v1/files", headers=A)).json()["data"] == []


async def test_batches_and_their_lines_are_bounded_per_tenant(replicas: list[httpx.AsyncClient]) -> None:
    one, two = replicas

    async def create(http: httpx.AsyncClient, lines: int) -> httpx.Response:
        content = "".join(json.dumps(batch_line(f"r{i}")) + "\n" for i in range(lines)).encode()
        f = await upload(http, A, content)
        assert f.status_code == 200, f.text
        return await http.post("/v1/batches", headers=A, json={"input_file_id": f.json()["id"],
                                                               "endpoint": "/v1/chat/completions",
                                                               "completion_window": "24h"})

    too_long = assert_openai_error(await create(one, 4), 413)
    assert "batch_lines limit is 3" in too_long["message"]
    assert (await create(one, 2)).status_code == 200
    second = assert_openai_error(await create(two, 1), 429)
    assert second["code"] == "insufficient_quota" and "1 of its 1 batches" in second["message"]
    assert len((await two.get("/v1/batches", headers=A)).json()["data"]) == 1


async def test_jobs_are_bounded_per_tenant(replicas: list[httpx.AsyncClient]) -> None:
    body = {"endpoint": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    for http in replicas:
        assert (await http.post("/v1/jobs", headers=A, json=body)).status_code == 202
    error = assert_openai_error(await replicas[0].post("/v1/jobs", headers=A, json=body), 429)
    assert error["code"] == "insufficient_quota" and "2 of its 2 jobs" in error["message"]
    assert (await replicas[1].post("/v1/jobs", headers=B, json=body)).status_code == 202


async def test_a_response_is_refused_before_it_is_generated_once_the_tenant_keeps_its_limit(
        replicas: list[httpx.AsyncClient], redis_url: str, redis_prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = ResponseStore(settings(redis_url, redis_prefix), redis=client)
    quota = StorageQuota(**LIMITS)
    try:
        await store.put("a", {"id": "resp_1"}, [], quota=quota)
        with pytest.raises(ResourceExhausted, match="1 of its 1 responses"):
            await store.put("a", {"id": "resp_2"}, [], quota=quota)
        assert await client.get(store._key("a", "resp_2")) is None
        # over REST the refusal comes before any generation (no backend runs here: it would be a 503)
        refused = await replicas[0].post("/v1/responses", headers=A, json={"model": "m", "input": "hi"})
        assert assert_openai_error(refused, 429)["code"] == "insufficient_quota"
        unstored = await replicas[0].post("/v1/responses", headers=A, json={"model": "m", "input": "hi",
                                                                              "store": False})
        assert unstored.status_code == 503  # not stored, so not refused: it reached the (absent) scheduler
        await store.delete("a", "resp_1")
        await store.put("a", {"id": "resp_2"}, [], quota=quota)
    finally:
        await client.aclose()


async def test_answers_past_the_feedback_quota_stay_on_their_replica(redis_url: str, redis_prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    s = settings(redis_url, redis_prefix)
    store = FeedbackStore(s, redis=client, metrics=TimingMetrics(None, LatencyProfile()),
                          quota_of=lambda tenant: StorageQuota(feedback=2))
    try:
        for i in range(4):
            store.keep(_Answer(request_id=f"req-a{i}", tenant="a", model="m", priority=1, tokens=1))
        store.keep(_Answer(request_id="req-b0", tenant="b", model="m", priority=1, tokens=1))
        await store.settle()
        keys = await client.keys(f"{s.feedback.prefix}:*")
        stored = {(k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[1] for k in keys}
        assert stored == {"req-a0", "req-a1", "req-b0"}
        assert (await store.record("a", "req-a3", "used"))["verdict"] == "used"  # still known on this replica
    finally:
        await client.aclose()


def test_two_replicas_never_grant_more_than_the_limit_together(redis_url: str, redis_prefix: str) -> None:
    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    ledgers = [StorageLedger(c, prefix=redis_prefix) for c in clients]
    quota = StorageQuota(files=5, file_bytes=0)

    def reserve(i: int) -> bool:
        try:
            ledgers[i % 2].reserve("a", "files", f"file-{i}", amount=1, expires_at=4e9, quota=quota)
        except ResourceExhausted:
            return False
        return True

    try:
        with ThreadPoolExecutor(8) as pool:
            granted = sum(pool.map(reserve, range(40)))
        assert granted == 5 and ledgers[1].usage("a", "files") == (5, 5)
    finally:
        for c in clients:
            c.close()


def test_an_expired_object_gives_its_place_back_without_a_delete(redis_url: str, redis_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    now = float(int(time.time()))
    clock = FakeClock(now)  # the keys themselves expire in Redis' time: the clock starts at the real one
    ledger = StorageLedger(client, prefix=redis_prefix, clock=clock)
    quota = StorageQuota(jobs=1, job_bytes=100)
    try:
        ledger.reserve("a", "jobs", "job-1", amount=80, expires_at=now + 10, quota=quota)
        with pytest.raises(ResourceExhausted) as refused:
            ledger.reserve("a", "jobs", "job-2", amount=10, expires_at=now + 20, quota=quota)
        assert refused.value.retry_after_s == 10  # when the oldest expires
        ledger.reserve("a", "jobs", "job-1", amount=80, expires_at=now + 10, quota=quota)  # held: no change
        clock.advance(11)
        ledger.reserve("a", "jobs", "job-2", amount=10, expires_at=now + 20, quota=quota)
        assert ledger.usage("a", "jobs") == (1, 10)
    finally:
        client.close()


async def test_without_redis_the_limits_hold_in_this_process() -> None:
    store = ResponseStore(GatewaySettings(), redis=None)
    quota = StorageQuota(responses=1, response_bytes=1 << 20)
    await store.put("a", {"id": "resp_1"}, [], quota=quota)
    with pytest.raises(ResourceExhausted):
        await asyncio.wait_for(store.admit("a", quota), 1)
    await store.delete("a", "resp_1")
    await store.admit("a", quota)


async def test_a_responses_metadata_is_bounded_as_openais(replicas: list[httpx.AsyncClient]) -> None:
    for metadata in ({"k": "v" * 513}, {"k" * 65: "v"}, {f"k{i}": "v" for i in range(17)}):
        refused = await replicas[0].post("/v1/responses", headers=A, json={"model": "m", "input": "hi",
                                                                             "metadata": metadata})
        assert assert_openai_error(refused, 400)["param"].startswith("metadata")


async def test_a_shed_request_past_its_tenants_jobs_quota_gets_its_429_unparked(redis_url: str,
                                                                               redis_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    queue = JobQueue(settings(redis_url, redis_prefix), client, send=lambda job_id, dispatch, delay_s: None)
    principal = ApiKeyStore(parse_keys_document("inline", json.loads(KEYS))).authenticate("Bearer k-a")
    shed = ResourceExhausted("scheduler queue is full", code="queue_full", retry_after_s=0.1)
    request = GenerationRequest(messages=(Message("user", "hi"),), priority=types_pb2.PRIORITY_P2)
    try:
        outcomes = [await park(queue, shed, tenant="a", request=request, principal=principal) for _ in range(3)]
        assert [isinstance(o, Parked) for o in outcomes] == [True, True, False]  # jobs: 2
        assert outcomes[2] is shed and queue.count("parked") == 2
    finally:
        client.close()


async def test_a_full_data_redis_leaves_the_quota_counters_working(redis_url: str, redis_prefix: str) -> None:
    """The stores on their own Redis (REDIS_URL, here with room for 2 MiB, noeviction), the counters on
    QUOTA_REDIS_URL: a tenant without storage limits fills the data Redis, and another tenant's rate limit still
    holds from Redis (no decision taken fail-open)."""
    keys = json.dumps({"tenants": {"a": {"storage": {"files": 0, "file_bytes": 0}}, "b": {"rpm": 2}},
                       "keys": [{"key": "k-a", "tenant": "a", "max_priority": "P2"},
                                {"key": "k-b", "tenant": "b", "max_priority": "P2"}]})
    with RedisServer() as data:
        admin = redis.Redis.from_url(data.url)
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + (2 << 20))  # room for 2 MiB
        admin.close()
        s = settings(data.url, redis_prefix).model_copy(update={"api_keys": keys, "quota_redis_url": redis_url})
        client, ledger_client = redis.Redis.from_url(data.url), redis.Redis.from_url(redis_url)
        queue = JobQueue(s, client, send=lambda job_id, dispatch, delay_s: None,
                         ledger=StorageLedger(ledger_client, prefix=f"{redis_prefix}:quota:storage"))
        registry = CollectorRegistry()
        wiring = compose(s, registry, None, jobs=queue)
        app = create_app(wiring.service, tracer=TracerProvider().get_tracer("test"),
                         ready=lambda: True, jobs_queue=queue, responses_store=wiring.responses)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
                statuses = [(await upload(http, A, b"{}\n" * (200 << 10))).status_code for _ in range(12)]
                assert statuses[0] == 200 and statuses[-1] == 503, statuses  # the data Redis is full
                answers = [await http.post("/v1/embeddings", headers=B, json={"input": "hi"}) for _ in range(3)]
                assert [r.status_code for r in answers][:2] != [429, 429]
                assert assert_openai_error(answers[2], 429)["code"] == "rate_limit_exceeded"
                assert not registry.get_sample_value("goodput_quota_fail_open_total")
        finally:
            await wiring.close()
            client.close()
            ledger_client.close()
