"""Sampling controls through the unchanged SDK on the real vLLM CPU engine: the same seed gives the same sampled
text; logit_bias bans the token a greedy answer starts with and forces another; a token id outside the vocabulary
is refused by name. Token ids come from the served model's own tokenizer (the worker reports its folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from transformers import AutoTokenizer

from goodput_cli.supervisor import Platform

from .conftest import model_id

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
