"""vLLM's sampling extensions and OpenAI's cache fields as the gateway carries them: into the domain request with
vLLM's meaning, into the proto the worker and the cache read, back out when a request is parked as a job, and into
the cost the scheduler and the quotas count (an answer that runs to max_tokens is counted whole)."""

from __future__ import annotations

from goodput_core.sampling import sampling_from_proto, sampling_to_proto

from goodput_gateway.config import GatewaySettings
from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest, to_body
from goodput_gateway.requests import resolve_cost
from goodput_gateway.schemas import parse

EXTENSIONS = {"ignore_eos": True, "min_tokens": 4, "repetition_penalty": 1.1, "min_p": 0.05,
              "stop_token_ids": [2], "include_stop_str_in_output": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": False, "truncate_prompt_tokens": 100}


def test_each_extension_reaches_the_engine_with_its_value() -> None:
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                        **EXTENSIONS}).to_request()
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in req.sampling.vllm_extensions().items()} \
        == EXTENSIONS
    assert sampling_from_proto(sampling_to_proto(req.sampling)) == req.sampling  # what the worker receives


def test_a_parked_request_keeps_its_extensions_and_its_cache_fields() -> None:
    body = {"prompt": "hi", "max_tokens": 8, "prompt_cache_key": "faq", "safety_identifier": "u1", **EXTENSIONS}
    req = parse(CompletionRequest, body).to_request()
    route, again = to_body(req)
    assert route == "completions" and parse(CompletionRequest, again).to_request() == req


def test_admission_reserves_the_prompt_and_max_tokens_for_every_answer() -> None:
    settings = GatewaySettings()
    fixed = parse(CompletionRequest, {"prompt": "x" * 300, "max_tokens": 64, "ignore_eos": True}).to_request()
    _, cost = resolve_cost(fixed, settings, max_model_len=2048)
    assert cost.fixed_output and cost.reservation == cost.prompt_tokens + 64
    # a stop condition may end it early: still the most it may use is reserved, and corrected when it ends
    several = parse(CompletionRequest, {"prompt": "x" * 300, "max_tokens": 64, "n": 3, "stop": "\n"}).to_request()
    _, cost = resolve_cost(several, settings, max_model_len=2048)
    assert not cost.fixed_output and cost.reservation == cost.prompt_tokens + 3 * 64


def test_the_affinity_key_is_the_tenants_own() -> None:
    asked = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                          "prompt_cache_key": "faq", "user": "ann",
                                          "safety_identifier": "user-u1"}).to_request()
    other_user = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                               "prompt_cache_key": "faq", "user": "bob"}).to_request()
    assert asked.affinity("acme") == other_user.affinity("acme")  # the key, not the user, places it
    assert asked.affinity("acme") != asked.affinity("globex")  # never across tenants
    assert "faq" not in asked.affinity("acme")
    assert asked.safety_hash("acme") not in ("", "user-u1") and asked.safety_hash("acme") != asked.safety_hash("b")
