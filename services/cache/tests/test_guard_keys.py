"""The near-miss guard and key derivation, without stores."""

from __future__ import annotations

import pytest

from goodput_cache.guard import is_time_sensitive, near_miss
from goodput_cache.keys import CacheRequest, Message, Sampling, derive

from .conftest import ask


@pytest.mark.parametrize("a, b", [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reset my password?", "How can I reset my password?"),
    ("Can I pay with a credit card?", "Is paying by credit card possible?"),
    # the same names, the sentence turned around: not a swap
    ("TensorFlow, PyTorch, and JAX are compatible with Datasets.", "Datasets can be used with TensorFlow, PyTorch, "
                                                                   "and JAX."),
    # the same number written in words or digits, list markers, a number inside a compound word
    ("Does the Hub hold more than one hundred languages?", "Does the Hub hold over 100 languages?"),
    ("The twenty-one day trial", "The 21 day trial"),
    ("It works in two steps: 1) download the files, 2) build the table", "It works in two steps: download the "
                                                                         "files, then build the table"),
    ("Does it accept non-zero values?", "Does it accept nonzero values?"),
    # an acronym and its expansion, a name run together, a possessive
    ("Is the table loaded into RAM?", "Is the table loaded into Random Access Memory?"),
    ("Is there a JS client for Hugging Face?", "Is there a JavaScript client for Huggingface?"),
    ("Where are Hugging Face's tutorials?", "Where are the tutorials of Hugging Face?"),
    # a negation in a sentence said in other words is not a flip
    ("The dataset viewer lets users with little disk space preview a dataset without downloading it.",
     "Users who do not have much storage can use the viewer to look at the data before any download."),
    # a sentence opening with a negating "No" against one negated by "not": both negative
    ("No information about the refund policy is given in the document.",
     "The refund policy is not described in the document."),
])
def test_guard_lets_paraphrases_through(a: str, b: str) -> None:
    assert near_miss(a, b) is None


@pytest.mark.parametrize("a, b, why", [
    ("How do I turn on dark mode?", "How do I turn off dark mode?", "antonym"),
    ("Refund within 30 days?", "Refund within thirty one days?", "numbers"),
    ("I can't log in", "I can log in", "negation"),
    ("Is the office open on Monday?", "Is the office open on Friday?", "dates"),
    ("Do you ship to Canada?", "Do you ship to Mexico?", "entities"),
    ("Flights from Paris to Rome", "Flights from Rome to Paris", "entity order"),
    ("Did the Bears beat the Giants?", "Did the Giants beat the Bears?", "entity order"),
    ("Is Python faster than Java?", "Is Java faster than Python?", "entity order"),
    ("Refund within twenty-one days?", "Refund within 31 days?", "numbers"),
    ("Can I upload thousands of files?", "Can I upload 100 files?", "numbers"),
    ("Why can't I log in to my account?", "Why can I log in to my account?", "negation"),
    ("No refunds are given after 30 days.", "Refunds are given after 30 days.", "negation"),  # "No" negates here,
    ("No, refunds are given after 30 days.", "Refunds are not given after 30 days.", "negation"),  # answers here
    ("How do I reset my password in Outlook?", "How do I reset my password?", "entities"),
    ("Is AI said to be safe?", "Is it said to be safe?", "entities"),
])
def test_guard_vetoes_near_misses(a: str, b: str, why: str) -> None:
    reason = near_miss(a, b)
    assert reason is not None and reason.startswith(why)


def test_time_sensitive() -> None:
    assert is_time_sensitive("What's the latest version?")
    assert is_time_sensitive("price of the pro plan")
    assert not is_time_sensitive("How do I reset my password?")


def test_key_covers_everything_that_changes_the_answer() -> None:
    base = ask("Hi")
    variants = [ask("Hi", tenant="other"), ask("Hi", model_version="2"), ask("Hi", system="Be brief."),
                ask("Hi", kb="docs", kb_version=1), ask("Hi", kb="docs", kb_version=2),
                CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=65, temperature=0.0)}),
                CacheRequest(**{**base.__dict__, "model": "other"}),
                # structured output: the same question answered as JSON, or to another schema, is another answer
                CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=64, temperature=0.0,
                                                                      json_object=True)}),
                CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=64, temperature=0.0,
                                                                      json_schema='{"type":"object"}')}),
                CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=64, temperature=0.0,
                                                                      json_schema='{"type":"array"}')}),
                ask("hi"),
                # vLLM's extensions: each changes the text of a greedy answer too
                *(CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=64, temperature=0.0, **ext)})
                  for ext in ({"ignore_eos": True}, {"min_tokens": 8}, {"repetition_penalty": 1.2}, {"min_p": 0.1},
                              {"stop_token_ids": (2,)}, {"include_stop_str_in_output": True},
                              {"skip_special_tokens": False}, {"spaces_between_special_tokens": False},
                              {"truncate_prompt_tokens": 32}))]
    keys = {derive(v).exact for v in variants}
    assert len(keys) == len(variants) and derive(base).exact not in keys
    # greedy decoding ignores top_p and the seed, so they do not split the cache
    greedy = CacheRequest(**{**base.__dict__, "sampling": Sampling(max_tokens=64, temperature=0.0, top_p=0.5,
                                                                   seed=7)})
    assert derive(greedy).exact == derive(base).exact
    assert derive(ask("Hi", history=[Message("user", "x")])).partition != derive(base).partition
