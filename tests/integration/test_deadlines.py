"""Deadlines and where the time went, on the real platform (vLLM CPU engine): a request that cannot finish before
its deadline is refused at once and never reaches a worker; every answer says how its time divided into stages
(``Server-Timing``, a ``goodput_timing`` object on the stream's last chunk, ``goodput-timing`` gRPC trailing
metadata), and the stages add up to the end-to-end latency."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, model_id

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

QUESTION: Any = [{"role": "user", "content": "Name three colours."}]


def _worker_requests(platform: Platform) -> float:
    total = 0.0
    for i in range(2):
        text = httpx.get(platform.worker_http(i) + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == "goodput_worker_requests":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _stages(server_timing: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+);dur=([\d.]+)", server_timing)}


def test_a_request_that_cannot_finish_in_time_is_refused_at_once_and_no_worker_sees_it(
        platform: Platform, client: openai.OpenAI) -> None:
    model = model_id(client)
    before = _worker_requests(platform)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:  # 100 ms for a 400-token answer
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=400,
                                       extra_headers={"X-Goodput-Deadline-Ms": "100"})
    assert err.value.status_code == 504 and err.value.code == "deadline_unreachable", err.value.body
    assert time.monotonic() - started < 30  # refused, not run until cut (generous: shared machines are slow)
    assert _worker_requests(platform) == before


def test_a_bad_deadline_header_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=4,
                                       extra_headers={"Request-Timeout-Ms": "soon"})
    assert err.value.param == "request-timeout-ms"


def test_the_breakdown_adds_up_to_the_end_to_end_latency(platform: Platform) -> None:
    body = {"model": "", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY_P0}", "Cache-Control": "no-store", "Request-Timeout-Ms": "120000"}
    with httpx.Client(base_url=platform.gateway_http, timeout=120) as http:
        http.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()  # warm
        started = time.monotonic()
        resp = http.post("/v1/chat/completions", json=body, headers=headers)
        elapsed_ms = (time.monotonic() - started) * 1000
    resp.raise_for_status()
    stages = _stages(resp.headers["server-timing"])
    total = stages.pop("total")
    assert {"auth_parse", "queue_wait", "prefill", "decode", "network", "post_processing"} <= set(stages)
    assert abs(sum(stages.values()) - total) <= 0.05 * total
    assert total <= elapsed_ms and total >= 0.95 * elapsed_ms - 50  # the client's view, less its own hop


def test_the_stream_ends_with_its_timing_and_grpc_trails_it(platform: Platform, client: openai.OpenAI) -> None:
    import grpc
    from goodput.common.v1 import types_pb2
    from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    chunks = list(client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=16,
                                                 stream=True, extra_headers={"Cache-Control": "no-store"}))
    timing = (chunks[-1].model_extra or {}).get("goodput_timing")
    assert timing is not None and chunks[-1].choices[0].finish_reason is not None
    assert {"prefill", "decode"} <= set(timing["stages_ms"]) and timing["over_budget"] is not None
    assert abs(sum(timing["stages_ms"].values()) - timing["total_ms"]) <= 0.05 * timing["total_ms"]

    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(**m) for m in QUESTION], no_cache=True,
                                          sampling=types_pb2.SamplingParams(max_tokens=8, temperature=0))
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        _, call = gateway_pb2_grpc.GatewayStub(channel).Generate.with_call(
            request, metadata=(("authorization", f"Bearer {KEY_P0}"),), timeout=120)
    trailing = dict(call.trailing_metadata() or ())
    assert "decode" in _stages(trailing["goodput-timing"])
