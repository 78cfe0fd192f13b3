"""The gateway with a real cache service (in-process, real Redis and embedding model) and no inference backend: a
hit is answered without the scheduler, replayed in the shape of a live answer (JSON and SSE), and says so; a miss,
`Cache-Control: no-cache` or a cache that is down go on to the pipeline (here: 503, no backend)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from goodput.cache.v1 import cache_pb2, cache_pb2_grpc
from goodput.common.v1 import types_pb2
from goodput.retriever.v1 import retriever_pb2
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.errors import Unavailable
from goodput_testing import async_wait_until, free_port

from goodput_gateway.__main__ import build
from goodput_gateway.auth import Principal
from goodput_gateway.caching import GatewayCache
from goodput_gateway.catalogue import Catalogue, ModelEntry
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.generation_schemas import ChatCompletionRequest
from goodput_gateway.pipeline import Pipeline
from goodput_gateway.schemas import parse

KEYS = json.dumps({"keys": [{"key": "k-a", "tenant": "a", "max_priority": "P0"},
                            {"key": "k-b", "tenant": "b", "max_priority": "P0"}]})
MODEL = ModelEntry(id="smollm2", max_model_len=2048, model_version="v1", workers=1)
ANSWER = "Goodput is useful tokens delivered within their latency objective per GPU-second."


@pytest.fixture
async def cache_service(redis_url: str, redis_prefix: str) -> AsyncIterator[tuple[str, Any]]:
    """The cache service, its keys under this test's ``redis_prefix`` (the plugin deletes them after the test)."""
    cache_mod = pytest.importorskip("goodput_cache.__main__")
    from goodput_cache.config import CacheSettings

    settings = CacheSettings(grpc_port=0, http_port=0, redis_url=redis_url, key_prefix=redis_prefix,
                             kb_key_prefix=redis_prefix, version_channel=f"{redis_prefix}:kb")
    runner, cache = cache_mod.build(settings, CollectorRegistry(), None)
    await runner.start()
    await cache.start()
    try:
        yield f"127.0.0.1:{runner.grpc_port}", cache
    finally:
        await runner.stop()


def _client(cache_addr: str, monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry | None = None,
            **overrides: Any) -> httpx.AsyncClient:
    async def models(self: Catalogue) -> list[ModelEntry]:
        return [MODEL]

    async def open_(self: Pipeline, *args: Any, **kwargs: Any) -> None:
        raise Unavailable("no inference backend in this test")

    monkeypatch.setattr(Catalogue, "models", models)
    monkeypatch.setattr(Pipeline, "open", open_)
    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1",
                               cache_addr=cache_addr, cache_timeout_s=5.0, **overrides)
    runner = build(settings, registry or CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner.http_app)  # the same app uvicorn serves
    return httpx.AsyncClient(transport=transport, base_url="http://gw", headers={"Authorization": "Bearer k-a"})


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 64, **extra}


async def _store(addr: str, question: str, tenant: str = "a") -> None:
    gen = parse(ChatCompletionRequest, chat(question)).to_request()
    cache = GatewayCache(GatewaySettings(), stub=None, registry=None)  # type: ignore[arg-type]
    key = cache.key_parts(Principal(tenant=tenant, max_priority=1, default_priority=1), gen, MODEL)
    async with aio.insecure_channel(addr) as ch:
        resp = await cache_pb2_grpc.CacheStub(ch).Store(cache_pb2.StoreRequest(
            key=key, text=ANSWER, finish_reason=types_pb2.FINISH_REASON_STOP,
            usage=types_pb2.Usage(prompt_tokens=20, completion_tokens=17, total_tokens=37)))
    assert resp.stored, resp.reason


def _events(body: str) -> list[Any]:
    out: list[Any] = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_hits_are_answered_without_a_backend_in_the_shape_of_a_live_answer(
        cache_service: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    addr, _ = cache_service
    await _store(addr, "What is goodput?")
    async with _client(addr, monkeypatch) as client:
        r = await client.post("/v1/chat/completions", json=chat("What is goodput?"))
        assert r.status_code == 200, r.text
        assert r.headers["x-goodput-cache"] == "hit; layer=l1; similarity=1.000"
        body = r.json()
        assert body["choices"][0]["message"]["content"] == ANSWER
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 17, "total_tokens": 37,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["goodput_cache"] == {"status": "hit", "hit": True, "layer": "l1", "similarity": 1.0}

        r = await client.post("/v1/chat/completions",
                              json=chat("What is goodput?", stream=True, stream_options={"include_usage": True}))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[0]["goodput_cache"]["layer"] == "l1"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == ANSWER
        assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] == 17

        r = await client.post("/v1/chat/completions", json=chat("What's goodput?"))
        assert r.status_code == 200 and r.headers["x-goodput-cache"].startswith("hit; layer=l2; similarity=0.9")

        # another tenant, no-cache and a miss all go on to generation (no backend here: 503)
        r = await client.post("/v1/chat/completions", json=chat("What is goodput?"),
                              headers={"Authorization": "Bearer k-b"})
        assert r.status_code == 503
        r = await client.post("/v1/chat/completions", json=chat("What is goodput?"),
                              headers={"Cache-Control": "no-cache"})
        assert r.status_code == 503
        r = await client.post("/v1/chat/completions", json=chat("How do I rotate an API key?"))
        assert r.status_code == 503


async def test_a_cache_that_is_down_never_fails_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _client("127.0.0.1:1", monkeypatch) as client:
        r = await client.post("/v1/chat/completions", json=chat("What is goodput?"))
    # the request went on to generation: its error, not the cache's
    assert r.status_code == 503 and "no inference backend" in r.text


async def test_the_cache_breaker_opens_on_a_dead_cache_and_closes_after_it_returns(redis_url: str,
                                                                                   redis_prefix: str) -> None:
    """A dead cache is skipped at once once its breaker opens (no call waits out its timeout); when the cache is
    back, the first probe after the reset timeout closes the breaker and lookups reach it again."""
    cache_mod = pytest.importorskip("goodput_cache.__main__")
    from goodput_core.breaker import BreakerMetrics, CircuitBreaker

    from goodput_cache.config import CacheSettings

    port = free_port()  # nothing there yet; the cache starts on it later
    now = [0.0]
    registry = CollectorRegistry()
    breaker = CircuitBreaker("cache", failure_threshold=2, reset_timeout_s=5.0, clock=lambda: now[0],
                             metrics=BreakerMetrics(registry, service="gateway"))
    principal = Principal(tenant="a", max_priority=1, default_priority=1)
    request = parse(ChatCompletionRequest, chat("Is the cache there?")).to_request()
    state = lambda: registry.get_sample_value("goodput_gateway_breaker_state", {"dependency": "cache"})  # noqa: E731
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        cache = GatewayCache(GatewaySettings(cache_timeout_s=2.0), stub=cache_pb2_grpc.CacheStub(channel),
                             registry=None, breaker=breaker)
        reasons = [(await cache.lookup(principal, request, MODEL, cache_control=""))[0].reason for _ in range(3)]
        assert reasons == ["cache unavailable", "cache unavailable", "cache breaker open"] and state() == 2
        settings = CacheSettings(grpc_port=port, http_port=0, redis_url=redis_url, key_prefix=redis_prefix,
                                 kb_key_prefix=redis_prefix, version_channel=f"{redis_prefix}:kb")
        runner, service = cache_mod.build(settings, CollectorRegistry(), None)
        await runner.start()
        await service.start()
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=30)  # the cache is reachable again
            assert (await cache.lookup(principal, request, MODEL, cache_control=""))[0].reason == "cache breaker open"
            now[0] += 5.0  # the reset timeout passes: the next lookup is the probe
            status, _ = await cache.lookup(principal, request, MODEL, cache_control="")
            assert status.status == "miss" and state() == 0
        finally:
            await runner.stop()


async def test_one_tenants_own_timeouts_do_not_open_the_cache_breaker(cache_service: tuple[str, Any]) -> None:
    """Tenant a's lookups run out of its own deadline (too short for any hop) while b's reach the cache: a's failures
    are its own, the shared breaker stays closed and b's lookups keep reaching the cache."""
    from goodput_core.breaker import BreakerSettings, BreakerState
    from goodput_core.context import request_context

    from goodput_gateway.dependencies import gateway_breakers

    breaker = gateway_breakers(BreakerSettings(failure_threshold=2), None)["cache"]
    async with aio.insecure_channel(cache_service[0]) as channel:
        cache = GatewayCache(GatewaySettings(), stub=cache_pb2_grpc.CacheStub(channel), registry=None,
                             breaker=breaker)

        async def lookup(tenant: str, question: str, timeout_s: float | None = None) -> str:
            request = parse(ChatCompletionRequest, chat(question)).to_request()
            with request_context(tenant=tenant):  # as the gateway's authentication sets it
                principal = Principal(tenant=tenant, max_priority=1, default_priority=1)
                return (await cache.lookup(principal, request, MODEL, cache_control="", timeout_s=timeout_s))[0].reason

        assert await lookup("b", "Is the cache there?") != "cache unavailable"
        # new questions each (a semantic lookup embeds them: more than the 1 ms a's deadline leaves)
        assert [await lookup("a", f"Question number {i} of tenant a?", timeout_s=0.001) for i in range(5)] \
            == ["cache unavailable"] * 5
        assert breaker.state is BreakerState.CLOSED
        assert await lookup("b", "Is the cache still there?") not in ("cache unavailable", "cache breaker open")


class _Answering:
    """A stand-in for a worker's stream (no engine runs in these tests): one short answer."""

    start = SimpleNamespace(worker_id="stand-in", prompt_tokens=3)

    async def events(self) -> AsyncIterator[Any]:
        yield TextDelta("Goodput.")
        yield StreamEnd(finish_reason="stop", prompt_tokens=3, completion_tokens=2)

    async def aclose(self) -> None:
        return None

    def usage(self) -> tuple[int, int, int]:
        return 3, 2, 0


async def test_a_stage_over_its_budget_takes_the_ladders_next_step_and_says_so(
        cache_service: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """P0's cache lookup gets a budget no lookup can meet: each lookup is cut at it (the answer is served uncached)
    and runs the stage over budget; after enough such answers the ladder takes P0's next step (exact-only cache),
    and the answers say so. P1 is not touched."""
    import asyncio

    addr, _ = cache_service
    async with _client(addr, monkeypatch, latency_profile={"P0": {"budgets": {"cache_lookup": 1e-9},
                                                                  "ladder": ["exact_cache_only", "shed"]}},
                       ladder={"interval_s": 0.01}) as client:
        async def answering(self: Pipeline, *args: Any, **kwargs: Any) -> _Answering:
            return _Answering()

        monkeypatch.setattr(Pipeline, "open", answering)

        async def ask(priority: str) -> httpx.Response:
            r = await client.post("/v1/chat/completions", json=chat("What is goodput?", priority=priority),
                                  headers={"Cache-Control": "no-store"} if priority == "P1" else {})
            assert r.status_code == 200, r.text
            return r

        first = await ask("P0")
        assert "goodput_degraded" not in first.json() and "cache_lookup" in first.headers["server-timing"]
        for _ in range(12):  # enough answers over budget for the ladder to judge
            await ask("P0")
        await asyncio.sleep(0.02)  # its interval passes
        await ask("P0")
        r = await ask("P0")
        assert r.json()["goodput_degraded"] == ["exact_cache_only"] and r.headers["x-goodput-degraded"] == \
            "exact_cache_only"
        assert "goodput_degraded" not in (await ask("P1")).json()


class _Handbook:
    """A stand-in retriever: one chunk of the knowledge base, whatever its version."""

    async def search(self, tenant: str, kb: str, query: str, **kwargs: Any) -> retriever_pb2.SearchResponse:
        return retriever_pb2.SearchResponse(kb_version=1, hits=[retriever_pb2.Hit(
            chunk_id="c1", document_id="warranty", score=0.9, text="The warranty covers parts for two years.")])


async def test_a_rag_answer_is_stored_under_the_version_its_lookup_read_not_a_newer_one(
        cache_service: tuple[str, Any], monkeypatch: pytest.MonkeyPatch, redis_url: str, redis_prefix: str) -> None:
    """The knowledge base moves from v1 to v2 while an answer retrieved at v1 is generated: the answer is not stored
    (not under v2, where it would answer for data it never saw); the next question, at v2, is generated and stored
    under v2, and the one after is a hit."""
    import redis.asyncio as aioredis

    from goodput_contracts import version_key

    from goodput_gateway.knowledge import Knowledge

    addr, cache = cache_service
    r = aioredis.Redis.from_url(redis_url)
    version = version_key("a", "manuals", prefix=redis_prefix)
    await r.set(version, 1)
    bumps = [1]  # the next answer's generation bumps the version once

    class _BumpingAnswer(_Answering):
        async def events(self) -> AsyncIterator[Any]:
            if bumps:
                bumps.pop()
                await r.incr(version)  # the indexer finished a write meanwhile
            async for event in super().events():
                yield event

    async def answering(self: Pipeline, *args: Any, **kwargs: Any) -> _Answering:
        return _BumpingAnswer()

    handbook = _Handbook()

    async def search(self: Knowledge, *args: Any, **kwargs: Any) -> retriever_pb2.SearchResponse:
        return await handbook.search(*args, **kwargs)

    monkeypatch.setattr(Knowledge, "retrieval_enabled", property(lambda self: True))
    monkeypatch.setattr(Knowledge, "search", search)
    registry = CollectorRegistry()
    stores = lambda result: registry.get_sample_value(  # noqa: E731
        "goodput_gateway_cache_stores_total", {"result": result}) or 0
    question = chat("What does the warranty cover?", knowledge_base="manuals")
    try:
        async with _client(addr, monkeypatch, registry=registry) as client:
            monkeypatch.setattr(Pipeline, "open", answering)
            first = await client.post("/v1/chat/completions", json=question)
            assert first.status_code == 200 and first.headers["x-goodput-cache"] == "miss", first.text
            await async_wait_until(lambda: stores("stale knowledge base") == 1, timeout=10,
                                   message="the store of the v1 answer was not refused")
            assert cache.index.bytes_used() == 0 and await r.get(version) == b"2"
            second = await client.post("/v1/chat/completions", json=question)  # at v2: generated again
            assert second.headers["x-goodput-cache"] == "miss"
            await async_wait_until(lambda: stores("stored") == 1, timeout=10, message="the v2 answer was not stored")
            third = await client.post("/v1/chat/completions", json=question)
            assert third.headers["x-goodput-cache"] == "hit; layer=l1; similarity=1.000"
            assert third.json()["sources"] == second.json()["sources"]
            # no-cache: no lookup read a version, so the fresh RAG answer is not stored (a store would have been
            # sent when its stream ended; half a second is more than one takes here)
            r2 = await client.post("/v1/chat/completions", json=question, headers={"Cache-Control": "no-cache"})
            assert r2.status_code == 200 and r2.headers["x-goodput-cache"] == "bypass; reason=no-cache"
            await asyncio.sleep(0.5)
            assert stores("stored") == 1 and stores("error") == 0
    finally:
        await r.aclose()
