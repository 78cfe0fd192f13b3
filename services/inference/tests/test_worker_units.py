"""The worker's settings, their mapping onto vLLM's engine options, and request translation — without starting an
engine (the integration tests run the real one)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2

from goodput_core.errors import InvalidArgument

from goodput_inference.config import InferenceSettings
from goodput_inference.devmodel import ensure_dev_model
from goodput_inference.engine import Finished, GenRequest, Sampling
from goodput_inference.servicer import WorkerMetrics, to_gen_request
from goodput_inference.vllm_engine import VllmEngine


def test_settings_from_env_map_to_vllm_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_INFERENCE_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("GOODPUT_INFERENCE_GPU_MEMORY_UTILIZATION", "0.85")
    monkeypatch.setenv("GOODPUT_INFERENCE_MAX_NUM_SEQS", "128")
    monkeypatch.setenv("GOODPUT_INFERENCE_MAX_MODEL_LEN", "4096")
    monkeypatch.setenv("GOODPUT_INFERENCE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("GOODPUT_INFERENCE_QUANTIZATION", "awq")
    monkeypatch.setenv("GOODPUT_INFERENCE_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 4}')
    monkeypatch.setenv("GOODPUT_INFERENCE_SCHEDULING_POLICY", "priority")
    settings = InferenceSettings()
    engine = VllmEngine(settings, model_dir=Path("/models/m"), served_model_name="m")
    args = engine.engine_args()
    assert args.tensor_parallel_size == 2 and args.gpu_memory_utilization == 0.85
    assert args.max_num_seqs == 128 and args.max_model_len == 4096
    assert args.enable_prefix_caching is False and args.quantization == "awq"
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert args.scheduling_policy == "priority" and args.served_model_name == ["m"]


def test_dtype_auto_is_float32_on_a_cpu_and_an_explicit_dtype_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    engine = VllmEngine(InferenceSettings(), model_dir=Path("/models/m"), served_model_name="m")
    args = engine.engine_args()
    assert args.dtype == ("float32" if current_platform.is_cpu() else "auto") and args.kv_cache_dtype == "auto"
    monkeypatch.setenv("GOODPUT_INFERENCE_DTYPE", "bfloat16")
    monkeypatch.setenv("GOODPUT_INFERENCE_KV_CACHE_DTYPE", "fp8")
    args = VllmEngine(InferenceSettings(), model_dir=Path("/models/m"), served_model_name="m").engine_args()
    assert args.dtype == "bfloat16" and args.kv_cache_dtype == "fp8"
    monkeypatch.setenv("GOODPUT_INFERENCE_DTYPE", "fp4")
    with pytest.raises(ValueError):
        InferenceSettings()


def test_bad_settings_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_INFERENCE_SCHEDULING_POLICY", "random")
    with pytest.raises(ValueError):
        InferenceSettings()
    monkeypatch.delenv("GOODPUT_INFERENCE_SCHEDULING_POLICY")
    monkeypatch.setenv("GOODPUT_INFERENCE_GPU_MEMORY_UTILIZATION", "1.5")
    with pytest.raises(ValueError):
        InferenceSettings()


def test_requests_translate_with_unset_sampling_left_unset() -> None:
    req = inference_pb2.GenerateRequest(
        request_id="r1", messages=[types_pb2.ChatMessage(role="user", content="hi")],
        sampling=types_pb2.SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"]),
        priority=types_pb2.PRIORITY_P1, tenant="acme")
    gen = to_gen_request(req)
    assert gen.sampling.max_tokens == 5 and gen.sampling.temperature == 0.0 and gen.sampling.stop == ("\n",)
    assert gen.sampling.top_p is None and gen.sampling.seed is None  # the model's defaults apply
    assert gen.messages[0].role == "user" and gen.priority == types_pb2.PRIORITY_P1 and gen.tenant == "acme"


def test_sampling_validation_against_the_context_window() -> None:
    engine = VllmEngine(InferenceSettings(max_model_len=100), model_dir=Path("/m"), served_model_name="m")
    engine._sampling_defaults = {"temperature": 0.2}  # noqa: SLF001 - as read from generation_config.json
    gen = to_gen_request(inference_pb2.GenerateRequest(prompt="x", sampling=types_pb2.SamplingParams(max_tokens=10)))
    params = engine._sampling_params(gen, prompt_len=50)  # noqa: SLF001
    assert params.max_tokens == 10 and params.temperature == pytest.approx(0.2)
    too_long = to_gen_request(inference_pb2.GenerateRequest(prompt="x",
                                                            sampling=types_pb2.SamplingParams(max_tokens=60)))
    with pytest.raises(InvalidArgument) as exc:
        engine._sampling_params(too_long, prompt_len=50)  # noqa: SLF001
    assert exc.value.code == "context_length_exceeded"


def test_dev_model_is_converted_once_and_reused() -> None:
    first = ensure_dev_model()
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert (first / "tokenizer.json").is_file()
    assert '"temperature": 0.2' in (first / "generation_config.json").read_text()
    # The weights on disk are the dequantised GGUF's, in float32: nothing rounded away before the engine's dtype.
    assert json.loads((first / "config.json").read_text())["dtype"] == "float32"
    mtime = (first / "model.safetensors").stat().st_mtime
    assert ensure_dev_model() == first and (first / "model.safetensors").stat().st_mtime == mtime


def test_the_engine_info_metric_carries_the_engines_numerics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from goodput_inference.sim_engine import SimEngine

    registry = CollectorRegistry()
    WorkerMetrics(registry, SimEngine(InferenceSettings(engine="sim")))
    text = generate_latest(registry).decode()
    assert 'goodput_worker_engine_info{device="simulated",dtype="none",engine="sim",kv_cache_dtype="none"} 1.0' in text


class _PrefixHitEngine:
    """Stands in for vLLM's AsyncLLM: streams two delta outputs the way vLLM 0.32 does for a request whose prompt
    hit the prefix cache (``num_cached_tokens`` on every output from the first token on)."""

    def __init__(self, num_cached_tokens: int | None) -> None:
        self.num_cached_tokens = num_cached_tokens

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> Any:
        for finished, text in ((False, "Hel"), (True, "lo")):
            yield SimpleNamespace(finished=finished, num_cached_tokens=self.num_cached_tokens,
                                  outputs=[SimpleNamespace(token_ids=[1], text=text, finish_reason="stop",
                                                           index=0)])


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


async def test_the_vllm_engine_reports_the_prompts_prefix_cache_hit_in_its_final_event() -> None:
    engine = VllmEngine(InferenceSettings(max_model_len=256), model_dir=Path("/m"), served_model_name="m")
    engine._tokenizer, engine._ready = _Tokenizer(), True  # noqa: SLF001 - no model loaded
    finals = []
    for cached in (32, None):  # None: vLLM did not say (reads as no hit)
        engine._engine = _PrefixHitEngine(cached)  # noqa: SLF001
        request = GenRequest(request_id=f"r{cached}", prompt="x" * 40, sampling=Sampling(max_tokens=2))
        finals.append([ev async for ev in engine.generate(request)][-1])
    assert [replace(f, timing=None) for f in finals] == [
        Finished(reason="stop", prompt_tokens=40, completion_tokens=2, cached_tokens=32),
        Finished(reason="stop", prompt_tokens=40, completion_tokens=2, cached_tokens=0)]
    # no engine timestamps here (vLLM keeps them with its stats on): only the worker's own pre-processing
    assert all(f.timing is not None and f.timing.prefill_s == 0.0 for f in finals)
