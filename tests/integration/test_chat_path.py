"""A chat request through gateway -> scheduler -> vLLM worker and back, as product teams call it: the official
openai SDK (unchanged, base_url pointed at the gateway) and the gateway's gRPC API."""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, list_workers, model_id, read_spans, worker_load

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# These tests check the answer's meaning, tolerantly; test_numerics.py checks the exact tokens against a float32
# reference, so a kernel that changes the model's answers fails there, on any CPU, with the reason.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"



def test_non_streaming_chat_with_the_openai_sdk(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=20,  # type: ignore[arg-type]
                                          temperature=0)
    text = resp.choices[0].message.content or ""
    assert "paris" in text.lower()
    assert resp.usage is not None and resp.usage.prompt_tokens > 5 and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_streaming_chat_with_the_openai_sdk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=20,  # type: ignore[arg-type]
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "paris" in "".join(parts).lower()
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_completions_endpoint(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=model_id(client), prompt=COUNTING, max_tokens=8, temperature=0)
    assert "11" in resp.choices[0].text
    assert resp.usage is not None and resp.usage.completion_tokens == 8


def test_grpc_generate_stream_and_generate(platform: Platform) -> None:
    metadata = (("authorization", f"Bearer {KEY_P0}"),)
    request = gateway_pb2.GenerateRequest(
        messages=[types_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=types_pb2.SamplingParams(max_tokens=20, temperature=0))
    with grpc.insecure_channel(platform.gateway_grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        events = list(stub.GenerateStream(request, metadata=metadata, timeout=120))
        assert events[0].HasField("start") and events[0].start.request_id
        text = "".join(e.delta for e in events if e.WhichOneof("kind") == "delta")
        assert "paris" in text.lower()
        assert events[-1].HasField("end") and events[-1].end.usage.completion_tokens > 0
        unary = stub.Generate(request, metadata=metadata, timeout=120)
        assert unary.text == text and unary.usage.total_tokens > 0
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        assert models.models and models.models[0].max_model_len > 0


def test_tokens_stream_as_they_are_generated(platform: Platform) -> None:
    """Per-chunk arrival times: the first token arrives long before the last one is generated."""
    body = {"prompt": COUNTING, "max_tokens": 64, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    start = time.monotonic()
    with httpx.stream("POST", platform.gateway_http + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY_P0}"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-accel-buffering"] == "no" and "no-cache" in resp.headers["cache-control"]
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= 32, "one SSE event per new piece of text"
    first, last = arrivals[0], arrivals[-1]
    # Buffering would deliver everything at once at the end; streaming spreads the events over the generation.
    assert first < last / 3, f"first event at {first:.2f}s, last at {last:.2f}s"


def test_client_disconnect_aborts_the_generation(platform: Platform) -> None:
    before = [worker_load(platform, i).aborted_total for i in range(2)]
    body = {"prompt": COUNTING, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", platform.gateway_http + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY_P0}"}) as resp:
        received = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received >= 5:
                break  # the client goes away mid-stream
    # The vLLM request is aborted (long before its 1500 tokens) and the slot and the lease are freed.
    wait_until(lambda: sum(worker_load(platform, i).aborted_total for i in range(2)) == sum(before) + 1)
    wait_until(lambda: all(worker_load(platform, i).running == 0 for i in range(2)))
    wait_until(lambda: all(w.inflight == 0 for w in list_workers(platform)))


def test_one_trace_spans_gateway_scheduler_and_worker(platform: Platform) -> None:
    resp = httpx.post(platform.gateway_http + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEY_P0}"},
                      json={"messages": QUESTION, "max_tokens": 5})
    assert resp.status_code == 200
    request_id = resp.headers["x-request-id"]

    def trace_services() -> set[str] | None:
        spans = read_spans(platform)
        roots = [s for s in spans if s["attributes"].get("goodput.request_id") == request_id]
        if not roots:
            return None
        services = {s["service"] for s in spans if s["trace_id"] == roots[0]["trace_id"]}
        return services if len(services) == 3 else None

    services = wait_until(trace_services, timeout=15)
    assert services == {"goodput-gateway", "goodput-scheduler", "goodput-inference"}


def test_every_service_exposes_metrics(platform: Platform) -> None:
    expectations = {
        platform.gateway_metrics: "goodput_gateway_ttft_seconds",
        platform.scheduler_http + "/metrics": "goodput_scheduler_admissions_total",
        platform.worker_http(0) + "/metrics": "goodput_worker_running_requests",
        platform.worker_http(1) + "/metrics": "goodput_worker_kv_cache_usage_ratio",
    }
    for url, metric in expectations.items():
        resp = httpx.get(url, timeout=10)
        assert resp.status_code == 200 and metric in resp.text, url
    # the gateway's REST port is public: its metrics (tenants, keys) are not served there
    assert httpx.get(platform.gateway_http + "/metrics", timeout=10).status_code == 404


def test_every_served_model_is_listed_and_can_be_retrieved(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    generation = model_id(client)
    assert client.models.retrieve(generation).id == generation
    # the embedding model too, with the name /v1/embeddings answers with
    embedding = client.embeddings.create(input=["hello"], model="default").model
    assert embedding in models and client.models.retrieve(embedding).id == embedding
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_a_repeated_long_prompt_reports_its_prefix_cache_hit(client: openai.OpenAI) -> None:
    long_prompt = [{"role": "system", "content": "You answer questions about this handbook. " + COUNTING * 60},
                   {"role": "user", "content": "What comes after 3?"}]
    no_store = {"Cache-Control": "no-store"}  # past the response cache: both go to the engine
    kw: dict[str, object] = {"model": model_id(client), "messages": long_prompt, "max_tokens": 4, "temperature": 0,
                             "extra_headers": no_store, "user": "same-session"}  # session affinity: one worker
    first = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    repeat = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert first.usage is not None and repeat.usage is not None
    assert repeat.usage.prompt_tokens > 500
    details = repeat.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= repeat.usage.prompt_tokens // 2
