"""Log probabilities through the whole path on the real vLLM CPU engine: chat's ``logprobs``/``top_logprobs`` and the
legacy completions' ``logprobs`` from the official SDK (unchanged), streaming and not, and gRPC's
``SamplingParams.logprobs``: one entry per generated token, the k most likely beside it, greedy picking the first."""

from __future__ import annotations

import math

import grpc
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, model_id

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

QUESTION = [{"role": "user", "content": "Name three colours."}]



def test_chat_logprobs_one_entry_per_token_with_the_top_k(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=12,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert resp.usage is not None and resp.choices[0].logprobs is not None
    entries = resp.choices[0].logprobs.content or []
    assert len(entries) == resp.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert math.isclose(e.logprob, tops[0], abs_tol=1e-4)  # greedy: the sampled token is the most likely
    assert "".join(e.token for e in entries) == resp.choices[0].message.content


def test_streamed_chat_logprobs_arrive_with_their_text(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=QUESTION, max_tokens=12,  # type: ignore[arg-type]
                                            temperature=0, logprobs=True, stream=True,
                                            stream_options={"include_usage": True})
    tokens, text, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs is not None:
                tokens.extend(choice.logprobs.content or [])
    assert usage is not None and len(tokens) == usage.completion_tokens
    assert all(t.top_logprobs == [] for t in tokens)  # logprobs without top_logprobs: the sampled tokens only
    assert "".join(t.token for t in tokens) == "".join(text)


def test_legacy_completions_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=model_id(client), prompt="The colours of the rainbow are", max_tokens=8,
                                     temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None and resp.usage is not None
    assert len(lp.tokens or []) == len(lp.token_logprobs or []) == resp.usage.completion_tokens
    assert all(len(top) == 2 for top in lp.top_logprobs or [])
    offsets = lp.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_a_cached_answer_is_not_served_to_a_logprobs_request(client: openai.OpenAI) -> None:
    first = client.chat.completions.with_raw_response.create(
        model=model_id(client), messages=QUESTION, max_tokens=12, temperature=0, logprobs=True)  # type: ignore[arg-type]
    assert first.headers["x-goodput-cache"].startswith("bypass")
    assert first.parse().choices[0].logprobs is not None


def test_grpc_logprobs(platform: Platform) -> None:
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(**m) for m in QUESTION],
                                          sampling=types_pb2.SamplingParams(max_tokens=8, temperature=0, logprobs=2))
    md = (("authorization", f"Bearer {KEY_P0}"),)
    with grpc.insecure_channel(platform.gateway_grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = stub.Generate(request, metadata=md, timeout=120)
        assert len(reply.logprobs) == reply.usage.completion_tokens
        assert all(len(t.top) == 2 for t in reply.logprobs)
        streamed = [t for event in stub.GenerateStream(request, metadata=md, timeout=120)
                    if event.WhichOneof("kind") == "logprobs" for t in event.logprobs.tokens]
    assert [t.token for t in streamed] == [t.token for t in reply.logprobs]


def test_completions_echo_the_prompt_with_its_tokens_logprobs(client: openai.OpenAI) -> None:
    prompt = "The colours of the rainbow are"
    resp = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                     logprobs=1)
    choice, usage = resp.choices[0], resp.usage
    assert usage is not None and choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens or []) == usage.prompt_tokens + usage.completion_tokens
    assert (lp.token_logprobs or [])[0] is None  # nothing precedes the first prompt token
    assert all(v is not None and v <= 0 for v in (lp.token_logprobs or [])[1:])
    assert "".join(lp.tokens or []).endswith(choice.text[len(prompt):])
    plain = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text
    streamed = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=6, temperature=0,
                                         echo=True, stream=True)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert pieces[0] == prompt and "".join(pieces) == choice.text
