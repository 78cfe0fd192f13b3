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
           "ModelDescription", "Sampling", "Started", "ToolCall", "truncate"]


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
