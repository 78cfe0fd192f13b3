"""Bad REST input gets a 4xx in OpenAI's error shape before anything reaches the scheduler (no backend runs here:
the scheduler address points at a closed port, so a request that got past validation would fail with 503)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from goodput_gateway.__main__ import build
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.config import GatewaySettings

from .helpers import AUTH, KEYS, GatewayFactory, assert_openai_error, chat, post


@pytest.fixture
async def client(gateway: GatewayFactory) -> httpx.AsyncClient:
    return (await gateway(limits={"prompt_chars": 1000, "body_bytes": 4096})).client


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
    (chat(n=9), "n"),  # above LIMITS__CHOICES (8)
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
    assert assert_openai_error(await post(client, None, raw=b"x" * 5000), 413)["code"] == "request_too_large"


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


async def test_scheduler_down_with_a_known_model_is_503(gateway: GatewayFactory) -> None:
    """With the model list cached, the first contact with the scheduler is the lease itself."""
    gw = await gateway(models=[ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1)])
    assert_openai_error(await post(gw.client, chat()), 503)


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("store", True),
    ("reasoning_effort", "low"),
    ("frobnicate", 1),  # not an OpenAI parameter at all
])
async def test_fields_the_gateway_does_not_implement_are_refused_by_name(
        client: httpx.AsyncClient, field: str, value: object) -> None:
    error = assert_openai_error(await post(client, chat(**{field: value})), 400, field)
    assert error["code"] == "unsupported_parameter" and field in str(error["message"])


@pytest.mark.parametrize("overrides", [
    {"n": 1}, {"logprobs": False}, {"tools": []}, {"tool_choice": None}, {"response_format": {"type": "text"}},
    {"stream_options": None}, {"user": "session-1"}, {"max_completion_tokens": 5}, {"stop": "\n"},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": "hi", "name": "ann"}]},
])
async def test_values_that_ask_for_nothing_more_are_served(client: httpx.AsyncClient,
                                                          overrides: dict[str, object]) -> None:
    # past validation: no backend here, so the honest answer is 503
    assert_openai_error(await post(client, chat(**overrides)), 503)


@pytest.mark.parametrize("message,param,code", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
     "messages[0].tool_calls[0].function", "missing_required_parameter"),
    ({"role": "tool", "content": "42", "tool_call_id": 1}, "messages[0].tool_call_id", "invalid_type"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]},
     "messages[0].content", "unsupported_value"),
    ({"role": "user", "content": "hi", "mood": "happy"}, "messages[0].mood", "unsupported_parameter"),
    ({"content": "hi"}, "messages[0].role", "missing_required_parameter"),
])
async def test_message_fields_are_checked_by_name(client: httpx.AsyncClient, message: dict[str, object],
                                                  param: str, code: str) -> None:
    error = assert_openai_error(await post(client, chat(messages=[message])), 400, param)
    assert error["code"] == code


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "a", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"prompt": "a", "suffix": "b"}, "suffix", "unsupported_parameter"),
    ({"prompt": "a", "logprobs": 6}, "logprobs", "invalid_value"),  # the legacy API's at most 5
    ({"prompt": [1, 2, 3]}, "prompt", "unsupported_value"),
    ({"prompt": 7}, "prompt", "invalid_type"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({}, "prompt", "missing_required_parameter"),
])
async def test_completions_refuse_what_they_do_not_implement(client: httpx.AsyncClient, body: dict[str, object],
                                                             param: str, code: str) -> None:
    resp = await client.post("/v1/completions", json={"model": "m", **body}, headers=AUTH)
    assert assert_openai_error(resp, 400, param)["code"] == code


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/embeddings", {"input": "a", "dimensions": 64}, "dimensions", "unsupported_parameter"),
    ("/v1/embeddings", {"input": [[1, 2]]}, "input", "unsupported_value"),
    ("/v1/embeddings", {"input": 5}, "input", "invalid_type"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ("/v1/embeddings", {}, "input", "missing_required_parameter"),
    ("/v1/knowledge-bases/kb/search", {"query": "q", "top_k": -1}, "top_k", "invalid_value"),
    ("/v1/knowledge-bases/kb/search", {"query": "q", "dense_weight": "half"}, "dense_weight", "invalid_type"),
    ("/v1/knowledge-bases/kb/search", {"query": "q", "rerank": "yes"}, "rerank", "invalid_type"),
    ("/v1/knowledge-bases/kb/search", {"q": "typo"}, "q", "unsupported_parameter"),
    ("/v1/knowledge-bases/kb/documents", {"documents": [{"id": 1}]}, "documents[0].id", "invalid_type"),
    ("/v1/knowledge-bases/kb/documents", {"documents": [{"text": "x", "metadata": []}]}, "documents[0].metadata",
     "invalid_type"),
    ("/v1/knowledge-bases/kb/documents", {"delete_ids": [3]}, "delete_ids[0]", "invalid_type"),
])
async def test_knowledge_bodies_are_checked_before_any_backend(client: httpx.AsyncClient, path: str,
                                                               body: dict[str, object], param: str,
                                                               code: str) -> None:
    # no embedder or retriever is configured: a body that got past validation would be a 501
    assert assert_openai_error(await client.post(path, json=body, headers=AUTH), 400, param)["code"] == code
    assert (await client.post(path, json={"input": "a"} if "embed" in path else {}, headers=AUTH)).status_code == 501


async def test_grpc_requests_pass_the_same_domain_checks() -> None:
    from goodput.common.v1 import types_pb2
    from goodput.gateway.v1 import gateway_pb2

    from goodput_core.errors import InvalidArgument

    from goodput_gateway.requests import validate
    from goodput_gateway.servicer import from_proto

    settings = GatewaySettings(limits={"prompt_chars": 1000})
    for sampling, param in ((types_pb2.SamplingParams(temperature=9), "temperature"),
                            (types_pb2.SamplingParams(top_p=0), "top_p"),
                            (types_pb2.SamplingParams(max_tokens=-1), "max_tokens"),
                            (types_pb2.SamplingParams(stop=list("abcde")), "stop")):
        req = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="hi")],
                                          sampling=sampling)
        with pytest.raises(InvalidArgument) as err:
            validate(from_proto(req, stream=False, max_json_depth=settings.limits.json_depth), settings)
        assert err.value.param == param
    too_long = gateway_pb2.GenerateRequest(prompt="x" * 1001)
    with pytest.raises(InvalidArgument) as err:
        validate(from_proto(too_long, stream=True, max_json_depth=settings.limits.json_depth), settings)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


async def test_grpc_refuses_bad_input_with_the_param_named() -> None:
    import grpc
    from goodput.common.v1 import types_pb2
    from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from grpc import aio

    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1")
    runner = build(settings, CollectorRegistry(), None)
    await runner.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="hi")],
                                                  sampling=types_pb2.SamplingParams(temperature=9))
            with pytest.raises(grpc.RpcError) as err:
                await stub.Generate(request, metadata=(("authorization", "Bearer k-p0"),), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert dict(err.value.trailing_metadata())["goodput-error-param"] == "temperature"  # type: ignore[attr-defined]
    finally:
        await runner.stop()


# ---- response_format (structured output) ------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_response_format_json_schema_becomes_the_canonical_schema_text() -> None:
    from goodput_gateway.generation_schemas import ChatCompletionRequest, to_body
    from goodput_gateway.schemas import parse

    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                        "strict": True}})
    req = parse(ChatCompletionRequest, body).to_request()
    assert req.sampling.json_schema is not None and json.loads(req.sampling.json_schema) == CITY
    assert req.sampling.structured and not req.sampling.json_object
    # a parked job's body parses back to the same request
    route, again = to_body(req)
    assert route == "chat" and parse(ChatCompletionRequest, again).to_request() == req
    obj = parse(ChatCompletionRequest, chat(response_format={"type": "json_object"})).to_request()
    assert obj.sampling.json_object and obj.sampling.json_schema is None
    text = parse(ChatCompletionRequest, chat(response_format={"type": "text"})).to_request()
    assert not text.sampling.structured


@pytest.mark.parametrize("response_format,param", [
    ({"type": "json_schema"}, "response_format"),  # no schema
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": CITY}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "json_object", "json_schema": {"name": "c", "schema": CITY}}, "response_format"),
])
async def test_a_malformed_response_format_is_refused_by_name(client: httpx.AsyncClient, response_format: object,
                                                              param: str) -> None:
    assert_openai_error(await post(client, chat(response_format=response_format)), 400, param)


async def test_a_schema_above_its_bound_is_refused_before_any_backend(client: httpx.AsyncClient) -> None:
    huge = {"type": "object", "description": "x" * 5000}  # the fixture's body limit is 4096 bytes: a 413 first
    fmt = {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}}
    resp = await post(client, chat(response_format=fmt))
    assert resp.status_code == 413
    settings = GatewaySettings(limits={"response_schema_chars": 100})
    from goodput_core.errors import InvalidArgument

    from goodput_gateway.generation_schemas import ChatCompletionRequest
    from goodput_gateway.requests import validate
    from goodput_gateway.schemas import parse

    req = parse(ChatCompletionRequest, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "h", "schema": {"type": "object", "description": "x" * 200}}})).to_request()
    with pytest.raises(InvalidArgument) as err:
        validate(req, settings)
    assert err.value.param == "response_format"


async def test_completions_refuse_response_format_by_name(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", headers=AUTH,
                             json={"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}})
    assert_openai_error(resp, 400, "response_format")


# ---- logprobs ------------------------------------------------------------------------------------------------


def test_logprobs_become_the_number_of_top_tokens_per_position() -> None:
    from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest, to_body
    from goodput_gateway.schemas import parse

    chat_req = parse(ChatCompletionRequest, chat(logprobs=True, top_logprobs=3)).to_request()
    assert chat_req.sampling.logprobs == 3
    assert parse(ChatCompletionRequest, chat(logprobs=True)).to_request().sampling.logprobs == 0
    assert parse(ChatCompletionRequest, chat(logprobs=False)).to_request().sampling.logprobs is None
    legacy = parse(CompletionRequest, {"prompt": "a", "logprobs": 2}).to_request()
    assert legacy.sampling.logprobs == 2
    for req in (chat_req, legacy):  # a parked job's body parses back to the same request
        route, body = to_body(req)
        model = ChatCompletionRequest if route == "chat" else CompletionRequest
        assert parse(model, body).to_request() == req


@pytest.mark.parametrize("overrides,param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
])
async def test_bad_logprobs_are_refused_by_name(client: httpx.AsyncClient, overrides: dict[str, object],
                                                param: str) -> None:
    assert_openai_error(await post(client, chat(**overrides)), 400, param)


def test_top_logprobs_are_bounded_by_a_setting() -> None:
    from goodput_core.errors import InvalidArgument

    from goodput_gateway.generation_schemas import ChatCompletionRequest
    from goodput_gateway.requests import validate
    from goodput_gateway.schemas import parse

    req = parse(ChatCompletionRequest, chat(logprobs=True, top_logprobs=5)).to_request()
    validate(req, GatewaySettings())
    with pytest.raises(InvalidArgument) as err:
        validate(req, GatewaySettings(limits={"top_logprobs": 4}))
    assert err.value.param == "top_logprobs"


# ---- tools ----------------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("overrides,param,code", [
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto", "logprobs": True}, "logprobs", "unsupported_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name", "invalid_value"),
])
async def test_bad_tools_are_refused_by_name(client: httpx.AsyncClient, overrides: dict[str, object], param: str,
                                             code: str) -> None:
    assert assert_openai_error(await post(client, chat(**overrides)), 400, param)["code"] == code


@pytest.mark.parametrize("overrides", [{"tools": [WEATHER_TOOL]}, {"tools": [WEATHER_TOOL], "tool_choice": "auto"}])
async def test_auto_tools_need_the_models_tool_parser(gateway: GatewayFactory, overrides: dict[str, object]) -> None:
    """tool_choice auto (the default with tools) is refused by name, before any quota or worker is spent, for a
    model whose workers run no tool-call parser; it reaches the scheduler for one that does."""
    plain = await gateway(models=[ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1)])
    error = assert_openai_error(await post(plain.client, chat(**overrides)), 400, "tool_choice")
    assert error["code"] == "unsupported_value" and "parser" in str(error["message"])
    parsing = await gateway(models=[ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1,
                                               tool_call_parser="pythonic")])
    assert_openai_error(await post(parsing.client, chat(**overrides)), 503)  # admitted: the scheduler is next


def test_tools_survive_a_parked_jobs_round_trip_and_shape_the_engines_request() -> None:
    from goodput_gateway.generation_schemas import ChatCompletionRequest, to_body
    from goodput_gateway.schemas import parse
    from goodput_gateway.tools import apply_tools, tool_calls

    body = chat(tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    req = parse(ChatCompletionRequest, body).to_request()
    route, again = to_body(req)
    assert parse(ChatCompletionRequest, again).to_request() == req
    engine = apply_tools(req)
    assert engine.messages[0].role == "system" and "get_weather" in engine.messages[0].content
    assert "Called:" in engine.messages[2].content and "Result of call call_1" in engine.messages[3].content
    schema = json.loads(engine.sampling.json_schema or "")
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather"]  # one call: no array
    calls = tool_calls(req, '{"name": "get_weather", "arguments": {"city": "Paris"}}') or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert tool_calls(req, '{"name": "get_weath') is None  # cut short: stays text


# ---- logit_bias and seed ----------------------------------------------------------------------------------------

def test_logit_bias_is_carried_sorted_and_survives_a_parked_jobs_round_trip() -> None:
    from goodput_gateway.generation_schemas import ChatCompletionRequest, to_body
    from goodput_gateway.schemas import parse

    req = parse(ChatCompletionRequest, chat(logit_bias={"50256": -100, "7": 2.5}, seed=42)).to_request()
    assert req.sampling.logit_bias == ((7, 2.5), (50256, -100.0)) and req.sampling.seed == 42
    _, body = to_body(req)
    assert parse(ChatCompletionRequest, body).to_request() == req


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"5": -100.5}])
async def test_bad_logit_bias_is_refused_by_name(client: httpx.AsyncClient, bias: dict[str, float]) -> None:
    assert_openai_error(await post(client, chat(logit_bias=bias)), 400, "logit_bias")


def test_logit_bias_entries_are_bounded_by_a_setting() -> None:
    from goodput_core.errors import InvalidArgument

    from goodput_gateway.generation_schemas import ChatCompletionRequest
    from goodput_gateway.requests import validate
    from goodput_gateway.schemas import parse

    req = parse(ChatCompletionRequest, chat(logit_bias={str(i): 1 for i in range(5)})).to_request()
    with pytest.raises(InvalidArgument) as err:
        validate(req, GatewaySettings(limits={"logit_bias": 4}))
    assert err.value.param == "logit_bias"


# ---- vLLM's request extensions (what `vllm serve` clients and the field's benchmark tools send) ----------------


@pytest.mark.parametrize("overrides", [
    {"ignore_eos": True, "max_tokens": 32}, {"min_tokens": 4, "max_tokens": 8}, {"repetition_penalty": 1.1},
    {"min_p": 0.05}, {"stop_token_ids": [2, 7]}, {"include_stop_str_in_output": True},
    {"skip_special_tokens": False}, {"spaces_between_special_tokens": False}, {"truncate_prompt_tokens": 64},
    {"top_k": 20}, {"priority": 0},  # vLLM's default integer priority: taken as unset
    {"use_beam_search": False, "length_penalty": 1.0, "add_generation_prompt": True, "echo": False},
    {"prompt_cache_key": "faq-v2", "safety_identifier": "user-8c1f"},
])
async def test_vllm_extensions_and_openai_cache_fields_are_served(client: httpx.AsyncClient,
                                                                   overrides: dict[str, object]) -> None:
    assert_openai_error(await post(client, chat(**overrides)), 503)  # past validation: no backend here


async def test_vllm_extensions_are_served_on_completions(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "prompt": "a", "max_tokens": 16, "ignore_eos": True, "min_tokens": 16,
            "add_special_tokens": True, "stream": True, "stream_options": {"include_usage": True}}
    assert_openai_error(await client.post("/v1/completions", json=body, headers=AUTH), 503)


@pytest.mark.parametrize("overrides,param,code", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "invalid_value"),
    ({"min_tokens": -1}, "min_tokens", "invalid_value"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "invalid_value"),
    ({"min_p": 1.5}, "min_p", "invalid_value"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids", "invalid_value"),  # LIMITS__STOP_SEQUENCES (4)
    ({"stop_token_ids": [-3]}, "stop_token_ids", "invalid_value"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"priority": 5}, "priority", "unsupported_value"),  # vLLM's in-queue order is not Goodput's class
    ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ({"length_penalty": 0.8}, "length_penalty", "unsupported_parameter"),  # beam search's only
    ({"cache_salt": "mine"}, "cache_salt", "unsupported_parameter"),  # the gateway salts per tenant itself
    ({"chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter"),
    ({"prompt_cache_key": "k" * 257}, "prompt_cache_key", "string_above_max_length"),
    ({"safety_identifier": "u" * 257}, "safety_identifier", "string_above_max_length"),
])
async def test_vllm_extensions_are_bounded_and_the_unimplemented_refused_by_name(
        client: httpx.AsyncClient, overrides: dict[str, object], param: str, code: str) -> None:
    error = assert_openai_error(await post(client, chat(**overrides)), 400, param)
    assert error["code"] == code and param in str(error["message"])
