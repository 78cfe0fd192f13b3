"""Tool calling through the unchanged SDK on the real vLLM CPU engine: tool_choice ``required`` and a named
function are enforced by the engine's structured output, so even the 135M dev model answers with calls whose
arguments validate against the declared schema; streamed calls arrive as OpenAI's incremental deltas; a
conversation carries an assistant's calls and the tool results back. ``auto`` (the default with tools): the model
chooses, its worker's tool template and vLLM's ``pythonic`` parser read the answer: a call when the conversation
shows the model how (a 135M model calls nothing unprompted), text otherwise."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, model_id

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone.",
                                                "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]



def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=QUESTION, tools=TOOLS, temperature=0,
                                          max_tokens=60,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_required_calls_validate_against_their_functions(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=QUESTION, tools=TOOLS, temperature=0,
                                          max_tokens=120, tool_choice="required", parallel_tool_calls=False)
    calls = resp.choices[0].message.tool_calls or []
    assert resp.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


def test_streamed_calls_arrive_as_incremental_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=QUESTION, tools=TOOLS, temperature=0,
                                            max_tokens=60, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, pieces, finish = None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                name = call.function.name if call.function and call.function.name else name
                if call.function and call.function.arguments:
                    pieces.append(call.function.arguments)
    assert name == "get_weather" and finish == "tool_calls" and len(pieces) > 1
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)


def test_a_conversation_carries_calls_and_results_back(client: openai.OpenAI) -> None:
    messages: Any = [*QUESTION,
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    resp = client.chat.completions.create(model=model_id(client), messages=messages, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=30)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


# Two earlier turns show the model the call format: greedy, the dev model then calls get_weather for Berlin.
SHOWN: Any = []
for n, (city, result) in enumerate([("Paris", "18 degrees and sunny"), ("Rome", "25 degrees and clear")]):
    SHOWN += [{"role": "user", "content": f"What is the weather in {city}?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": f"call_{n}", "type": "function",
                   "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
              {"role": "tool", "tool_call_id": f"call_{n}", "content": result},
              {"role": "assistant", "content": f"It is {result} in {city}."}]
SHOWN.append({"role": "user", "content": "What is the weather in Berlin?"})


def test_auto_the_model_chooses_a_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=SHOWN, tools=TOOLS, temperature=0,
                                          max_tokens=40)  # tool_choice: auto, the default with tools
    choice = resp.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].id
    arguments = json.loads(calls[0].function.arguments)
    assert arguments["city"] == "Berlin"
    jsonschema.validate(arguments, WEATHER)


def test_auto_the_model_chooses_text(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), tools=TOOLS, tool_choice="auto", temperature=0,
                                          max_tokens=20,
                                          messages=[{"role": "user", "content": "Tell me about Berlin."}])
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_streams_the_call_as_deltas_and_no_text_of_it(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=SHOWN, tools=TOOLS, temperature=0,
                                            max_tokens=40, stream=True, tool_choice="auto")
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    assert content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_grpc_tools_named_and_refused(platform: Platform) -> None:
    import grpc
    from goodput.common.v1 import types_pb2
    from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    tools = [gateway_pb2.Function(name="get_weather", description="Current weather in a city.",
                                  parameters_json=json.dumps(WEATHER))]
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(**m) for m in QUESTION], tools=tools,
                                          tool_choice="get_weather",
                                          sampling=types_pb2.SamplingParams(max_tokens=60, temperature=0))
    md = (("authorization", f"Bearer {KEY_P0}"),)
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = stub.Generate(request, metadata=md, timeout=120)
        assert [c.name for c in reply.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(reply.tool_calls[0].arguments), WEATHER)
        end = [e.end for e in stub.GenerateStream(request, metadata=md, timeout=120) if e.WhichOneof("kind") == "end"]
        assert [c.name for c in end[0].tool_calls] == ["get_weather"]
        # auto, by default: the model chooses (shown the format, it calls), and no text of the call comes back
        shown = gateway_pb2.GenerateRequest(tools=tools, sampling=request.sampling, messages=[
            types_pb2.ChatMessage(role=m["role"], content=m["content"] or "", tool_call_id=m.get("tool_call_id", ""),
                                  tool_calls=[types_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                                 arguments=c["function"]["arguments"])
                                              for c in m.get("tool_calls", [])]) for m in SHOWN])
        reply = stub.Generate(shown, metadata=md, timeout=120)
        assert [c.name for c in reply.tool_calls] == ["get_weather"] and reply.text == ""
        jsonschema.validate(json.loads(reply.tool_calls[0].arguments), WEATHER)
