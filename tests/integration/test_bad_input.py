"""Bad input gets a clear error through the whole platform, never a 5xx or a hang: REST in OpenAI's error shape,
gRPC as a status code."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, KEY_P2

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

USER = [{"role": "user", "content": "hello"}]


def post(platform: Platform, body: object = None, *, key: str | None = KEY_P0, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(platform.gateway_http + "/v1/chat/completions", content=content, headers=h, timeout=60)


def error_of(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    return error


def test_missing_api_key_is_401(platform: Platform) -> None:
    assert error_of(post(platform, {"messages": USER}, key=None), 401)["type"] == "authentication_error"


def test_wrong_api_key_is_401_also_through_the_sdk(platform: Platform) -> None:
    error_of(post(platform, {"messages": USER}, key="not-a-key"), 401)
    client = openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="x", messages=USER)  # type: ignore[arg-type]


def test_malformed_json_is_400(platform: Platform) -> None:
    assert error_of(post(platform, raw=b'{"messages": [ '), 400)["code"] == "invalid_json"


def test_invalid_utf8_is_400(platform: Platform) -> None:
    raw = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    assert error_of(post(platform, raw=raw), 400)["code"] == "invalid_encoding"


def test_empty_messages_is_400(platform: Platform) -> None:
    assert error_of(post(platform, {"messages": []}), 400)["param"] == "messages"


def test_unknown_role_is_400(platform: Platform) -> None:
    error = error_of(post(platform, {"messages": [{"role": "narrator", "content": "x"}]}), 400)
    assert error["param"] == "messages[0].role"


def test_unknown_model_is_400(platform: Platform) -> None:
    error = error_of(post(platform, {"model": "gpt-17", "messages": USER}), 400)
    assert error["code"] == "model_not_found" and "gpt-17" in str(error["message"])


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_non_positive_max_tokens_is_400(platform: Platform, max_tokens: int) -> None:
    assert error_of(post(platform, {"messages": USER, "max_tokens": max_tokens}), 400)["param"] == "max_tokens"


def test_max_tokens_beyond_the_context_window_is_400(platform: Platform) -> None:
    error = error_of(post(platform, {"messages": USER, "max_tokens": 100_000}), 400)
    assert error["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_beyond_the_window_is_400_from_the_worker(platform: Platform) -> None:
    # ~1200 prompt tokens (the worker counts them exactly) + 1000 new tokens > the 2048-token window.
    long = " ".join(f"word{i}" for i in range(300))
    error = error_of(post(platform, {"messages": [{"role": "user", "content": long}], "max_tokens": 1000}), 400)
    assert error["code"] == "context_length_exceeded" and "context window" in str(error["message"])


def test_prompt_above_the_configured_limit_is_400(platform: Platform) -> None:
    huge = "x" * 40_000  # default GOODPUT_GATEWAY_LIMITS__PROMPT_CHARS is 32768
    error = error_of(post(platform, {"messages": [{"role": "user", "content": huge}]}), 400)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body", [
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": USER, "max_tokens": "10"},
    {"messages": USER, "temperature": "warm"},
    {"messages": USER, "stream": "true"},
    {"messages": USER, "model": ["a"]},
])
def test_wrong_types_are_400(platform: Platform, body: dict[str, object]) -> None:
    assert error_of(post(platform, body), 400)["type"] == "invalid_request_error"


def test_priority_above_the_keys_allowance_is_403(platform: Platform) -> None:
    error = error_of(post(platform, {"messages": USER, "priority": "P0"}, key=KEY_P2), 403)
    assert error["param"] == "priority"
    error_of(post(platform, {"messages": USER}, key=KEY_P2, headers={"X-Goodput-Priority": "P1"}), 403)
    # The same key at its own class is served.
    assert post(platform, {"messages": USER, "max_tokens": 2}, key=KEY_P2).status_code == 200


def _grpc_error(platform: Platform, request: gateway_pb2.GenerateRequest, key: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(platform.gateway_grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.GenerateStream(request, metadata=metadata, timeout=30))
    return exc.value.code()  # type: ignore[no-any-return, attr-defined]


def test_grpc_errors_carry_status_codes(platform: Platform) -> None:
    ok_messages = [types_pb2.ChatMessage(role="user", content="hi")]
    assert _grpc_error(platform, gateway_pb2.GenerateRequest(messages=ok_messages), None) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert _grpc_error(platform, gateway_pb2.GenerateRequest(messages=ok_messages), "wrong") == \
        grpc.StatusCode.UNAUTHENTICATED
    assert _grpc_error(platform, gateway_pb2.GenerateRequest(), KEY_P0) == grpc.StatusCode.INVALID_ARGUMENT
    bad_role = [types_pb2.ChatMessage(role="narrator", content="x")]
    assert _grpc_error(platform, gateway_pb2.GenerateRequest(messages=bad_role), KEY_P0) == \
        grpc.StatusCode.INVALID_ARGUMENT
    too_long = gateway_pb2.GenerateRequest(messages=ok_messages,
                                           sampling=types_pb2.SamplingParams(max_tokens=100_000))
    assert _grpc_error(platform, too_long, KEY_P0) == grpc.StatusCode.INVALID_ARGUMENT
    urgent = gateway_pb2.GenerateRequest(messages=ok_messages, priority=types_pb2.PRIORITY_P0)
    assert _grpc_error(platform, urgent, KEY_P2) == grpc.StatusCode.PERMISSION_DENIED
