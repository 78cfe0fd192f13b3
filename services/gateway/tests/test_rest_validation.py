"""Bad REST input gets a 4xx in OpenAI's error shape before anything reaches the scheduler (no backend runs here:
the scheduler address points at a closed port, so a request that got past validation would fail with 503)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from goodput_gateway.__main__ import build
from goodput_gateway.config import GatewaySettings

KEYS = json.dumps({"keys": [{"key": "k-p0", "tenant": "a", "max_priority": "P0"},
                            {"key": "k-p2", "tenant": "b", "max_priority": "P2"}]})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1",
                               max_prompt_chars=1000, max_body_bytes=4096)
    runner = build(settings, CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner._http_app)  # noqa: SLF001 - the same app uvicorn serves
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def chat(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


AUTH = {"Authorization": "Bearer k-p0"}


async def post(client: httpx.AsyncClient, body: object, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return await client.post("/v1/chat/completions", content=content,
                             headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)})


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def test_missing_and_wrong_keys_are_401(client: httpx.AsyncClient) -> None:
    assert_openai_error(await post(client, chat(), headers={}), 401)
    error = assert_openai_error(await post(client, chat(), headers={"Authorization": "Bearer nope"}), 401)
    assert error["type"] == "authentication_error"


@pytest.mark.parametrize("body,param", [
    (chat(messages=[]), "messages"),
    ({"model": "m"}, "messages"),
    (chat(messages="hello"), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-3), "max_tokens"),
    (chat(max_tokens="ten"), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=9), "temperature"),
    (chat(stream="yes"), "stream"),
    (chat(model=12), "model"),
    (chat(n=2), "n"),
    (chat(stop=[1, 2]), "stop"),
    (chat(messages=[{"role": "user", "content": "x" * 1001}]), "messages"),
    (chat(priority="P9"), "priority"),
])
async def test_bad_bodies_are_400(client: httpx.AsyncClient, body: object, param: str) -> None:
    error = assert_openai_error(await post(client, body), 400, param)
    assert error["type"] == "invalid_request_error"


async def test_malformed_json_invalid_utf8_and_non_object_are_400(client: httpx.AsyncClient) -> None:
    assert assert_openai_error(await post(client, None, raw=b'{"messages": [}'), 400)["code"] == "invalid_json"
    assert assert_openai_error(await post(client, None, raw=b'{"model": "\xff\xfe"}'), 400)["code"] == \
        "invalid_encoding"
    assert_openai_error(await post(client, [1, 2, 3]), 400)
    assert_openai_error(await post(client, None, raw=b"x" * 5000), 400)


async def test_priority_above_the_key_is_403(client: httpx.AsyncClient) -> None:
    resp = await post(client, chat(priority="P0"), headers={"Authorization": "Bearer k-p2"})
    assert_openai_error(resp, 403, "priority")
    resp = await post(client, chat(), headers={"Authorization": "Bearer k-p2", "X-Goodput-Priority": "P1"})
    assert_openai_error(resp, 403, "priority")


async def test_valid_request_without_backend_is_503_not_500(client: httpx.AsyncClient) -> None:
    resp = await post(client, chat())
    assert_openai_error(resp, 503)


async def test_unknown_route_is_404_in_openai_shape(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing", headers=AUTH), 404)


async def test_completions_validation(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": ""}, headers=AUTH)
    assert_openai_error(resp, 400, "prompt")
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]}, headers=AUTH)
    assert_openai_error(resp, 400, "prompt")


async def test_scheduler_down_with_a_known_model_is_503(client: httpx.AsyncClient) -> None:
    """With the model list cached, the first contact with the scheduler is the lease itself."""
    from goodput_gateway.pipeline import ModelEntry

    service = client._transport.app.state.goodput_service  # type: ignore[attr-defined]  # noqa: SLF001
    service.pipeline._models = (1e18, [ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1)])  # noqa: SLF001
    assert_openai_error(await post(client, chat()), 503)
