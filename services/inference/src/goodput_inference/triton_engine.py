"""The engine that talks to a Triton Inference Server (``GOODPUT_INFERENCE_ENGINE=triton``), through tritonclient.

Triton serves the model, the worker keeps its API: a request's chat messages are rendered with the model's own
chat template and counted here (transformers' tokenizer from the model's folder, no vLLM), then streamed through
Triton's gRPC ``ModelStreamInfer`` to a *decoupled* model, which answers one response per chunk of tokens, as
Triton's vLLM and TensorRT-LLM backends do. The worker's callers cannot tell it from the in-process vLLM engine:
Started, Delta and Finished events, token counts, finish reasons, load numbers and cancellation are the same.

* **Protocol** (``triton_protocol``): ``vllm`` — the inputs of Triton's vLLM backend: ``text_input``, ``stream``,
  ``sampling_parameters`` (JSON), ``exclude_input_in_output``, and the flags ``return_finish_reason`` /
  ``return_num_input_tokens`` / ``return_num_output_tokens`` when the model has them (its metadata says); the dev
  model in ``services/inference/triton/model_repository`` speaks it too. ``tensorrtllm`` — the TensorRT-LLM
  backend's ensemble/BLS model: ``text_input``, ``max_tokens``, ``temperature``, ``top_k``, ``top_p``,
  ``random_seed``, ``stop_words``, penalties and ``stream`` as tensors.
* **End of a stream**: every request asks for Triton's empty final response (``triton_enable_empty_final_response``),
  so each response says whether it is the last (``triton_final_response``). The aio client's ``stream_infer``
  cannot ask for it (that parameter is reserved there; only the threaded client's ``async_stream_infer`` sets it),
  so the stream is opened on tritonclient's generated service stub, with requests and results built by
  tritonclient (``InferInput``, ``InferResult``); metadata, config, statistics and readiness go through
  ``tritonclient.grpc.aio.InferenceServerClient``.
* **Token counts**: the prompt's from the worker's own tokenization (what Started reports; the final count is the
  server's ``num_input_tokens`` when the model gives it), the completion's from ``num_output_tokens`` when the model
  gives it, else by tokenizing the text so far.
* **Prefix-cache salt**: every request carries its tenant's cache salt (:mod:`goodput_inference.tenancy`) as the
  ``cache_salt`` input (a string) when the model declares one, so prefix-cache entries of one tenant (or sharing group)
  never serve another: the dev model keys its prefix cache by it, a vLLM model would pass it on as the prompt's
  ``cache_salt``. Triton's own vLLM backend (to 25.12) has no such input: a model without it is warned about at start
  (its prefix cache is shared by every tenant) and gets no salt.
* **Cancellation**: closing the event iterator (the caller went away) cancels the gRPC stream; Triton then cancels
  the request, and a model that checks ``request.is_cancelled()`` stops generating (the vLLM backend aborts its
  engine request).
* **Load**: the worker's own in-flight count against ``max_num_seqs``; with ``triton_metrics_url``, the server's
  numbers instead, read every ``triton_metrics_interval_s``: vLLM's ``vllm:num_requests_running`` / ``_waiting`` /
  KV-cache usage / prefix-cache counters, TensorRT-LLM's request and KV-block metrics, the dev model's
  ``goodput_model_requests_*`` and ``goodput_model_prefix_cache_*``, Triton's pending requests and
  ``nv_gpu_utilization``.

Example::

    engine = TritonEngine(settings, tokenizer_dir=Path("/models/llama"), served_model_name="llama",
                          triton_model="vllm_model")
    await engine.start()
    async for event in engine.generate(GenRequest(request_id="r1", prompt="Hello")):
        print(event)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from goodput_core.errors import InvalidArgument, Unavailable

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import (
    Delta,
    EngineTiming,
    Finished,
    GenEvent,
    GenRequest,
    Load,
    ModelDescription,
    Started,
    check_model,
    max_tokens_for,
    prompt_limit,
)
from goodput_inference.tenancy import CacheSalts

log = logging.getLogger("goodput.inference.triton")

__all__ = ["ServerMetrics", "TritonEngine", "read_server_metrics", "request_inputs"]

_ROLES = {"system", "user", "assistant", "tool"}
_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
# Triton's vLLM backend reads these from sampling_parameters (vLLM SamplingParams fields).
_VLLM_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
# The TensorRT-LLM ensemble's tensors for the same values, and their Triton data types.
_TRTLLM_SAMPLING = {"temperature": ("temperature", "FP32"), "top_p": ("top_p", "FP32"), "top_k": ("top_k", "INT32"),
                    "seed": ("random_seed", "UINT64"), "presence_penalty": ("presence_penalty", "FP32"),
                    "frequency_penalty": ("frequency_penalty", "FP32"), "min_tokens": ("min_length", "INT32"),
                    "repetition_penalty": ("repetition_penalty", "FP32")}
_NP_TYPES = {"BYTES": np.object_, "BOOL": np.bool_, "FP32": np.float32, "INT32": np.int32, "UINT64": np.uint64}


@dataclass(frozen=True)
class ServerMetrics:
    """What Triton's Prometheus endpoint says about the model's load; ``None`` where the server reports nothing."""

    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    gpu_utilization: float | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None


def read_server_metrics(text: str, model: str) -> ServerMetrics:
    """Reads the load numbers of ``model`` from Triton's metrics text: the vLLM backend's, the TensorRT-LLM
    backend's (its metrics name the inner ``tensorrt_llm`` model, so they are not filtered by name), the dev model's
    custom metrics, Triton's pending requests and GPU utilisation (a mean over GPUs).

    >>> text = '''
    ... vllm:num_requests_running{model="m",version="1"} 3
    ... vllm:num_requests_waiting{model="m",version="1"} 1
    ... vllm:num_requests_running{model="other",version="1"} 7
    ... vllm:kv_cache_usage_perc{model="m",version="1"} 0.25
    ... nv_inference_pending_request_count{model="m",version="1"} 2
    ... nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5
    ... nv_gpu_utilization{gpu_uuid="GPU-1"} 0.7
    ... '''
    >>> m = read_server_metrics(text, "m")
    >>> m.running, m.waiting, m.kv_cache_usage, round(m.gpu_utilization or 0, 2)
    (3, 3, 0.25, 0.6)
    >>> read_server_metrics('goodput_model_requests_running{model="m",version="1"} 1', "m").running
    1
    >>> read_server_metrics('# TYPE goodput_model_prefix_cache_hits counter\\n'
    ...                     'goodput_model_prefix_cache_hits{model="m",version="1"} 36', "m").prefix_cache_hits
    36
    >>> read_server_metrics("", "m") == ServerMetrics()  # nothing reported: the worker counts for itself
    True
    """
    from prometheus_client.parser import text_string_to_metric_families

    own: dict[str, float] = {}
    gpus: list[float] = []
    trt: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "nv_gpu_utilization":
                gpus.append(value)
            elif name == "nv_trt_llm_request_metrics":
                trt[("request", labels.get("request_type", ""))] = value
            elif name == "nv_trt_llm_kv_cache_block_metrics":
                trt[("kv", labels.get("kv_cache_block_type", ""))] = value
            elif labels.get("model", model) == model:
                own[name] = own.get(name, 0.0) + value

    def first(*names: str) -> float | None:
        return next((own[n] for n in names if n in own), None)

    running = first("vllm:num_requests_running", "goodput_model_requests_running")
    waiting = first("vllm:num_requests_waiting", "goodput_model_requests_waiting")
    kv = first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    if running is None and ("request", "scheduled") in trt:
        running = trt[("request", "scheduled")]
        active = trt.get(("request", "active"), running)
        waiting = max(active - running, 0.0)
    if kv is None and trt.get(("kv", "max")):
        kv = trt.get(("kv", "used"), 0.0) / trt[("kv", "max")]
    pending = own.get("nv_inference_pending_request_count")
    if pending is not None:  # requests Triton holds before the model has them
        waiting = (waiting or 0.0) + pending
    queries = first("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
                    "goodput_model_prefix_cache_queries_total")
    hits = first("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits", "goodput_model_prefix_cache_hits_total")
    return ServerMetrics(
        running=None if running is None else int(running), waiting=None if waiting is None else int(waiting),
        kv_cache_usage=kv, gpu_utilization=sum(gpus) / len(gpus) if gpus else None,
        prefix_cache_queries=None if queries is None else int(queries), prefix_cache_hits=None if hits is None
        else int(hits))


def request_inputs(protocol: str, *, prompt: str, sampling: dict[str, Any], max_tokens: int, stop: list[str],
                   declared: set[str], batched: bool, cache_salt: str = "") -> dict[str, tuple[str, np.ndarray]]:
    """The input tensors of one streaming request, by name: (Triton data type, array). Optional inputs the model
    does not declare are left out (``cache_salt`` too); a sampling value it cannot take is refused by name.

    >>> tensors = request_inputs("vllm", prompt="Hi", sampling={"temperature": 0.0}, max_tokens=8, stop=["\\n"],
    ...                          declared={"text_input", "stream", "sampling_parameters", "return_finish_reason"},
    ...                          batched=False, cache_salt="5a1t")
    >>> sorted(tensors)
    ['return_finish_reason', 'sampling_parameters', 'stream', 'text_input']
    >>> request_inputs("vllm", prompt="Hi", sampling={}, max_tokens=8, stop=[], batched=False, cache_salt="5a1t",
    ...                declared={"text_input", "sampling_parameters", "cache_salt"})["cache_salt"][1]
    array([b'5a1t'], dtype=object)
    >>> json.loads(tensors["sampling_parameters"][1][0])
    {'max_tokens': 8, 'stop': ['\\n'], 'temperature': 0.0}
    >>> t = request_inputs("tensorrtllm", prompt="Hi", sampling={"top_k": 5}, max_tokens=8, stop=[],
    ...                    declared={"text_input", "max_tokens", "stream", "top_k"}, batched=True)
    >>> [(name, dtype, a.shape) for name, (dtype, a) in t.items()]  # doctest: +NORMALIZE_WHITESPACE
    [('text_input', 'BYTES', (1, 1)), ('max_tokens', 'INT32', (1, 1)), ('stream', 'BOOL', (1, 1)),
     ('top_k', 'INT32', (1, 1))]
    """
    tensors: dict[str, tuple[str, list[Any]]] = {"text_input": ("BYTES", [prompt.encode("utf-8")])}
    if cache_salt:
        tensors["cache_salt"] = ("BYTES", [cache_salt.encode("utf-8")])
    if protocol == "vllm":
        doc = {"max_tokens": max_tokens, **({"stop": stop} if stop else {}), **sampling}
        tensors["sampling_parameters"] = ("BYTES", [json.dumps(doc).encode("utf-8")])
        tensors["stream"] = ("BOOL", [True])
        tensors["exclude_input_in_output"] = ("BOOL", [True])
        for flag in _RETURN_FLAGS:
            tensors[flag] = ("BOOL", [True])
    else:
        tensors["max_tokens"] = ("INT32", [max_tokens])
        tensors["stream"] = ("BOOL", [True])
        tensors["exclude_input_in_output"] = ("BOOL", [True])
        for key, value in sampling.items():
            name, dtype = _TRTLLM_SAMPLING[key]
            tensors[name] = (dtype, [value])
        if stop:
            tensors["stop_words"] = ("BYTES", [s.encode("utf-8") for s in stop])
    required = {"text_input", "sampling_parameters"} if protocol == "vllm" else {"text_input", "max_tokens"}
    for name in list(tensors):
        if name in declared:
            continue
        if name in required or (protocol == "tensorrtllm" and name not in ("stream", "exclude_input_in_output",
                                                                           "cache_salt")):
            raise InvalidArgument(f"the Triton model takes no {name!r} input (triton_protocol={protocol})",
                                  param="sampling", code="unsupported_value")
        del tensors[name]
    out = {}
    for name, (dtype, values) in tensors.items():
        array = np.array(values, dtype=_NP_TYPES[dtype])
        if batched or (protocol == "tensorrtllm" and name == "stop_words"):
            array = array.reshape(1, -1)
        out[name] = (dtype, array)
    return out


class TritonEngine:
    def __init__(self, settings: InferenceSettings, *, tokenizer_dir: Path, served_model_name: str,
                 triton_model: str, salts: CacheSalts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.salts = salts or CacheSalts.from_settings(settings)
        self.tokenizer_dir = tokenizer_dir
        self.served_model_name = served_model_name
        self.triton_model = triton_model
        self._clock = clock
        self._tokenizer: Any = None
        self._client: Any = None  # tritonclient.grpc.aio.InferenceServerClient
        self._channel: Any = None  # grpc.aio.Channel of the streams
        self._stub: Any = None  # tritonclient's GRPCInferenceServiceStub
        self._inputs: set[str] = set()
        self._outputs: set[str] = set()
        self._batched = False
        self._backend = ""
        self._server_version = ""
        self._max_model_len = settings.max_model_len
        self._model_version = settings.model_version
        self._metrics = ServerMetrics()
        self._metrics_at = float("-inf")
        self._poller: asyncio.Task[None] | None = None
        self._http: Any = None  # httpx.AsyncClient of the metrics endpoint
        self._inflight = 0
        self._aborted = 0
        self._finished = 0
        self._ready = False

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        import tritonclient.grpc.aio as triton_aio
        from transformers import AutoTokenizer
        from tritonclient.grpc import service_pb2_grpc

        s = self.settings
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.tokenizer_dir)
        log.info("connecting to Triton", extra={"url": s.triton_url, "triton_model": self.triton_model,
                                                 "protocol": s.triton_protocol})
        self._client = triton_aio.InferenceServerClient(s.triton_url)
        await self._wait_ready()
        server = await self._client.get_server_metadata(as_json=True)
        metadata = await self._client.get_model_metadata(self.triton_model, s.triton_model_version, as_json=True)
        config = (await self._client.get_model_config(self.triton_model, s.triton_model_version,
                                                      as_json=True)).get("config", {})
        self._server_version = str(server.get("version", ""))
        self._inputs = {i["name"] for i in metadata.get("inputs", [])}
        self._outputs = {o["name"] for o in metadata.get("outputs", [])}
        if "text_input" not in self._inputs or "text_output" not in self._outputs:
            raise RuntimeError(f"Triton model {self.triton_model!r} has no text_input/text_output: not an LLM "
                               f"model of Triton's vLLM or TensorRT-LLM backend (inputs {sorted(self._inputs)})")
        if "cache_salt" not in self._inputs:
            log.warning("the Triton model takes no cache_salt input: its prefix cache is shared by every tenant (one "
                        "can tell from its speed what another recently sent); give it the input, or each isolation "
                        "domain a server of its own", extra={"triton_model": self.triton_model})
        if not config.get("model_transaction_policy", {}).get("decoupled", False):
            log.warning("the Triton model is not decoupled: its answer arrives in one piece, not streamed",
                        extra={"triton_model": self.triton_model})
        self._batched = int(config.get("max_batch_size", 0) or 0) > 0
        self._backend = str(config.get("backend") or config.get("platform") or metadata.get("platform", ""))
        param = config.get("parameters", {}).get("max_model_len", {}).get("string_value", "")
        if param.isdigit():
            self._max_model_len = int(param)
        if not self._model_version:
            digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
            digest.update((self.tokenizer_dir / "config.json").read_bytes()
                          if (self.tokenizer_dir / "config.json").is_file() else b"")
            self._model_version = digest.hexdigest()[:16]
        self._channel = grpc.aio.insecure_channel(s.triton_url)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        if s.triton_metrics_url:
            import httpx

            self._http = httpx.AsyncClient(timeout=2.0)
            await self._read_metrics()
            self._poller = asyncio.create_task(self._poll_metrics(), name="triton-metrics")
        self._ready = True
        log.info("Triton engine ready", extra={"triton": self._server_version, "backend": self._backend,
                                               "max_model_len": self._max_model_len, "batched": self._batched})

    async def _wait_ready(self) -> None:
        s = self.settings
        deadline = self._clock() + s.triton_start_timeout_s
        last = ""
        while True:
            try:
                if await self._client.is_server_ready() and await self._client.is_model_ready(
                        self.triton_model, s.triton_model_version):
                    return
                last = "the server or the model is not ready"
            except Exception as err:  # noqa: BLE001 - not up yet: retried until the deadline
                last = str(err)
            if self._clock() > deadline:
                raise RuntimeError(f"Triton at {s.triton_url} did not serve model {self.triton_model!r} within "
                                   f"{s.triton_start_timeout_s:g} s: {last}")
            await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        self._ready = False
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ---- load ------------------------------------------------------------------------------------------------

    async def _read_metrics(self) -> None:
        try:
            response = await self._http.get(self.settings.triton_metrics_url)
            response.raise_for_status()
            self._metrics = read_server_metrics(response.text, self.triton_model)
            self._metrics_at = self._clock()
        except Exception as err:  # noqa: BLE001 - load falls back to the worker's own count
            log.warning("could not read Triton's metrics", extra={"url": self.settings.triton_metrics_url,
                                                                   "error": repr(err)})

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.settings.triton_metrics_interval_s)
            await self._read_metrics()

    def _fresh(self) -> ServerMetrics:
        if self._clock() - self._metrics_at > 4 * self.settings.triton_metrics_interval_s:
            return ServerMetrics()
        return self._metrics

    def load(self) -> Load:
        cap = self.settings.max_num_seqs
        m = self._fresh()
        return Load(running=m.running if m.running is not None else min(self._inflight, cap),
                    waiting=m.waiting if m.waiting is not None else max(self._inflight - cap, 0),
                    kv_cache_usage=m.kv_cache_usage or 0.0,
                    gpu_utilization=m.gpu_utilization if m.gpu_utilization is not None else -1.0,
                    max_num_seqs=cap, aborted_total=self._aborted, finished_total=self._finished, ready=self._ready,
                    prefix_cache_queries=m.prefix_cache_queries or 0, prefix_cache_hits=m.prefix_cache_hits or 0)

    @property
    def inflight(self) -> int:
        return self._inflight

    # ---- introspection ---------------------------------------------------------------------------------------

    def describe(self) -> ModelDescription:
        return ModelDescription(served_model_name=self.served_model_name,
                                model=f"triton://{self.settings.triton_url}/{self.triton_model}",
                                max_model_len=self._max_model_len, max_prompt_tokens=self._max_prompt_tokens(),
                                engine=f"triton {self._server_version} ({self._backend or 'unknown'} backend)",
                                model_version=self._model_version, continues=False)

    def numerics(self) -> dict[str, str]:
        """The server's version, the model's backend and where it runs (``gpu`` when Triton reports GPU metrics,
        else ``unknown``: Triton does not say what a CPU model computes with); empty until started."""
        if not self._ready:
            return {}
        return {"engine": f"triton {self._server_version}", "triton_backend": self._backend,
                "triton_model": self.triton_model,
                "device": "gpu" if self._metrics.gpu_utilization is not None else "unknown"}

    def _max_prompt_tokens(self) -> int:
        return prompt_limit(self._max_model_len, self.settings.max_prompt_tokens)

    # ---- generation ------------------------------------------------------------------------------------------

    def _prompt(self, request: GenRequest) -> tuple[str, int]:
        """The text Triton gets and its token count (as the server will tokenize it: special tokens added, as
        vLLM does with a text prompt)."""
        if request.messages:
            for turn in request.messages:
                if turn.role not in _ROLES:
                    raise InvalidArgument(f"unknown role {turn.role!r}", param="messages")
            turns = [{"role": t.role, "content": t.content} for t in request.messages]
            text = str(self._tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        elif request.prompt:
            text = request.prompt
        else:
            raise InvalidArgument("either messages or prompt is required", param="messages")
        return text, len(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def _refuse_unsupported(self, request: GenRequest) -> None:
        s = request.sampling
        # the prompt goes to Triton as text (the server tokenizes it), so its tokens cannot be cut here
        extensions = s.vllm_extensions()
        vllm_only = [] if self.settings.triton_protocol == "vllm" else \
            [name for name in extensions if name not in _TRTLLM_SAMPLING]
        for refused, param in ((bool(request.tools), "tools"), (s.n > 1, "n"), (s.logprobs is not None, "logprobs"),
                               (bool(request.continuation), "continue_token_ids"),
                               (s.echo, "echo"), (bool(s.logit_bias), "logit_bias"),
                               (s.structured, "response_format"),
                               (s.truncate_prompt_tokens is not None, "truncate_prompt_tokens"),
                               *((True, name) for name in vllm_only)):
            if refused:
                raise InvalidArgument(f"{param} is not supported by model {self.served_model_name!r} (served through "
                                      "Triton)", param=param, code="unsupported_value")

    def _count(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    async def generate(self, request: GenRequest) -> AsyncIterator[GenEvent]:
        if not self._ready or self._stub is None:
            raise Unavailable("the engine is not ready (connecting or draining)")
        check_model(request, self.served_model_name)
        from tritonclient.grpc import InferInput, InferResult
        from tritonclient.grpc._utils import _get_inference_request

        entered = self._clock()
        self._refuse_unsupported(request)
        text, prompt_tokens = self._prompt(request)
        if prompt_tokens > self._max_prompt_tokens():
            raise InvalidArgument(f"prompt has {prompt_tokens} tokens; the limit is {self._max_prompt_tokens()} "
                                  f"(context window {self._max_model_len} tokens)",
                                  param="messages", code="context_length_exceeded")
        s = request.sampling
        max_tokens = max_tokens_for(prompt_tokens, s, default_max_tokens=self.settings.default_max_tokens,
                                    max_model_len=self._max_model_len)
        sampling = {k: getattr(s, k) for k in _VLLM_SAMPLING if getattr(s, k) is not None}
        sampling.update(s.vllm_extensions())  # vLLM's own (its Triton backend takes them in sampling_parameters)
        tensors = request_inputs(self.settings.triton_protocol, prompt=text, sampling=sampling,
                                 max_tokens=max_tokens, stop=list(s.stop), declared=self._inputs,
                                 batched=self._batched, cache_salt=self.salts.salt(request.tenant))
        inputs = [InferInput(name, list(array.shape), dtype).set_data_from_numpy(array)
                  for name, (dtype, array) in tensors.items()]
        message = _get_inference_request(
            model_name=self.triton_model, inputs=inputs, model_version=self.settings.triton_model_version,
            request_id=request.request_id, outputs=None, sequence_id=0, sequence_start=False, sequence_end=False,
            priority=0, timeout=None, parameters=None)
        # Every response then says whether it is the last (and a last one comes even when the model sends no data).
        message.parameters["triton_enable_empty_final_response"].bool_param = True

        done = asyncio.Event()

        async def one_request() -> AsyncIterator[Any]:
            yield message
            await done.wait()  # the stream stays open for the responses; closing it would end them

        completion_tokens, answer, finished = 0, "", False
        server_prompt_tokens: int | None = None
        reason: str | None = None
        call = None
        self._inflight += 1
        try:
            yield Started(prompt_tokens=prompt_tokens)
            sent = self._clock()
            first: float | None = None
            call = self._stub.ModelStreamInfer(one_request())
            async for response in call:
                if response.error_message:
                    raise _model_error(response.error_message)
                infer = response.infer_response
                final = infer.parameters["triton_final_response"].bool_param \
                    if "triton_final_response" in infer.parameters else False
                if infer.outputs:
                    result = InferResult(infer)
                    delta = _text(result.as_numpy("text_output"))
                    counted = _first_int(result, "num_output_tokens") if "num_output_tokens" in self._outputs \
                        else None
                    server_prompt_tokens = _first_int(result, "num_input_tokens") or server_prompt_tokens
                    said = _text(result.as_numpy("finish_reason")) if "finish_reason" in self._outputs else ""
                    if said and said != "None":
                        reason = said
                    answer += delta
                    completion_tokens = completion_tokens + counted if counted is not None else self._count(answer)
                    if delta:
                        if first is None:
                            first = self._clock()
                        yield Delta(text=delta, completion_tokens=completion_tokens)
                if final:
                    break
            else:
                raise Unavailable(f"Triton ended the stream of request {request.request_id!r} without its final "
                                  "response")
            now = self._clock()
            finished = True
            self._finished += 1
            yield Finished(
                reason=_finish_reason(reason, completion_tokens, max_tokens),
                prompt_tokens=server_prompt_tokens or prompt_tokens, completion_tokens=completion_tokens,
                timing=EngineTiming(preprocess_s=sent - entered, prefill_s=(first or now) - sent,
                                    decode_s=now - first if first is not None else 0.0))
        except grpc.aio.AioRpcError as err:
            raise Unavailable(f"Triton at {self.settings.triton_url}: {err.code().name}: {err.details()}") from None
        finally:
            done.set()
            self._inflight -= 1
            if not finished:
                self._aborted += 1
                if call is not None and not call.done():
                    call.cancel()  # Triton cancels the request; the model stops generating
                    log.info("Triton request cancelled", extra={"request_id": request.request_id,
                                                                 "completion_tokens": completion_tokens})


def _text(array: Any) -> str:
    """text_output of one response: its first element (one answer), bytes or str."""
    if array is None or np.asarray(array).size == 0:
        return ""
    item = np.asarray(array).reshape(-1)[0]
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)


def _first_int(result: Any, name: str) -> int | None:
    array = result.as_numpy(name)
    if array is None or np.asarray(array).size == 0:
        return None
    return int(np.asarray(array).reshape(-1)[0])


def _finish_reason(said: str | None, completion_tokens: int, max_tokens: int) -> str:
    """``stop``/``length``/``abort`` from the model's finish_reason output when it has one, else from the count.

    >>> _finish_reason("length", 3, 8), _finish_reason(None, 8, 8), _finish_reason(None, 3, 8)
    ('length', 'length', 'stop')
    """
    if said in ("stop", "length", "abort"):
        return said
    return "length" if completion_tokens >= max_tokens else "stop"


def _model_error(message: str) -> Exception:
    """An error response of the model: a request it refuses (too long, bad parameters) is the caller's to fix."""
    lowered = message.lower()
    if any(words in lowered for words in ("exceeds", "context window", "unsupported sampling", "not allowed",
                                          "is required")):
        return InvalidArgument(f"the model refused the request: {message}", param="sampling")
    return Unavailable(f"the Triton model failed: {message}")
