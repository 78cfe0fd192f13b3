"""What the worker needs from an engine, independent of gRPC and of the engine's library.

The vLLM adapter (:mod:`goodput_inference.vllm_engine`) implements :class:`Engine`; so can a simulated engine for
capacity experiments, behind the same servicer, so the scheduler cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from goodput_core.errors import InvalidArgument
from goodput_core.sampling import Sampling, TokenLogprob

__all__ = ["ChatTurn", "Delta", "Engine", "EngineTiming", "Finished", "GenEvent", "GenRequest", "Load",
           "ModelDescription", "Sampling", "Started", "ToolCall", "check_model", "continue_answer", "max_tokens_for",
           "prompt_limit", "truncate"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    name: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's earlier calls (rendered by the tool chat template)
    tool_call_id: str = ""  # a tool message: the call it answers


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    messages: tuple[ChatTurn, ...] = ()
    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = 0  # 0 = unspecified, 1 = P0 (most urgent) ... 3 = P2
    model: str = ""
    tenant: str = ""  # whose prefix cache the prompt may reuse (goodput_inference.tenancy)
    # tool_choice "auto": OpenAI's tools JSON array; the engine renders them with its tool chat template and reads
    # the answer with its tool-call parser (refused without one)
    tools: str = ""
    parallel_tool_calls: bool = True
    # the answer's tokens an earlier call already generated: the rest of the prompt, and counted in the answer
    # (inference.proto's continue_token_ids; see continue_answer)
    continuation: tuple[int, ...] = ()


@dataclass(frozen=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # with Sampling.logprobs: the tokens this text came from
    index: int = 0  # with Sampling.n > 1: the answer this text belongs to
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with Sampling.echo and logprobs, on the first delta only
    token_ids: tuple[int, ...] = ()  # the tokens generated since the previous delta (n = 1)


@dataclass(frozen=True)
class EngineTiming:
    """Where a request's time went inside the worker, in seconds (the engine's own timestamps)."""

    preprocess_s: float = 0.0  # chat template, tokenization, validation: before the engine had it
    queued_s: float = 0.0  # in the engine's queue, before its first scheduling
    prefill_s: float = 0.0  # scheduled to first token
    decode_s: float = 0.0  # first token to last token


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    # Of prompt_tokens, those whose KV came from the prefix cache (their prefill was skipped); 0 without a hit.
    cached_tokens: int = 0
    reasons: tuple[str, ...] = ()  # with Sampling.n > 1: each answer's, by index
    tool_calls: tuple[ToolCall, ...] = ()  # with GenRequest.tools: the calls read from the answer
    timing: EngineTiming | None = None  # None when the engine keeps no per-request timestamps


GenEvent = Started | Delta | Finished


@dataclass(frozen=True)
class ModelDescription:
    served_model_name: str
    model: str
    max_model_len: int
    max_prompt_tokens: int
    engine: str
    model_version: str
    max_num_batched_tokens: int = 0  # the engine's per-step token budget (chunked prefill); 0 = unknown
    tool_call_parser: str = ""  # what gives tool_choice "auto"; empty = none
    continues: bool = True  # takes GenRequest.continuation (the prompt as token ids)


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    kv_cache_usage: float
    gpu_utilization: float
    max_num_seqs: int
    aborted_total: int
    finished_total: int
    ready: bool
    # Prefix cache, since start: prompt tokens looked up, and those found cached (a hit skips their prefill).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Engine(Protocol):
    async def start(self) -> None:
        """Loads the model; returns when the engine can generate."""

    def describe(self) -> ModelDescription: ...

    def load(self) -> Load: ...

    def numerics(self) -> dict[str, str]:
        """What the engine computes with (device, dtype, KV-cache dtype, CPU ISA...), as labels of the worker's
        ``goodput_worker_engine_info`` metric; empty until the engine has started."""
        ...

    def generate(self, request: GenRequest) -> AsyncIterator[GenEvent]:
        """Yields Started first (after validation), then Delta events, then Finished. Closing the iterator early
        aborts the request in the engine. Raises goodput_core.errors.InvalidArgument for a bad request."""
        ...

    async def shutdown(self) -> None: ...


def truncate(ids: list[int], keep: int | None, limit: int) -> list[int]:
    """The prompt's token ids as vLLM's ``truncate_prompt_tokens`` leaves them: the last ``keep`` (-1: as many as
    the window allows, ``limit``); a ``keep`` above ``limit`` is refused, as vLLM refuses it.

    >>> truncate([1, 2, 3, 4], 2, 10), truncate([1, 2, 3, 4], -1, 3), truncate([1, 2], None, 1)
    ([3, 4], [2, 3, 4], [1, 2])
    """
    if keep is None:
        return ids
    if keep > limit:
        raise InvalidArgument(f"truncate_prompt_tokens ({keep}) must be at most the prompt limit of {limit} tokens",
                              param="truncate_prompt_tokens", code="invalid_value")
    return ids[-(limit if keep == -1 else keep):]


def check_model(request: GenRequest, served_model_name: str) -> None:
    """A request that names another model than the one served here is refused."""
    if request.model and request.model != served_model_name:
        raise InvalidArgument(f"model {request.model!r} is not served here; use {served_model_name!r}",
                              param="model", code="model_not_found")


def prompt_limit(max_model_len: int, max_prompt_tokens: int) -> int:
    """The longest prompt accepted: the context window less one token, or the ``max_prompt_tokens`` setting if lower.

    >>> prompt_limit(2048, 0), prompt_limit(2048, 1000)
    (2047, 1000)
    """
    return min(max_model_len - 1, max_prompt_tokens or max_model_len)


def max_tokens_for(prompt_tokens: int, sampling: Sampling, *, default_max_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens (by default as many as the window leaves, up to ``default_max_tokens``); refused
    when prompt and answer cannot fit the context window."""
    max_tokens = sampling.max_tokens or min(default_max_tokens, max_model_len - prompt_tokens)
    if max_tokens < 1:
        raise InvalidArgument("max_tokens must be at least 1", param="max_tokens")
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidArgument(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                              f"window of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def continue_answer(request: GenRequest, max_tokens: int) -> tuple[int, int]:
    """(max_tokens, min_tokens) left to generate for a continuation (``request.continuation``: the answer's tokens
    generated already), from the whole answer's ``max_tokens``; InvalidArgument when nothing is left, or for what a
    continuation cannot carry on (several answers, constrained decoding, tools: their state is not in the tokens).

    >>> from goodput_core.sampling import Sampling
    >>> continue_answer(GenRequest(request_id="r", prompt="p", continuation=(5, 6),
    ...                            sampling=Sampling(max_tokens=10, min_tokens=3)), 10)
    (8, 1)
    """
    s, done = request.sampling, len(request.continuation)
    for refused, param in ((s.n > 1, "n"), (s.structured, "response_format"), (bool(request.tools), "tools"),
                           (done >= max_tokens, "continue_token_ids")):
        if refused:
            raise InvalidArgument(f"a continuation of {done} tokens cannot carry on a request with this {param} "
                                  f"(max_tokens {max_tokens})", param=param, code="unsupported_parameter")
    return max_tokens - done, max((s.min_tokens or 0) - done, 0)
