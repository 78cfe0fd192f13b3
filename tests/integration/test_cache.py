"""The response cache through real processes (gateway -> cache service -> Redis, vLLM workers behind): a repeated
question is answered from the cache without a worker, streamed in the shape of a live answer over SSE and gRPC;
tenants never share; a negated paraphrase is not a hit; Cache-Control is honoured; a knowledge-base version bump
makes the next identical RAG question miss."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, KEY_P2

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

SYSTEM = {"role": "system", "content": "You are the support assistant of a bicycle shop. Answer briefly."}


def _chat(platform: Platform, question: str, *, key: str = KEY_P0, stream: bool = False,
          headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 12, "temperature": 0,
            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(platform.gateway_http + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for block in resp.text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: "):]))
    assert resp.text.rstrip().endswith("data: [DONE]")
    return out


def _until_hit(send: Any, timeout: float = 60.0) -> httpx.Response:
    """The answer is stored after the stream completes, off the response path: asks again until it is served."""
    def hit() -> httpx.Response | None:
        resp = send()
        return resp if resp.headers.get("x-goodput-cache", "").startswith("hit") else None

    return wait_until(hit, timeout=timeout, interval=0.3, message="never a cache hit")


def _shape(chunk: dict[str, Any]) -> tuple[Any, ...]:
    choices = chunk["choices"]
    return (chunk["object"], tuple(sorted(k for k in chunk if k != "goodput_cache")),
            tuple(sorted(choices[0])) if choices else (), tuple(sorted(choices[0]["delta"])) if choices else ())


def test_a_streamed_answer_is_stored_and_replayed_in_the_same_shape(platform: Platform) -> None:
    question = f"Do you repair electric bikes? (ticket {uuid.uuid4().hex[:6]})"
    live = _chat(platform, question, stream=True)
    assert live.status_code == 200 and live.headers["x-goodput-cache"] == "miss"
    live_events = _events(live)
    assert live_events[0]["goodput_cache"] == {"status": "miss", "hit": False}

    hit = _until_hit(lambda: _chat(platform, question, stream=True))
    assert hit.headers["x-goodput-cache"] == "hit; layer=l1; similarity=1.000"
    hit_events = _events(hit)
    assert hit_events[0]["goodput_cache"]["layer"] == "l1"

    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])

    assert text(hit_events) == text(live_events) and text(live_events)
    # The same events: role chunk, content chunks, the finish chunk, the usage chunk.
    assert _shape(hit_events[0]) == _shape(live_events[0])
    assert {_shape(e) for e in hit_events[1:-2]} == {_shape(e) for e in live_events[1:-2]}
    assert [_shape(e) for e in hit_events[-2:]] == [_shape(e) for e in live_events[-2:]]
    assert hit_events[-2]["choices"][0]["finish_reason"] == live_events[-2]["choices"][0]["finish_reason"]
    assert hit_events[-1]["usage"] == live_events[-1]["usage"]

    # The same answer, non-streamed and over gRPC (stream and unary), says it is a hit too.
    body = _chat(platform, question).json()
    assert body["choices"][0]["message"]["content"] == text(live_events)
    assert body["goodput_cache"]["status"] == "hit"
    request = gateway_pb2.GenerateRequest(
        messages=[types_pb2.ChatMessage(role=SYSTEM["role"], content=SYSTEM["content"]),
                  types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=12, temperature=0))
    with grpc.insecure_channel(platform.gateway_grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.GenerateStream(request, metadata=(("authorization", f"Bearer {KEY_P0}"),), timeout=60)
        events = list(call)
        assert dict(call.initial_metadata())["x-goodput-cache"].startswith("hit; layer=l1")
        assert events[0].HasField("start") and events[-1].HasField("end")
        assert "".join(e.delta for e in events if e.WhichOneof("kind") == "delta") == text(live_events)
        assert events[-1].end.usage.completion_tokens == live_events[-1]["usage"]["completion_tokens"]
        assert events[0].start.cache.hit and events[0].start.cache.layer == "l1"  # CacheInfo says what answered
        unary = stub.Generate(request, metadata=(("authorization", f"Bearer {KEY_P0}"),), timeout=60)
        assert unary.cache.hit and unary.cache.layer == "l1" and unary.text == text(live_events)
        # no_cache: neither read nor written, and no CacheInfo
        bypass = gateway_pb2.GenerateRequest(messages=request.messages, sampling=request.sampling, no_cache=True)
        call = stub.GenerateStream(bypass, metadata=(("authorization", f"Bearer {KEY_P0}"),), timeout=60)
        events = list(call)
        assert dict(call.initial_metadata())["x-goodput-cache"].startswith("bypass")
        assert not events[0].start.HasField("cache")


def test_tenants_never_share_and_near_misses_are_generated(platform: Platform) -> None:
    question = f"How do I turn on the rear light of model {uuid.uuid4().hex[:4].upper()}?"
    assert _chat(platform, question).headers["x-goodput-cache"] == "miss"
    _until_hit(lambda: _chat(platform, question))
    # another tenant: its own miss
    assert _chat(platform, question, key=KEY_P2).headers["x-goodput-cache"] == "miss"
    # a paraphrase that asks the opposite is not served the cached answer
    opposite = question.replace("turn on", "turn off")
    assert not _chat(platform, opposite).headers["x-goodput-cache"].startswith("hit")


def test_cache_control_and_non_greedy_requests(platform: Platform) -> None:
    question = f"What are your opening hours on holidays? ({uuid.uuid4().hex[:6]})"
    assert _chat(platform, question, headers={"Cache-Control": "no-store"}).headers["x-goodput-cache"] == \
        "bypass; reason=no-store"
    # Nothing to wait on: the assertion is that no store happens. A second is more than a store takes (the hits
    # above land within a few hundred milliseconds), so a wrong store would have landed by then.
    time.sleep(1.0)
    assert _chat(platform, question).headers["x-goodput-cache"] == "miss"  # no-store stored nothing
    _until_hit(lambda: _chat(platform, question))
    r = _chat(platform, question, headers={"Cache-Control": "no-cache"})
    assert r.status_code == 200 and r.headers["x-goodput-cache"] == "bypass; reason=no-cache"
    r = _chat(platform, question, temperature=0.7)
    assert r.status_code == 200 and r.headers["x-goodput-cache"] == "bypass; reason=not reusable"


def test_a_knowledge_base_version_bump_makes_the_next_rag_question_miss(platform: Platform) -> None:
    kb = f"shop-{uuid.uuid4().hex[:8]}"
    url = f"{platform.gateway_http}/v1/knowledge-bases/{kb}/documents"
    auth = {"Authorization": f"Bearer {KEY_P0}"}
    docs = [{"id": "hours", "text": "The shop is open from nine to six, Monday to Saturday."}]
    assert httpx.post(url, headers=auth, json={"documents": docs}, timeout=120).status_code == 200
    question = "When is the shop open?"
    first = _chat(platform, question, knowledge_base=kb)
    assert first.status_code == 200 and first.headers["x-goodput-cache"] == "miss"
    hit = _until_hit(lambda: _chat(platform, question, knowledge_base=kb))
    assert hit.json()["sources"] == first.json()["sources"], "a cached RAG answer keeps its sources"
    # a new document: the indexer bumps the KB version and announces it
    docs.append({"id": "sunday", "text": "From June the shop also opens on Sundays, ten to four."})
    r = httpx.post(url, headers=auth, json={"documents": docs}, timeout=120)
    assert r.status_code == 200 and r.json()["kb_version"] >= 2
    after = _chat(platform, question, knowledge_base=kb)
    assert after.status_code == 200 and after.headers["x-goodput-cache"] == "miss"
