"""Structured output through the whole path on the real vLLM CPU engine: OpenAI's ``response_format`` from the
official SDK (unchanged), streaming and not, and gRPC's ``SamplingParams.json_schema``; the engine's constrained
decoding makes the answer JSON that validates against the requested schema, whatever the small model would have
said."""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, model_id

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

# Small enough that the answer always closes within max_tokens: every string is bounded, nothing else is allowed.
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]}}}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY, "strict": True}}



def test_json_schema_answers_validate_against_the_schema(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=60,  # type: ignore[arg-type]
                                          temperature=0, response_format=FORMAT)
    assert resp.choices[0].finish_reason == "stop"
    answer = json.loads(resp.choices[0].message.content or "")
    jsonschema.validate(answer, CITY)


def test_json_schema_streams_as_deltas_that_join_into_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=60,  # type: ignore[arg-type]
                                            temperature=0, response_format=FORMAT, stream=True)
    parts = [choice.delta.content or "" for chunk in stream for choice in chunk.choices]
    assert len([p for p in parts if p]) > 1  # streamed, not one block
    jsonschema.validate(json.loads("".join(parts)), CITY)


def test_json_object_answers_are_a_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=model_id(client), temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}])
    if resp.choices[0].finish_reason == "stop":  # a JSON object the model keeps writing may end at max_tokens
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    else:
        assert (resp.choices[0].message.content or "").lstrip().startswith("{")


def test_grpc_json_schema(platform: Platform) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[types_pb2.ChatMessage(**m) for m in QUESTION],
        sampling=types_pb2.SamplingParams(max_tokens=60, temperature=0, json_schema=json.dumps(CITY)))
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, metadata=(("authorization", f"Bearer {KEY_P0}"),), timeout=120)
    jsonschema.validate(json.loads(reply.text), CITY)


def test_a_schema_that_is_not_json_is_refused_by_name(platform: Platform) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[types_pb2.ChatMessage(**m) for m in QUESTION],
        sampling=types_pb2.SamplingParams(max_tokens=8, json_schema="{not json"))
    with grpc.insecure_channel(platform.gateway_grpc) as channel, pytest.raises(grpc.RpcError) as err:
        gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=(("authorization", f"Bearer {KEY_P0}"),),
                                                       timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata() or ())["goodput-error-param"] == "response_format"
