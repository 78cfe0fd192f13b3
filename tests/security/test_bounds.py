"""Input bounds, black-box: oversized fields, bodies (chunked too), heads and gRPC messages, and undefined priority
classes each get their refusal from a real gateway, never a 5xx, a hang or a crash, and the platform serves normally
afterwards.

The platform is real processes on localhost with a simulated inference worker (``GOODPUT_INFERENCE_ENGINE=sim``),
so no model is needed; the gateway runs with its default bounds.
"""

from __future__ import annotations

import hashlib
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 2600
KEY, BATCH_KEY = "test-key-bounds", "test-key-bounds-batch"
MiB = 1 << 20


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    keys = [{"key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "bounds", "max_priority": "P0"},
            {"key_sha256": hashlib.sha256(BATCH_KEY.encode()).hexdigest(), "tenant": "bounds-batch",
             "max_priority": "P2"}]
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    p = Platform(workdir=tmp_path_factory.mktemp("bounds"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=False)
    with p:  # started here, stopped after the module's tests
        yield p


@pytest.fixture(scope="module")
def http(platform: Platform) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=platform.gateway_http, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def stub(platform: Platform) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def chat(**overrides: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **overrides}


def refusal(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def test_a_million_character_user_is_refused_by_name(http: httpx.Client) -> None:
    refusal(http.post("/v1/chat/completions", json=chat(user="u" * 1_000_000)), 400, "user")


@pytest.mark.parametrize("overrides,param", [
    ({"model": "m" * 10_000}, "model"),
    ({"knowledge_base": "k" * 10_000}, "knowledge_base"),
    ({"messages": [{"role": "user", "content": "x"}] * 300}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 40_000}]}, "messages[0].content"),
    ({"stop": ["s"] * 10}, "stop"),
    ({"stop": ["s" * 10_000]}, "stop[0]"),
    ({"seed": 2**80}, "seed"),
])
def test_oversized_fields_are_400_by_name(http: httpx.Client, overrides: dict[str, object], param: str) -> None:
    refusal(http.post("/v1/chat/completions", json=chat(**overrides)), 400, param)


@pytest.mark.parametrize("body,headers", [
    (chat(priority="4"), {}), (chat(priority="99"), {}), (chat(priority=99), {}),
    (chat(), {"X-Goodput-Priority": "99"}),
])
def test_undefined_priorities_are_400_on_rest(platform: Platform, body: object, headers: dict[str, str]) -> None:
    resp = httpx.post(f"{platform.gateway_http}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {BATCH_KEY}", **headers})
    refusal(resp, 400, "priority")


def test_a_body_above_the_limit_is_413(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", content=b" " * (2 * MiB), headers={"Content-Type": "application/json"})
    assert refusal(resp, 413)["code"] == "request_too_large"


def _chunked_upload(platform: Platform, total: int, *, key: str = KEY) -> tuple[bytes, int]:
    """Sends a chunked body of ``total`` bytes in 64 KiB chunks, stopping as soon as an answer arrives; the answer
    and how much was sent."""
    url = urlsplit(platform.gateway_http)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    piece = 64 << 10
    chunk = f"{piece:x}\r\n".encode() + b" " * piece + b"\r\n"
    sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head)
        deadline = time.monotonic() + 30
        while sent < total and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sock.sendall(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += piece
        answer = b""
        sock.settimeout(10)
        while b"\r\n\r\n" not in answer or len(answer) < answer.find(b"\r\n\r\n") + 4 + _length(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer, sent


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


# Far above any limit and above what the sockets' buffers can absorb, so a body read to its end shows as one that
# was sent in full (a 5 MB body could fit in the buffers of a loaded machine before the answer came back).
ENDLESS = 64 << 20


def test_a_chunked_body_above_the_limit_is_413_before_it_ends(platform: Platform) -> None:
    answer, sent = _chunked_upload(platform, ENDLESS)
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert sent < ENDLESS, "the gateway read the whole body before answering"


def test_an_unauthenticated_chunked_body_is_401_unread(platform: Platform) -> None:
    answer, sent = _chunked_upload(platform, ENDLESS, key="wrong")
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert sent < ENDLESS


def test_headers_above_the_limit_are_refused(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json=chat(), headers={"X-Padding": "p" * (64 << 10)})
    assert refusal(resp, 431)["code"] == "request_header_fields_too_large"


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_an_oversized_unauthenticated_grpc_message_is_refused_unread(platform: Platform,
                                                                     stub: gateway_pb2_grpc.GatewayStub) -> None:
    pid = platform.pid("gateway")
    assert pid is not None
    big = gateway_pb2.GenerateRequest(prompt="x" * (20 * MiB))
    before = _peak_rss_kib(pid)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(big, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        next(stub.GenerateStream(big, metadata=(("authorization", "Bearer wrong"),), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    # Parsed, one such message raised the gateway's peak by ~55 MiB; refused unread, the two together cost less than
    # one message (what HTTP/2 flow control let in before the refusal).
    grown_mib = (_peak_rss_kib(pid) - before) / 1024
    assert grown_mib < 20, f"the gateway's peak memory grew {grown_mib:.1f} MiB on two refused 20 MiB messages"


def test_an_oversized_authenticated_grpc_message_is_resource_exhausted(stub: gateway_pb2_grpc.GatewayStub) -> None:
    big = gateway_pb2.GenerateRequest(prompt="x" * (20 * MiB))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(big, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields,param", [
    ({"priority": 4}, "priority"), ({"priority": 99}, "priority"),
    ({"session_id": "s" * 1_000_000}, "user"),
    ({"sampling": types_pb2.SamplingParams(stop=["s"] * 10)}, "stop"),
])
def test_grpc_refuses_undefined_priorities_and_oversized_fields(stub: gateway_pb2_grpc.GatewayStub,
                                                                fields: dict[str, object], param: str) -> None:
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="Say hi.")],
                                          **fields)  # type: ignore[arg-type]
    metadata = (("authorization", f"Bearer {BATCH_KEY}"),)
    for call in (lambda: stub.Generate(request, metadata=metadata, timeout=30),
                 lambda: next(stub.GenerateStream(request, metadata=metadata, timeout=30))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert dict(err.value.trailing_metadata())["goodput-error-param"] == param  # type: ignore[attr-defined]


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("route,raw,param", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4}',
     "messages[0].content"),
    ("/v1/completions", r'{"prompt": "a\udfffb", "max_tokens": 4}', "prompt"),
    ("/v1/embeddings", r'{"model": "m", "input": ["fine", "a\ud800"]}', "input[1]"),
    ("/v1/responses", r'{"input": "a\udbff", "max_output_tokens": 4}', "input"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"\ud800": "x"}}',
     "metadata"),
])
def test_text_that_is_not_unicode_is_400_by_name(http: httpx.Client, route: str, raw: str, param: str) -> None:
    # JSON's escapes can spell a lone surrogate, which no encoder downstream takes: it could never be served
    assert refusal(http.post(route, content=raw, headers=JSON), 400, param)["code"] == "invalid_encoding"


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
def test_deeply_nested_json_is_400(http: httpx.Client, depth: int) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi"}], "metadata": {"x": ' + "[" * depth + "]" * depth + "}}"
    assert refusal(http.post("/v1/chat/completions", content=raw, headers=JSON), 400)["code"] == "json_too_deep"


@pytest.mark.parametrize("path", ["/v1/files/file-x:content", "/v1/files/file-x:content/content",
                                  "/v1/batches/batch-x:y", "/v1/responses/resp-x:y", "/v1/jobs/job-x:y",
                                  "/v1/files/%00", "/v1/batches/" + "b" * 10_000])
def test_unknown_ids_are_404(http: httpx.Client, path: str) -> None:
    assert http.get(path).status_code == 404


def test_text_that_is_not_utf8_is_invalid_argument_on_grpc(platform: Platform) -> None:
    # What a client in another language can send: a string field's bytes that are not UTF-8 (a CESU-8 surrogate)
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="a---b")],
                                          sampling=types_pb2.SamplingParams(max_tokens=4)).SerializeToString()
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        generate = channel.unary_unary("/goodput.gateway.v1.Gateway/Generate")
        with pytest.raises(grpc.RpcError) as err:
            generate(request.replace(b"a---b", b"a\xed\xa0\x80b"), metadata=(("authorization", f"Bearer {KEY}"),),
                     timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value  # type: ignore[attr-defined]


def test_the_platform_still_serves_after_all_of_it(platform: Platform, http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json=chat())
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] is not None
    assert platform.exited() == {}


def test_grpc_serves_through_the_guard(stub: gateway_pb2_grpc.GatewayStub) -> None:
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="Say hi.")],
                                          sampling=types_pb2.SamplingParams(max_tokens=4))
    metadata = (("authorization", f"Bearer {KEY}"),)
    answer = stub.Generate(request, metadata=metadata, timeout=30)
    assert answer.usage.completion_tokens > 0
    events = list(stub.GenerateStream(request, metadata=metadata, timeout=30))
    assert events[0].HasField("start") and events[-1].HasField("end")
    assert [m.id for m in stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=30).models]


def test_metrics_are_not_served_on_the_public_port(platform: Platform) -> None:
    # They count tenants and keys: without a key, with one, and under vLLM's path alike, the REST port has none;
    # the scraper reads them on the gateway's metrics port.
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        for path in ("/metrics", "/metrics/", "/v1/metrics"):
            resp = httpx.get(platform.gateway_http + path, headers=headers, timeout=10)
            assert resp.status_code == 404 and "goodput_" not in resp.text, path
    scraped = httpx.get(platform.gateway_metrics, timeout=10)
    assert scraped.status_code == 200 and "goodput_gateway_requests_total" in scraped.text
