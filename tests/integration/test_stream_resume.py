"""Stream resume end to end (issue 21, part 4): a client whose connection drops mid-stream reconnects, on the other
gateway replica, with ``Last-Event-ID`` (REST) or its resume token (gRPC), and gets exactly the events it missed,
following the generation live: the same text as an uninterrupted answer, from the one generation that ran (the
worker served one request, the gateways counted one, the tenant was metered once). Another tenant's key, an unknown
id or a malformed one are refused; a generation nobody comes back for is cut after the window, as a dropped stream
was before resume.

Real processes: an inference worker on the simulated engine (no model loads; its answer is " tok" per token) and the
scheduler, on free ports; two gateway replicas in this process, on one Redis (the resume buffers, quotas, usage)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from prometheus_client import CollectorRegistry

from goodput_testing import SimBackend as Backend
from goodput_testing import async_wait_until, free_port, sim_backend

from goodput_gateway.__main__ import build
from goodput_gateway.config import GatewaySettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY, OTHER_KEY = "test-key-resume", "test-key-resume-other"
KEYS = json.dumps({"keys": [{"key": KEY, "tenant": "acme", "max_priority": "P0"},
                            {"key": OTHER_KEY, "tenant": "globex", "max_priority": "P0"}]})
TOKENS = 150  # ~2 s on the simulated engine at time_scale 1: the client drops and comes back while it runs
DROP_AFTER = 8  # events the client receives before its connection drops


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    with sim_backend(tmp_path_factory.mktemp("resume-logs"), time_scale=1.0) as running:
        yield running


@dataclass
class Replica:
    http: httpx.AsyncClient
    grpc: gateway_pb2_grpc.GatewayStub
    registry: CollectorRegistry


@contextlib.asynccontextmanager
async def replicas(backend: Backend, redis_url: str, prefix: str, **resume: object) -> AsyncIterator[list[Replica]]:
    """Two gateway replicas on one Redis, with stream resume on (a 30 s window unless ``resume`` says)."""
    runners, out, channels = [], [], []
    try:
        for _ in range(2):
            http_port, grpc_port = free_port(), free_port()
            settings = GatewaySettings(**{  # type: ignore[arg-type]
                "api_keys": KEYS, "scheduler_addr": backend.scheduler_addr, "http_port": http_port,
                "grpc_port": grpc_port, "models_cache_s": 0.0, "drain_grace_s": 0.5, "quota_redis_url": redis_url,
                "quotas": {"prefix": f"{prefix}:quota"},
                "metering": {"usage_prefix": f"{prefix}:usage", "flush_s": 0.2},
                "responses": {"prefix": f"{prefix}:responses"}, "feedback": {"prefix": f"{prefix}:feedback"},
                "resume": {"prefix": f"{prefix}:streams", "window_s": 30.0, **resume}})
            registry = CollectorRegistry()
            runner = build(settings, registry, None)
            await runner.start()
            runners.append(runner)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
            channels.append(channel)
            out.append(Replica(httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60,
                                                 headers={"Authorization": f"Bearer {KEY}"}),
                               gateway_pb2_grpc.GatewayStub(channel), registry))

        async def serving() -> bool:  # the scheduler has the worker, healthy
            return bool((await out[0].http.get("/v1/models")).json().get("data"))
        await async_wait_until(serving, timeout=60, interval=0.2,
                               message=f"no model served (logs in {backend.logs})")
        yield out
    finally:
        for replica in out:
            await replica.http.aclose()
        for channel in channels:
            await channel.close()
        for runner in runners:
            await runner.stop()


@dataclass(frozen=True)
class Event:
    id: str
    data: str


async def events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """SSE events as a client parses them (id and data fields; an event ends at a blank line)."""
    event_id, data = "", ""
    async for line in lines:
        if not line:
            if data:
                yield Event(event_id, data)
            event_id, data = "", ""
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()


def seq(event: Event) -> int:
    return int(event.id.rpartition(":")[2])


def text(received: list[Event]) -> str:
    out = []
    for e in received:
        if e.data != "[DONE]":
            for choice in json.loads(e.data).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(out)


async def dropped(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> tuple[str, list[Event]]:
    """Streams ``body`` and drops the connection after DROP_AFTER events: the stream id and what arrived."""
    received: list[Event] = []
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        stream_id = resp.headers["x-goodput-stream-id"]  # the request's id; a Responses stream's: the response's
        assert stream_id == resp.headers["x-request-id"] or stream_id.startswith("resp_")
        async for event in events(resp.aiter_lines()):
            received.append(event)
            if len(received) == DROP_AFTER:
                break  # leaving the block closes the connection mid-body
    return stream_id, received


async def resumed(client: httpx.AsyncClient, method: str, path: str, last_event_id: str,
                  body: dict[str, object] | None = None) -> list[Event]:
    async with client.stream(method, path, json=body, headers={"Last-Event-ID": last_event_id}) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [e async for e in events(resp.aiter_lines())]


async def worker_requests(backend: Backend) -> dict[str, float]:
    """The worker's Generate calls by outcome (finished, aborted, error)."""
    async with httpx.AsyncClient() as c:
        body = (await c.get(backend.worker_metrics, timeout=5)).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^goodput_worker_requests_total\{outcome="(\w+)"\} (\S+)$', body, re.M)}


def gateway_requests(replicas: list[Replica], route: str) -> float:
    return sum(r.registry.get_sample_value("goodput_gateway_requests_total",
                                           {"route": route, "code": code, "priority": "P0"}) or 0.0
               for r in replicas for code in ("200", "OK"))


async def metered(replica: Replica) -> tuple[int, int]:
    """The tenant's requests and completion tokens this month, as metered to Redis."""
    data = (await replica.http.get("/v1/usage")).json()["data"]
    return sum(d["requests"] for d in data), sum(d["completion_tokens"] for d in data)


def chat(stream: bool = True) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": TOKENS,
            "stream": stream, "stream_options": {"include_usage": True}}


async def test_a_dropped_sse_stream_resumes_on_another_replica_from_its_last_event_id(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    async with replicas(backend, redis_url, redis_prefix) as (a, b):
        before = await worker_requests(backend)
        stream_id, first = await dropped(a.http, "/v1/chat/completions", chat())
        assert [e.id for e in first] == [f"{stream_id}:{i}" for i in range(DROP_AFTER)]
        # the client comes back on the other replica while the generation still runs: the rest, live
        rest = await resumed(b.http, "GET", f"/v1/streams/{stream_id}", first[-1].id)
        assert [seq(e) for e in rest] == list(range(DROP_AFTER, DROP_AFTER + len(rest)))
        assert rest[-1].data == "[DONE]" and json.loads(rest[-2].data)["usage"]["completion_tokens"] == TOKENS
        answer = text(first + rest)
        assert answer == " tok" * TOKENS
        # one generation: one worker call, one request at the gateways, metered once
        after = await worker_requests(backend)
        assert after.get("finished", 0) - before.get("finished", 0) == 1
        assert after.get("aborted", 0) == before.get("aborted", 0)
        assert gateway_requests([a, b], "chat") == 1
        assert await async_wait_until(lambda: _equals(metered(b), (1, TOKENS)), timeout=10) is True
        assert b.registry.get_sample_value("goodput_gateway_stream_resumes_total",
                                           {"api": "sse", "outcome": "resumed"}) == 1
        assert a.registry.get_sample_value("goodput_gateway_stream_detached_total", {"outcome": "finished"}) == 1

        # after its end, any event id of it replays the rest again, on either replica
        again = await resumed(a.http, "GET", f"/v1/streams/{stream_id}", f"{stream_id}:2")
        assert [e.data for e in again] == [e.data for e in first[3:] + rest]
        # the same text as an uninterrupted answer (a second generation, for comparison only)
        async with a.http.stream("POST", "/v1/chat/completions", json=chat()) as resp:
            whole = [e async for e in events(resp.aiter_lines())]
        assert text(whole) == answer and len(whole) == len(first) + len(rest)
        # the official SDK, unchanged, reads the numbered events as before
        sdk = openai.AsyncOpenAI(base_url=f"{str(a.http.base_url).rstrip('/')}/v1", api_key=KEY)
        parts = []
        async for chunk in await sdk.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}],
                                                             max_tokens=20, stream=True):
            parts += [c.delta.content or "" for c in chunk.choices]
        assert "".join(parts) == " tok" * 20
        await sdk.close()


async def test_an_sse_client_reconnects_with_the_same_post_and_others_are_refused(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    async with replicas(backend, redis_url, redis_prefix) as (a, b):
        body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "stream": True}
        before = await worker_requests(backend)
        stream_id, first = await dropped(a.http, "/v1/completions", body)
        # what an SSE client does on reconnect: the same request again, with the last event's id
        rest = await resumed(b.http, "POST", "/v1/completions", first[-1].id, body)
        assert seq(rest[0]) == DROP_AFTER and rest[-1].data == "[DONE]"
        assert text(first + rest) == " tok" * TOKENS
        after = await worker_requests(backend)
        assert after.get("finished", 0) - before.get("finished", 0) == 1
        assert gateway_requests([a, b], "completions") == 1

        # another tenant's key: not found, as an unknown id (ids are no oracle); a malformed id: 400
        other = {"Authorization": f"Bearer {OTHER_KEY}", "Last-Event-ID": first[-1].id}
        for resp in (await b.http.get(f"/v1/streams/{stream_id}", headers=other),
                     await b.http.post("/v1/completions", json=body, headers=other),
                     await b.http.get("/v1/streams/req-0000", headers={"Last-Event-ID": "req-0000:3"})):
            assert resp.status_code == 404, resp.text
            assert resp.json()["error"]["code"] == "stream_not_found"
        bad = await b.http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "req-0000:3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        assert (await b.http.get(f"/v1/streams/{stream_id}",
                                 headers={"Authorization": "Bearer nope"})).status_code == 401


async def test_a_dropped_responses_stream_resumes_as_openais_does(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    """The Responses API's stream id is the response's id, and an event's number its sequence_number: OpenAI's
    ``GET /v1/responses/{id}?stream=true&starting_after=N`` resumes it; the response is stored once it ends, though
    its client had gone."""
    async with replicas(backend, redis_url, redis_prefix) as (a, b):
        stream_id, first = await dropped(a.http, "/v1/responses", {"input": "Tell me a long story.",
                                                                   "max_output_tokens": TOKENS, "stream": True})
        assert stream_id.startswith("resp_")
        assert [json.loads(e.data)["sequence_number"] for e in first] == [seq(e) for e in first]
        async with b.http.stream("GET", f"/v1/responses/{stream_id}",
                                 params={"stream": "true", "starting_after": str(seq(first[-1]))}) as resp:
            assert resp.status_code == 200, await resp.aread()
            rest = [e async for e in events(resp.aiter_lines())]
        kinds = [json.loads(e.data)["type"] for e in rest]
        assert [json.loads(e.data)["sequence_number"] for e in rest] == [seq(e) for e in rest]
        assert seq(rest[0]) == DROP_AFTER and kinds[-1] == "response.incomplete"  # cut by max_output_tokens
        deltas = [json.loads(e.data).get("delta", "") for e in first + rest
                  if json.loads(e.data)["type"] == "response.output_text.delta"]
        assert "".join(deltas) == " tok" * TOKENS
        stored = (await b.http.get(f"/v1/responses/{stream_id}")).json()
        assert stored["output"][0]["content"][0]["text"] == " tok" * TOKENS


async def test_a_dropped_grpc_stream_resumes_with_its_token_on_another_replica(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    async with replicas(backend, redis_url, redis_prefix) as (a, b):
        metadata = (("authorization", f"Bearer {KEY}"),)
        request = gateway_pb2.GenerateRequest(
            messages=[types_pb2.ChatMessage(role="user", content="Tell me a long story.")],
            sampling=types_pb2.SamplingParams(max_tokens=TOKENS), priority=types_pb2.PRIORITY_P0)
        before = await worker_requests(backend)
        call = a.grpc.GenerateStream(request, metadata=metadata, timeout=60)
        first = [await call.read() for _ in range(DROP_AFTER)]
        call.cancel()  # the connection is gone
        assert first[0].HasField("start") and first[0].start.resume_token == first[0].start.request_id
        assert [m.seq for m in first] == list(range(DROP_AFTER))
        rest = [m async for m in b.grpc.ResumeStream(gateway_pb2.ResumeStreamRequest(
            resume_token=first[0].start.resume_token, from_seq=first[-1].seq + 1), metadata=metadata, timeout=60)]
        assert [m.seq for m in rest] == list(range(DROP_AFTER, DROP_AFTER + len(rest)))
        assert rest[-1].HasField("end") and rest[-1].end.usage.completion_tokens == TOKENS
        assert "".join(m.delta for m in first + rest) == " tok" * TOKENS
        after = await worker_requests(backend)
        assert after.get("finished", 0) - before.get("finished", 0) == 1
        assert gateway_requests([a, b], "grpc_stream") == 1
        # only its tenant; an unknown token is NOT_FOUND
        for key, token in ((OTHER_KEY, first[0].start.resume_token), (KEY, "req-unknown")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in b.grpc.ResumeStream(gateway_pb2.ResumeStreamRequest(resume_token=token),
                                                   metadata=(("authorization", f"Bearer {key}"),), timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_generation_nobody_comes_back_for_is_cut_after_the_window(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    async with replicas(backend, redis_url, redis_prefix, window_s=1.0) as (a, b):
        before = await worker_requests(backend)
        body = {**chat(), "max_tokens": 1500}  # ~20 s: it would run long after the client left
        stream_id, first = await dropped(a.http, "/v1/chat/completions", body)

        async def aborted() -> bool:
            return (await worker_requests(backend)).get("aborted", 0) == before.get("aborted", 0) + 1
        await async_wait_until(aborted, timeout=10, interval=0.2, message="the abandoned generation still runs")
        assert a.registry.get_sample_value("goodput_gateway_stream_detached_total", {"outcome": "abandoned"}) == 1

        async def refused() -> httpx.Response | None:  # the other replica sees the end a flush after it was made
            resp = await b.http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": first[-1].id})
            return resp if resp.status_code in (404, 410) else None
        late = await async_wait_until(refused, timeout=5, interval=0.1, message="the abandoned stream still resumes")
        assert late.status_code in (404, 410), late.text  # abandoned, or already expired
        assert late.json()["error"]["code"] in ("stream_abandoned", "stream_not_found")


async def test_a_resume_past_the_followers_bound_is_429_in_openais_shape(
        backend: Backend, redis_url: str, redis_prefix: str) -> None:
    """RESUME__MAX_FOLLOWERS_PER_STREAM: one resume more than it allows is refused with a 429 the SDKs understand
    (OpenAI's error body, a code saying why, Retry-After), never a 500; once a follower has gone, its place is free."""
    async with replicas(backend, redis_url, redis_prefix, max_followers_per_stream=1) as (a, b):
        body = {**chat(), "max_tokens": 600}  # ~8 s: it runs while the resumes come
        stream_id, first = await dropped(a.http, "/v1/chat/completions", body)
        headers = {"Last-Event-ID": first[-1].id}
        async with b.http.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as held:
            assert held.status_code == 200
            refused = await b.http.get(f"/v1/streams/{stream_id}", headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "too_many_stream_followers" and error["type"] == "rate_limit_error"
        assert b.registry.get_sample_value("goodput_gateway_stream_resumes_total",
                                           {"api": "sse", "outcome": "limited"}) == 1

        async def taken_back() -> list[Event] | None:  # once the replica has seen the first follower go
            async with b.http.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as resp:
                return [e async for e in events(resp.aiter_lines())] if resp.status_code == 200 else None
        rest = await async_wait_until(taken_back, timeout=10, interval=0.1)
        assert seq(rest[0]) == DROP_AFTER and rest[-1].data == "[DONE]"
        assert text(first + rest) == " tok" * 600


async def _equals(value: object, expected: object) -> bool:
    return await value == expected  # type: ignore[misc]
