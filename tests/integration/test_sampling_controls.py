"""Sampling controls through the unchanged SDK on the real vLLM CPU engine: the same seed gives the same sampled
text; logit_bias bans the token a greedy answer starts with and forces another; a token id outside the vocabulary
is refused by name; vLLM's own extensions (``extra_body``) do what they do under ``vllm serve``; OpenAI's
``prompt_cache_key`` shares a prefix between the users of one tenant and never with another tenant; an answer
continued on a new worker call from the tokens already sent (as the gateway resumes a preempted stream) is, at
temperature 0, the uninterrupted answer. Token ids come from the served model's own tokenizer (the worker reports its
folder)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from transformers import AutoTokenizer

from goodput_core.sampling import Sampling, sampling_to_proto

from goodput_cli.supervisor import Platform

from .conftest import KEY_P2, model_id

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

QUESTION: Any = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def tokenizer(platform: Platform) -> Any:
    with platform.internal_channel(platform.worker_grpc(0)) as ch:  # mTLS, as the operator
        info = inference_pb2_grpc.InferenceStub(ch).GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    return AutoTokenizer.from_pretrained(Path(info.model))


def sample(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=model_id(client), messages=QUESTION, **{"max_tokens": 12, **kw})


def test_the_same_seed_gives_the_same_sampled_text(client: openai.OpenAI) -> None:
    same = {sample(client, temperature=1.0, seed=1234).choices[0].message.content for _ in range(2)}
    assert len(same) == 1
    seeds = {sample(client, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(seeds | same) > 1  # the seed, not the prompt, made the first two equal


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    greedy = sample(client, temperature=0, logprobs=True).choices[0].logprobs.content[0].token
    first_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(greedy))[0]
    banned = sample(client, temperature=0, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != greedy
    forced_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" Banana"))[0]
    forced = sample(client, temperature=0, logprobs=True, logit_bias={str(forced_id): 100}, max_tokens=1)
    assert forced.choices[0].logprobs.content[0].token == tokenizer.decode([forced_id])


def test_a_token_outside_the_vocabulary_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sample(client, temperature=0, logit_bias={"999999999": -100})
    assert "logit_bias" in str(err.value)


def test_n_gives_that_many_choices_streaming_and_not(client: openai.OpenAI) -> None:
    resp = sample(client, temperature=1.0, seed=7, n=2, logprobs=True)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in resp.choices)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    stream = sample(client, temperature=1.0, seed=7, n=2, stream=True)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1] and sorted(finishes) == [0, 1] and all(texts.values())
    # the same seed: the streamed answers are the non-streamed ones
    assert [texts[0], texts[1]] == [c.message.content for c in resp.choices]


NO_STORE = {"Cache-Control": "no-store"}  # past the response cache: every request reaches the engine


def test_ignore_eos_gives_exactly_max_tokens_streamed_and_not(client: openai.OpenAI) -> None:
    short = [{"role": "user", "content": "Reply with just the word yes."}]
    natural = client.chat.completions.create(model=model_id(client), messages=short, max_tokens=40, temperature=0,
                                             extra_headers=NO_STORE)
    assert natural.usage is not None and natural.usage.completion_tokens < 40  # it would stop by itself
    fixed = client.chat.completions.create(model=model_id(client), messages=short, max_tokens=40, temperature=0,
                                           extra_headers=NO_STORE, extra_body={"ignore_eos": True})
    assert fixed.usage is not None and fixed.usage.completion_tokens == 40
    assert fixed.choices[0].finish_reason == "length"
    stream = client.completions.create(model=model_id(client), prompt="The sea is", max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_headers=NO_STORE,
                                       extra_body={"ignore_eos": True, "min_tokens": 24})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens == 24


def test_min_tokens_stop_token_ids_and_truncation_act_as_in_vllm(client: openai.OpenAI, tokenizer: Any) -> None:
    short = [{"role": "user", "content": "Reply with just the word yes."}]
    longer = client.chat.completions.create(model=model_id(client), messages=short, max_tokens=40, temperature=0,
                                            extra_headers=NO_STORE, extra_body={"min_tokens": 30})
    assert longer.usage is not None and longer.usage.completion_tokens >= 30  # EOS held off until then
    greedy = sample(client, temperature=0, max_tokens=12, extra_headers=NO_STORE).choices[0].message.content
    ids = tokenizer.encode(greedy, add_special_tokens=False)
    cut = sample(client, temperature=0, max_tokens=12, extra_headers=NO_STORE,
                 extra_body={"stop_token_ids": [ids[2]]})
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].message.content) < len(greedy)
    kept = client.completions.create(model=model_id(client), prompt="one two three four five " * 20, max_tokens=2,
                                     temperature=0, extra_headers=NO_STORE, extra_body={"truncate_prompt_tokens": 16})
    assert kept.usage is not None and kept.usage.prompt_tokens == 16
    with pytest.raises(openai.BadRequestError) as err:  # a stop id outside the vocabulary: refused by name
        sample(client, temperature=0, extra_headers=NO_STORE, extra_body={"stop_token_ids": [999_999_999]})
    assert "stop_token_ids" in str(err.value)


def test_prompt_cache_key_shares_a_prefix_within_the_tenant_only(client: openai.OpenAI, platform: Platform) -> None:
    handbook = f"Handbook {uuid.uuid4().hex}: " + "Every request is admitted, placed, streamed and released. " * 40
    key = f"handbook-{uuid.uuid4().hex[:8]}"

    def ask(c: openai.OpenAI, user: str, question: str) -> Any:
        return c.chat.completions.create(
            model=model_id(c), max_tokens=2, temperature=0, user=user, extra_headers=NO_STORE,
            messages=[{"role": "system", "content": handbook}, {"role": "user", "content": question}],
            extra_body={"prompt_cache_key": key})

    first = ask(client, "ann", "What is admitted?")
    second = ask(client, "bob", "What is streamed?")  # another user of the tenant, the same key: the same worker
    assert first.usage.prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens > 200
    other_tenant = openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=KEY_P2, max_retries=0, timeout=120)
    theirs = ask(other_tenant, "ann", "What is streamed?")  # the same key and prefix, another tenant
    assert theirs.usage.prompt_tokens == second.usage.prompt_tokens
    assert (theirs.usage.prompt_tokens_details.cached_tokens or 0) == 0


def test_an_answer_continued_from_its_sent_tokens_is_the_uninterrupted_answer(platform: Platform) -> None:
    def generate(continuation: list[int]) -> tuple[list[int], str, list[int], Any]:
        """Token ids, text and the completion count of each delta, and the final usage, of one worker call."""
        request = inference_pb2.GenerateRequest(
            request_id=f"continue-{uuid.uuid4().hex[:8]}",
            messages=[types_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])],
            sampling=sampling_to_proto(Sampling(temperature=0.0, max_tokens=24, ignore_eos=True)),
            continue_token_ids=continuation)
        ids, text, counts, usage = [], "", [], None
        with platform.internal_channel(platform.worker_grpc(0), identity="gateway") as ch:  # as the gateway calls
            for chunk in inference_pb2_grpc.InferenceStub(ch).Generate(request, timeout=120):
                if chunk.HasField("delta"):
                    ids += chunk.delta.token_ids
                    text += chunk.delta.text
                    counts.append(chunk.delta.completion_tokens)
                elif chunk.HasField("finished"):
                    usage = chunk.finished.usage
        return ids, text, counts, usage

    whole_ids, whole_text, _, whole_usage = generate([])
    assert len(whole_ids) == 24
    rest_ids, rest_text, counts, usage = generate(whole_ids[:10])  # ten tokens reached the caller, then a pause
    assert whole_ids[:10] + rest_ids == whole_ids  # greedy: the same tokens, none lost or repeated
    assert whole_text.endswith(rest_text) and rest_text  # the text goes on where the sent tokens left it
    assert counts[0] == 11 and counts[-1] == 24  # counted as the whole answer's tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, 24)
    with pytest.raises(grpc.RpcError) as bad:  # a token the model does not have is refused by name
        generate([999_999_999])
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "continue_token_ids" in bad.value.details()
