"""The gateway's ground floor: what a generation streams (:class:`TextDelta` events, then one :class:`StreamEnd`),
the finish reasons on the wire, and the headers of a server-sent event stream. Nothing else of the gateway is
below this module: the service, the APIs, the cache and the worker client all speak these words.

    >>> finish_reason(FINISH_PB["length"]), finish_reason(0)
    ('length', 'stop')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput.common.v1 import types_pb2

from goodput_core.sampling import TokenLogprob

__all__ = ["FINISH_PB", "SSE_HEADERS", "StreamEnd", "TextDelta", "finish_reason"]


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # with Sampling.logprobs: the tokens the text came from
    index: int = 0  # with Sampling.n > 1: the answer it belongs to
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with Sampling.echo and logprobs: the prompt's, first delta only
    prompt_tokens: int = 0  # the request's, once the worker counted them (0: not known)
    completion_tokens: int = 0  # generated so far, every answer together (vLLM's continuous usage stats)


@dataclass(frozen=True)
class StreamEnd:
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, from the engine's prefix cache
    finish_reasons: tuple[str, ...] = ()  # with Sampling.n > 1: each answer's, by index
    tool_calls: tuple[dict[str, Any], ...] = ()  # tool_choice auto: the calls the worker's parser read (OpenAI's)


# The finish reasons as the protos carry them (workers, the cache, the gateway's gRPC API) and as OpenAI spells them.
FINISH_PB = {"stop": types_pb2.FINISH_REASON_STOP, "length": types_pb2.FINISH_REASON_LENGTH,
             "abort": types_pb2.FINISH_REASON_ABORT}
_FINISH_NAMES: dict[int, str] = {value: name for name, value in FINISH_PB.items()}


def finish_reason(value: int) -> str:
    """A proto finish reason as OpenAI names it ("stop" for one left unset)."""
    return _FINISH_NAMES.get(value, "stop")


SSE_HEADERS = {
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",  # nginx and compatible proxies: do not buffer the event stream
    "Connection": "keep-alive",
}
