"""The LiteLLM side of the overhead benchmark: the mock endpoint streams OpenAI chunks from the simulated engine,
and (where its venv is installed: ``make litellm``) the LiteLLM proxy in front of it relays every token, parsed by
the benchmark's own SSE code on both paths. Timings are not asserted."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from goodput_testing import free_port

from loadtests import overhead
from loadtests.common import cpu_seconds
from loadtests.openai_mock import build_app


async def test_the_mock_streams_chat_chunks_with_usage_and_done() -> None:
    app = build_app(max_num_seqs=8, max_model_len=2048)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as client:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
        data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        events = [json.loads(d) for d in data[:-1]]
        deltas = [e["choices"][0]["delta"]["content"] for e in events if e["choices"] and
                  e["choices"][0]["delta"].get("content")]
        assert len(deltas) == 5 and events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 5
        whole = await client.post("/v1/chat/completions", json={**body, "stream": False})
        assert whole.json()["choices"][0]["message"]["content"].count("tok") == 5
        assert (await client.post("/v1/chat/completions", json={"messages": "x"})).status_code == 400


@pytest.mark.integration
@pytest.mark.skipif(not (overhead.LITELLM_VENV / "bin" / "litellm").exists(),
                    reason="the LiteLLM venv is not installed (`make test` installs it; alone: make litellm)")
async def test_litellm_proxies_the_mock_token_by_token(tmp_path: Path) -> None:
    stack = overhead.LiteLLMStack(tmp_path, mock_port=free_port(), proxy_port=free_port())
    try:
        await stack.start(model="sim-7b", max_num_seqs=16, max_model_len=2048)
        target = overhead.Target(gateway_url="http://127.0.0.1:1", gateway_grpc="127.0.0.1:1",
                                 worker="127.0.0.1:1", api_key="-", litellm=stack)
        clients = overhead.Clients(target, max_streams=4)
        try:
            jobs = overhead.schedule(4, random.Random(0), overhead.LITELLM_PATHS)
            watched = overhead.cpu_watch(target, overhead.LITELLM_PATHS)
            before = {name: cpu_seconds(pids) for name, pids in watched.items()}
            samples = await overhead.run_level(clients, 2, jobs, max_tokens=8, timeout_s=60)
            cpu = overhead.cpu_per_request(watched, before, [s for s in samples if s.path == "litellm_proxy"])
        finally:
            await clients.close()
        assert all(s.error is None for s in samples), [s.error for s in samples]
        assert {s.path for s in samples} == set(overhead.LITELLM_PATHS)
        assert all(s.deltas == 8 and s.ttft_s is not None and len(s.itl_s) == 7 for s in samples)
        level = overhead.analyse_level(2, samples, wall_s=1.0, stages={}, load_before=None)
        assert set(level["overhead"]) == {"litellm_proxy"} and level["overhead"]["litellm_proxy"]["ttft"]["p50_diff_ms"]
        assert stack.version == "1.108.7"
        # the proxy's own CPU, per request it served (its mock, which serves the direct path, is not counted)
        assert set(cpu) == {"litellm_proxy"} and cpu["litellm_proxy"]["requests"] == 4
        assert cpu["litellm_proxy"]["ms_per_request"] > 0
    finally:
        stack.stop()
