"""Every input a caller sends is bounded by a setting and refused by name before anything is spent on it: REST with
400/413/431 in OpenAI's error shape, gRPC with INVALID_ARGUMENT / RESOURCE_EXHAUSTED; an unauthenticated caller's
body or message is not read at all. No backend runs here (the scheduler address is a closed port): a request that
got past the checks would be a 503, an embeddings or search call a 501."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.errors import InvalidArgument

from goodput_gateway.__main__ import build
from goodput_gateway.auth import ApiKeyStore
from goodput_gateway.config import GatewaySettings
from goodput_gateway.guard import PublicApiGuard

KEYS = json.dumps({"keys": [{"key": "k-p0", "tenant": "a", "max_priority": "P0"},
                            {"key": "k-batch", "tenant": "b", "max_priority": "P2"}]})
LIMITS = {"body_bytes": 64 << 10, "header_bytes": 4096, "grpc_message_bytes": 64 << 10, "messages": 4,
          "message_chars": 100, "prompt_chars": 300, "name_chars": 32, "stop_sequences": 2, "stop_chars": 8,
          "query_chars": 50, "embed_batch": 3, "embed_input_chars": 20}
AUTH = {"Authorization": "Bearer k-p0"}
BATCH = {"Authorization": "Bearer k-batch"}


def settings() -> GatewaySettings:
    return GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1",
                           limits=LIMITS)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    runner = build(settings(), CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner.http_app)  # the same app uvicorn serves
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def chat(**overrides: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **overrides}


def error_of(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param", [
    (chat(user="u" * 33), "user"),
    (chat(model="m" * 33), "model"),
    (chat(knowledge_base="k" * 33), "knowledge_base"),
    (chat(messages=[{"role": "user", "content": "x"}] * 5), "messages"),
    (chat(messages=[{"role": "user", "content": "x" * 101}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": "x" * 100}] * 4), "messages"),  # each fits, the sum does not
    (chat(messages=[{"role": "user", "content": "x", "name": "n" * 33}]), "messages[0].name"),
    (chat(stop=["a", "b", "c"]), "stop"),
    (chat(stop=["a", "123456789"]), "stop[1]"),
    (chat(top_k=2**40), "top_k"),
    (chat(seed=2**70), "seed"),
    (chat(max_tokens=10**30), "max_tokens"),
    # every field the prompt is rendered from counts: tool-call arguments, the ids tool answers name, names
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 200}}]}]),
     "messages[0].tool_calls"),
    (chat(messages=[{"role": "tool", "content": "r", "tool_call_id": "i" * 33}]), "messages[0].tool_call_id"),
    (chat(messages=[{"role": "user", "content": "x" * 100, "name": "n"}] * 3), "messages"),
    # schemas the engine compiles into a grammar: repetition counts are bounded
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "minItems": 100_000}}}), "response_format"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 10**6}}}}}]),
     "tools[0].function.parameters"),
])
async def test_chat_fields_above_their_bounds_are_400_by_name(client: httpx.AsyncClient, body: object,
                                                              param: str) -> None:
    error_of(await client.post("/v1/chat/completions", json=body, headers=AUTH), 400, param)


async def test_completion_prompt_above_its_bound_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 101}, headers=AUTH)
    error_of(resp, 400, "prompt")


async def test_knowledge_base_header_is_bounded_too(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(),
                             headers={**AUTH, "X-Goodput-Knowledge-Base": "k" * 33})
    error_of(resp, 400, "knowledge_base")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}, "input"),
    ("/v1/embeddings", {"input": ["a", "x" * 21]}, "input[1]"),
    ("/v1/knowledge-bases/kb/search", {"query": "q" * 51}, "query"),
    ("/v1/knowledge-bases/kb/search", {"query": "q", "top_k": 2**40}, "top_k"),
    (f"/v1/knowledge-bases/{'k' * 33}/search", {"query": "q"}, "knowledge_base"),
    (f"/v1/knowledge-bases/{'k' * 33}/documents", {"documents": []}, "knowledge_base"),
])
async def test_knowledge_inputs_are_bounded_before_any_backend(client: httpx.AsyncClient, path: str,
                                                               body: object, param: str) -> None:
    error_of(await client.post(path, json=body, headers=AUTH), 400, param)


@pytest.mark.parametrize("body,headers", [
    (chat(priority="4"), AUTH), (chat(priority="99"), BATCH), (chat(priority=99), BATCH), (chat(priority="P3"), AUTH),
    (chat(), {**BATCH, "X-Goodput-Priority": "99"}), (chat(), {**BATCH, "X-Goodput-Priority": "4"}),
])
async def test_undefined_priorities_are_400_on_rest(client: httpx.AsyncClient, body: object,
                                                    headers: dict[str, str]) -> None:
    error_of(await client.post("/v1/chat/completions", json=body, headers=headers), 400, "priority")


class Upload:
    """A request body sent in pieces without a length (chunked), counting how much of it the server took."""

    def __init__(self, total: int, piece: int = 16 << 10) -> None:
        self.total, self.piece, self.sent = total, piece, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.total:
            self.sent += self.piece
            yield b" " * self.piece


async def test_chunked_body_over_the_limit_is_413_without_being_read_to_its_end(client: httpx.AsyncClient) -> None:
    upload = Upload(5_000_000)
    resp = await client.post("/v1/chat/completions", content=upload, headers=AUTH)
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    assert error_of(resp, 413)["code"] == "request_too_large"
    assert upload.sent <= LIMITS["body_bytes"] + 2 * upload.piece  # stopped at the limit, not at 5 MB


async def test_declared_length_over_the_limit_is_413_before_any_of_it_is_read(client: httpx.AsyncClient) -> None:
    upload = Upload(5_000_000)
    resp = await client.post("/v1/chat/completions", content=upload,
                             headers={**AUTH, "Content-Length": "5000000"})
    assert error_of(resp, 413)["code"] == "request_too_large"
    assert upload.sent <= upload.piece


async def test_unauthenticated_body_is_not_read(client: httpx.AsyncClient) -> None:
    upload = Upload(5_000_000)
    error_of(await client.post("/v1/chat/completions", content=upload), 401)
    assert upload.sent <= upload.piece


async def test_bodies_are_bounded_on_every_route(client: httpx.AsyncClient) -> None:
    for path in ("/v1/completions", "/v1/embeddings", "/v1/knowledge-bases/kb/search",
                 "/v1/knowledge-bases/kb/documents"):
        upload = Upload(1_000_000)
        assert error_of(await client.post(path, content=upload, headers=AUTH), 413)["code"] == "request_too_large"
        assert upload.sent < 1_000_000


async def test_headers_over_the_limit_are_431(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(), headers={**AUTH, "X-Padding": "p" * 5000})
    assert error_of(resp, 431)["code"] == "request_header_fields_too_large"
    resp = await client.get("/v1/models?" + "q" * 5000, headers=AUTH)
    error_of(resp, 431)


# ---- gRPC ---------------------------------------------------------------------------------------------------


@pytest.fixture
async def stub() -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    runner = build(settings(), CollectorRegistry(), None)
    await runner.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        await runner.stop()


def generate(**fields: object) -> gateway_pb2.GenerateRequest:
    fields.setdefault("messages", [types_pb2.ChatMessage(role="user", content="hi")])
    return gateway_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        await call  # type: ignore[misc]
    return err.value


@pytest.mark.parametrize("priority", [4, 99, -1])
@pytest.mark.parametrize("key", ["k-batch", "k-p0"])
async def test_undefined_priorities_are_invalid_argument_on_grpc(stub: gateway_pb2_grpc.GatewayStub, priority: int,
                                                                 key: str) -> None:
    for call in (stub.Generate(generate(priority=priority), metadata=md(key), timeout=10),
                 _first(stub.GenerateStream(generate(priority=priority), metadata=md(key), timeout=10))):
        err = await refused(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert dict(err.trailing_metadata())["goodput-error-param"] == "priority"


async def _first(stream: object) -> object:
    async for item in stream:  # type: ignore[attr-defined]
        return item
    return None


@pytest.mark.parametrize("fields,param", [
    ({"session_id": "s" * 33}, "user"),
    ({"knowledge_base": "k" * 33}, "knowledge_base"),
    ({"model": "m" * 33}, "model"),
    ({"messages": [types_pb2.ChatMessage(role="user", content="x")] * 5}, "messages"),
    ({"messages": [types_pb2.ChatMessage(role="user", content="x" * 101)]}, "messages[0].content"),
    ({"sampling": types_pb2.SamplingParams(stop=["123456789"])}, "stop[0]"),
    ({"prompt_cache_key": "c" * 33}, "prompt_cache_key"),
    ({"safety_identifier": "u" * 33}, "safety_identifier"),
    # vLLM's extensions, bounded on gRPC as on REST
    ({"sampling": types_pb2.SamplingParams(max_tokens=8, min_tokens=9)}, "min_tokens"),
    ({"sampling": types_pb2.SamplingParams(stop_token_ids=list(range(9)))}, "stop_token_ids"),
    ({"sampling": types_pb2.SamplingParams(min_p=2.0)}, "min_p"),
    ({"sampling": types_pb2.SamplingParams(truncate_prompt_tokens=0)}, "truncate_prompt_tokens"),
    ({"messages": [types_pb2.ChatMessage(role="tool", content="r", tool_call_id="i" * 33)]},
     "messages[0].tool_call_id"),
    # a schema arrives as text on gRPC: its depth is checked here, past what the interpreter could parse too
    ({"sampling": types_pb2.SamplingParams(json_schema='{"a":' * 40 + "1" + "}" * 40)}, "response_format"),
    ({"sampling": types_pb2.SamplingParams(json_schema="[" * 5000 + "]" * 5000)}, "response_format"),
    ({"tools": [gateway_pb2.Function(name="f", parameters_json='{"a":' * 5000 + "1" + "}" * 5000)]},
     "tools[0].parameters_json"),
])
async def test_grpc_fields_above_their_bounds_are_invalid_argument(stub: gateway_pb2_grpc.GatewayStub,
                                                                   fields: dict[str, object], param: str) -> None:
    err = await refused(stub.Generate(generate(**fields), metadata=md("k-p0"), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert dict(err.trailing_metadata())["goodput-error-param"] == param


async def test_grpc_knowledge_inputs_are_bounded(stub: gateway_pb2_grpc.GatewayStub) -> None:
    for call in (stub.Embed(gateway_pb2.EmbedRequest(texts=["a"] * 4), metadata=md("k-p0"), timeout=10),
                 stub.Search(gateway_pb2.SearchRequest(knowledge_base="kb", query="q" * 51), metadata=md("k-p0"),
                             timeout=10)):
        err = await refused(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err


async def test_oversized_unauthenticated_message_is_refused_unread(stub: gateway_pb2_grpc.GatewayStub) -> None:
    big = generate(prompt="x" * (20 << 20), messages=[])
    for metadata in ((), md("wrong")):
        err = await refused(stub.Generate(big, metadata=metadata, timeout=20))
        # UNAUTHENTICATED, not RESOURCE_EXHAUSTED: the key was checked before the 20 MiB were looked at
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        err = await refused(_first(stub.GenerateStream(big, metadata=metadata, timeout=20)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err


async def test_oversized_authenticated_message_is_resource_exhausted(stub: gateway_pb2_grpc.GatewayStub) -> None:
    big = generate(prompt="x" * (1 << 20), messages=[])
    err = await refused(stub.Generate(big, metadata=md("k-p0"), timeout=20))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    err = await refused(_first(stub.GenerateStream(big, metadata=md("k-p0"), timeout=20)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    # under the limit, the same call reaches the domain checks (the prompt is too long for them)
    err = await refused(stub.Generate(generate(prompt="x" * 1000, messages=[]), metadata=md("k-p0"), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err


class Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method, self.invocation_metadata = method, metadata


class Context:
    def __init__(self) -> None:
        self.aborted: grpc.StatusCode | None = None

    def set_trailing_metadata(self, md: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = code
        raise RuntimeError("aborted")


async def test_guard_refuses_without_reading_the_request() -> None:
    keys = ApiKeyStore.from_sources(inline=KEYS)
    guard = PublicApiGuard(keys, max_message_bytes=1024)
    parsed: list[bytes] = []

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        async def behaviour(request: object, context: object) -> object:
            return request
        return grpc.unary_unary_rpc_method_handler(behaviour, request_deserializer=lambda raw: parsed.append(raw))

    read = 0

    async def requests() -> AsyncIterator[bytes]:
        nonlocal read
        read += 1
        yield b"x" * 10

    handler = await guard.intercept_service(continuation, Details("/goodput.gateway.v1.Gateway/Generate", ()))
    assert handler.request_streaming and handler.request_deserializer is None
    context = Context()
    with pytest.raises(RuntimeError):
        await handler.stream_unary(requests(), context)
    assert context.aborted == grpc.StatusCode.UNAUTHENTICATED and read == 0 and parsed == []
    # a valid key: the message is read, checked for size, then parsed
    handler = await guard.intercept_service(continuation, Details("/goodput.gateway.v1.Gateway/Generate",
                                                                  (("authorization", "Bearer k-p0"),)))
    await handler.stream_unary(requests(), Context())
    assert read == 1 and parsed == [b"x" * 10]


def test_settings_reject_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        GatewaySettings(limits={"body_bytes": 10})
    with pytest.raises(ValueError):
        GatewaySettings(limits={"name_chars": 0})


def test_resolving_an_undefined_priority_is_invalid_argument() -> None:
    principal = ApiKeyStore.from_sources(inline=KEYS).authenticate("Bearer k-batch")
    for value in (4, 99, -1):
        with pytest.raises(InvalidArgument) as err:
            principal.resolve_priority(value)
        assert err.value.param == "priority"
