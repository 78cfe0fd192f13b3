"""The field's benchmark clients run unchanged: the exact requests kubernetes-sigs inference-perf, NVIDIA aiperf and
vllm-project guidellm send (bodies and headers, captured once from the real tools by ``python -m loadtests.peers
--capture tests/fixtures/peers``; each fixture names its tool, version and command) are replayed against the real
platform. Each streamed request is served, its stream ends in ``[DONE]``, and the answer is exactly as long as the
tool asked (the tools send ``ignore_eos`` for fixed output lengths). ``make peers`` runs the tools themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "peers").glob("*.json"))
TRANSPORT = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


def _requests() -> list[Any]:
    cases = []
    for path in FIXTURES:
        fixture = json.loads(path.read_text())
        for i, request in enumerate(fixture["requests"]):
            name = f"{fixture['tool']}-{fixture['version']}-{request['method']}-{request['path'].strip('/')}-{i}"
            cases.append(pytest.param(fixture["tool"], request, id=name.replace("/", "_")))
    return cases


def test_every_tool_has_a_fixture_for_chat_and_completions() -> None:
    seen = {(json.loads(p.read_text())["tool"], r["path"]) for p in FIXTURES
            for r in json.loads(p.read_text())["requests"] if r["method"] == "POST"}
    for tool in ("inference-perf", "aiperf", "guidellm"):
        assert {(tool, "/v1/chat/completions"), (tool, "/v1/completions")} <= seen, tool


def _served_model(client: httpx.Client) -> str:
    models = client.get("/v1/models", headers={"authorization": f"Bearer {KEY_P0}"}).json()
    return str(models["data"][0]["id"])


@pytest.mark.parametrize("tool,request_", _requests())
def test_the_tools_request_is_served_as_it_asked(platform: Platform, tool: str, request_: dict[str, Any]) -> None:
    headers = {k: v for k, v in request_["headers"].items() if k.lower() not in TRANSPORT}
    headers["authorization"] = f"Bearer {KEY_P0}"
    headers["cache-control"] = "no-store"  # every replay reaches the engine (a cached answer is not what is tested)
    with httpx.Client(base_url=platform.gateway_http, timeout=120) as client:
        if request_["method"] == "GET":
            resp = client.get(request_["path"], headers=headers)
            assert resp.status_code == 200, (tool, resp.text)
            return
        body = dict(request_["body"])
        if "model" in body:
            body["model"] = _served_model(client)  # the fixture names whatever model the capture served
        with client.stream("POST", request_["path"], headers=headers, content=json.dumps(body)) as resp:
            assert resp.status_code == 200, (tool, resp.read().decode())
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [line.removeprefix("data:").strip() for line in resp.iter_lines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]", (tool, events[-3:])
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], (tool, chunks)
    chat = request_["path"].endswith("/chat/completions")
    assert "".join(_text(c, chat) for c in chunks), tool
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage, f"{tool} asks for usage in the stream (stream_options.include_usage)"
    assert usage[-1]["completion_tokens"] == request_["output_tokens"], (tool, usage[-1])
    if body.get("stream_options", {}).get("continuous_usage_stats"):  # vLLM's: the usage so far on every chunk
        with_text = [c for c in chunks if _text(c, chat)]
        assert all("usage" in c for c in with_text), tool
        counted = [c["usage"]["completion_tokens"] for c in with_text]
        assert counted == sorted(counted) and 0 < counted[-1] <= request_["output_tokens"], (tool, counted)


def _text(chunk: dict[str, Any], chat: bool) -> str:
    return "".join((choice.get("delta", {}).get("content") or "") if chat else (choice.get("text") or "")
                   for choice in chunk.get("choices", []))
