"""Inference worker settings (env prefix GOODPUT_INFERENCE_). Each maps to the vLLM engine option of the same
name, so the chart's values read like vLLM's own flags."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator

from goodput_core.settings import ServiceSettings, SharingGroupsSetting, service_config

POOL_CLASSES = ("P0", "P1", "P2")  # the priority classes a pool may serve (goodput.common.v1.Priority)


class InferenceSettings(ServiceSettings):
    model_config = service_config("GOODPUT_INFERENCE_")

    grpc_port: int = 50061
    http_port: int = 9161
    worker_id: str = Field("", description="Stable id reported to the scheduler; default host:grpc_port.")

    engine: Literal["vllm", "sim", "triton"] = Field(
        "vllm", description="`vllm`; `triton`: a Triton Inference Server through tritonclient (its vLLM or "
                            "TensorRT-LLM backend; goodput_inference.triton_engine); or `sim`: a simulated engine "
                            "for capacity experiments only (no model; see goodput_inference.sim_engine for its "
                            "A100/7B calibration).")
    sim_config: dict[str, Any] | None = Field(
        None, description='engine=sim: JSON overriding its parameters, e.g. {"time_scale": 4, "kv_blocks": 2000}.')
    model: str = Field("", description="HF-format model folder; empty = the dev model (SmolLM2-135M-Instruct).")
    served_model_name: str = Field("", description="Name clients pass as `model`; default the folder's name.")
    served_model_aliases: str = Field("", description="Other names clients may pass as `model` for this model, "
                                                      'comma-separated (e.g. "chat-small,default"); the gateway routes '
                                                      "them here and answers with the served name.")
    model_version: str = Field("", description="Version label of the weights (cache partitioning); default a "
                                               "hash of the model's config.")
    data_dir: str = Field("", description="Where the dev model is converted and cached; default "
                                          "$GOODPUT_DATA_DIR or ~/.cache/goodput.")
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(0, ge=0, description="Most tokens the engine schedules in one step (vLLM's "
                                                             "--max-num-batched-tokens: small for an interactive pool, "
                                                             "large for a batch pool); 0 = the engine's default.")
    max_model_len: int = Field(2048, ge=16)
    max_prompt_tokens: int = Field(0, ge=0, description="Largest prompt accepted; 0 = max_model_len - 1.")
    enable_prefix_caching: bool = True
    quantization: str = Field("", description="vLLM quantization method (awq, gptq, fp8...); empty = none.")
    speculative_config: dict[str, Any] | None = Field(
        None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}.')
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = Field(
        "auto", description="Weights and activations. `auto`: float32 on a CPU (the only dtype whose answers were "
                            "measured to match the model's own on every CPU; bf16 kernels differ between Intel AMX "
                            "and AMD), vLLM's choice from the model's config on a GPU. `bfloat16`/`float16` on a "
                            "CPU are for users who ask, after checking answers on their CPU.")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache dtype (vLLM's kv_cache_dtype); `auto` = the model's dtype.")
    kv_cache_space_gb: float = Field(1.0, gt=0, description="KV cache size on the CPU build (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: bool = False
    tool_call_parser: str = Field(
        "", description="vLLM tool-call parser (hermes, llama3_json, pythonic, mistral...) that gives the model "
                        "tool_choice `auto`, as vLLM's --tool-call-parser; empty = none (`auto` is refused by name). "
                        "The dev model uses `pythonic` with a bundled template when this and tool_chat_template are "
                        "both empty.")
    tool_chat_template: str = Field(
        "", description="Jinja chat template used for requests with tools (a file path), as vLLM's --chat-template "
                        "for tool use; empty = the model's own template, which must then render `tools`.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request leaves it at 0.")
    # --- model pools: reported to the scheduler in ModelInfo ---
    pool: str = Field("default", min_length=1, description="The model pool this worker belongs to (workers of one "
                                                           "model with the same engine settings, scaled together).")
    pool_classes: str = Field("", description='Priority classes the pool serves, e.g. "P0,P1" or "P2"; the '
                                              "scheduler grants only those here while a healthy worker's pool serves "
                                              "the class (its serves_class filter). Empty = every class.")
    stall_after_s: float = Field(30.0, ge=0, description="A worker whose generations have produced no output for this "
                                                         "long is stalled (a hung engine): NOT_SERVING until tokens "
                                                         "come again, so no new work is placed on it; 0 = off. Keep "
                                                         "it above the longest prefill.")
    pool_cost_per_hour: float = Field(0.0, ge=0, description="What one worker of this pool costs per hour (e.g. its "
                                                             "GPUs' price), in a unit used alike for every pool; "
                                                             "0 = unknown. The gateway's model \"auto\" picks the "
                                                             "cheapest pool predicted to meet the request's SLO.")
    # --- engine=triton (goodput_inference.triton_engine); max_num_seqs and max_model_len above apply too ---
    triton_url: str = Field("127.0.0.1:8001", description="engine=triton: the Triton server's gRPC address "
                                                          "(host:port).")
    triton_model: str = Field("", description="engine=triton: the model's name in Triton's repository; default "
                                              "served_model_name, or the dev model's name.")
    triton_model_version: str = Field("", description="engine=triton: the model version; empty = Triton's choice.")
    triton_protocol: Literal["vllm", "tensorrtllm"] = Field(
        "vllm", description="engine=triton: the model's inputs. `vllm`: Triton's vLLM backend (text_input, stream, "
                            "sampling_parameters JSON; also the dev model's); `tensorrtllm`: the TensorRT-LLM "
                            "backend's ensemble / BLS model (text_input, max_tokens, temperature... as tensors).")
    triton_metrics_url: str = Field(
        "", description="engine=triton: Triton's Prometheus endpoint (http://host:8002/metrics), read for running, "
                        "waiting, KV-cache and GPU numbers; empty = the worker's own in-flight count only.")
    triton_metrics_interval_s: float = Field(0.5, gt=0, description="engine=triton: how often the metrics are read.")
    triton_tokenizer: str = Field(
        "", description="engine=triton: HF folder with the model's tokenizer and chat template (messages are rendered "
                        "and counted in the worker); default `model`, or the dev model.")
    triton_start_timeout_s: float = Field(600.0, gt=0, description="engine=triton: how long start waits for the "
                                                                   "server and the model to be ready.")
    # --- prefix-cache isolation (goodput_inference.tenancy) ---
    cache_salt_key: SecretStr = Field(SecretStr(""), description="Key of the per-tenant prefix-cache salt (HMAC); "
                                      "empty = a random key per process. Set it, the same on every worker, when KV "
                                      "blocks outlive the process or move between engines.")
    cache_sharing_groups: SharingGroupsSetting = Field(
        default_factory=dict, description='Tenants that share one prefix cache, JSON {"group": ["tenant-a", '
        '"tenant-b"]}; every other tenant has a cache of its own. The scheduler takes the same setting.')

    @field_validator("pool_classes")
    @classmethod
    def _parse_classes(cls, value: str) -> str:
        """Normalised to sorted upper-case names: ``" p1, P0 "`` -> ``"P0,P1"``; an unknown class is refused."""
        names = sorted({part.strip().upper() for part in value.split(",") if part.strip()})
        unknown = [n for n in names if n not in POOL_CLASSES]
        if unknown:
            raise ValueError(f"unknown priority class {', '.join(unknown)}; known: {', '.join(POOL_CLASSES)}")
        return ",".join(names)

    @field_validator("speculative_config", "sim_config", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else None
        return value
