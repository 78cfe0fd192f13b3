"""The engine gives the model's own answers on whatever CPU this runs on.

Each worker of the session's platform (real vLLM CPU engines, started as `make run` starts them) continues fixed
chat and completion prompts greedily; a second implementation of the same weights — transformers on the CPU in
float32, in this process — continues them too, and the two must agree token for token (see
:mod:`goodput_inference.parity` for how a near-tie in the reference ends the comparison). This is the test that
would have caught bfloat16 on an Intel Xeon with AMX, where vLLM's eager bf16 kernels answer "What is the capital
of France?" with "L'Étoile, la Marseillaise…" (the chat-capital prompt leaves the reference at its first token).

The worker also says what it computes with: its `/metrics` carry `goodput_worker_engine_info`, whose labels the
test checks against this machine's CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from goodput_core.cpu import cpu_info

from goodput_cli.supervisor import Platform
from goodput_inference.parity import PROMPTS, Reference, compare, reference_greedy

pytestmark = [pytest.mark.integration]

TOKENS = 24  # compared per prompt
MIN_HORIZON = 6  # a prompt whose reference hits a near-tie sooner would prove little: the fixture is wrong then


@pytest.fixture(scope="module")
def model_dir(platform: Platform) -> Path:
    with platform.internal_channel(platform.worker_grpc(0)) as ch:  # mTLS, as the operator
        info = inference_pb2_grpc.InferenceStub(ch).GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    return Path(info.model)


@pytest.fixture(scope="module")
def references(model_dir: Path) -> list[Reference]:
    return reference_greedy(model_dir, PROMPTS, max_tokens=TOKENS)


def greedy(platform: Platform, worker: int, prompt: dict[str, Any]) -> str:
    messages = [types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt.get("messages", [])]
    request = inference_pb2.GenerateRequest(
        request_id=f"parity-{worker}-{prompt['name']}", messages=messages, prompt=str(prompt.get("prompt", "")),
        sampling=types_pb2.SamplingParams(max_tokens=TOKENS, temperature=0))
    # Only the gateway (and its jobs worker) may ask a worker to generate: the test presents the gateway's certificate.
    with platform.internal_channel(platform.worker_grpc(worker), identity="gateway") as ch:
        chunks = list(inference_pb2_grpc.InferenceStub(ch).Generate(request, timeout=120))
    return "".join(c.delta.text for c in chunks if c.WhichOneof("kind") == "delta")


@pytest.mark.parametrize("worker", [0, 1])
def test_greedy_answers_match_a_float32_reference_token_for_token(
        platform: Platform, references: list[Reference], worker: int) -> None:
    failures = []
    for prompt, ref in zip(PROMPTS, references, strict=True):
        assert compare(ref, "", max_tokens=TOKENS).horizon >= min(MIN_HORIZON, len(ref.token_ids)), (
            f"{prompt['name']}: the reference is undecided within its first tokens; choose another prompt")
        text = greedy(platform, worker, prompt)
        result = compare(ref, text, max_tokens=TOKENS)
        if not result.ok:
            failures.append(f"{prompt['name']}: left the reference at token {result.first_mismatch} of "
                            f"{result.horizon}: engine {text!r}, reference {ref.pieces[-1]!r}")
    assert not failures, "\n".join(failures)


def test_the_worker_reports_what_it_computes_with(platform: Platform) -> None:
    metrics = httpx.get(platform.worker_http(0) + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    # An Info metric is exposed as a gauge named ..._info with the value 1; the parser names the family so.
    assert "goodput_worker_engine_info" in families, "the info metric is exported once the engine has started"
    labels = families["goodput_worker_engine_info"].samples[0].labels
    here = cpu_info()
    assert labels["device"] == "cpu"
    assert labels["dtype"] == "float32", "auto resolves to float32 on a CPU"
    assert labels["kv_cache_dtype"] == "float32"
    assert labels["cpu_isa"] == here["isa"] and labels["cpu_amx"] == here["amx"]
    assert labels["cpu_vendor"] == here["vendor"] and labels["cpu_model"] == here["model"]
    assert labels["attention_isa"] not in ("", "amx"), "the AMX attention kernels are bf16-only"
