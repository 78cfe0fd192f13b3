"""Sampling parameters as every service sees them, and their one conversion to and from the proto.

Unset fields stay ``None`` end to end, so the model's own defaults (its generation_config) apply at the worker.

Example:
    >>> s = Sampling(max_tokens=16, temperature=0.0)
    >>> sampling_from_proto(sampling_to_proto(s)) == s
    True
    >>> b = Sampling(logit_bias=((13, -100.0), (42, 2.5)))
    >>> sampling_from_proto(sampling_to_proto(b)) == b
    True
    >>> j = Sampling(json_schema='{"type": "object"}')
    >>> sampling_from_proto(sampling_to_proto(j)) == j, j.structured
    (True, True)
    >>> v = Sampling(max_tokens=32, ignore_eos=True, min_tokens=8, skip_special_tokens=False, repetition_penalty=1.1)
    >>> sampling_from_proto(sampling_to_proto(v)) == v, v.fixed_length
    (True, True)
    >>> w = Sampling(max_tokens=32, ignore_eos=True, stop_token_ids=(2, 7))  # a stop id may end it before
    >>> sampling_from_proto(sampling_to_proto(w)) == w, w.fixed_length
    (True, False)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from goodput.common.v1 import types_pb2

_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "json_schema",
             "logprobs", "repetition_penalty", "min_p", "skip_special_tokens", "spaces_between_special_tokens",
             "truncate_prompt_tokens")
# vLLM's extensions that change the answer, with the value that leaves it as it is (VLLM_NEUTRAL[name]).
VLLM_NEUTRAL: dict[str, object] = {"ignore_eos": False, "min_tokens": 0, "repetition_penalty": None, "min_p": None,
                                   "stop_token_ids": (), "include_stop_str_in_output": False,
                                   "skip_special_tokens": None, "spaces_between_special_tokens": None,
                                   "truncate_prompt_tokens": None}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 0  # 0 = the default of whoever fills it in
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    json_schema: str | None = None  # structured output: a JSON Schema document (text) the answer must match
    json_object: bool = False  # structured output: the answer is a JSON object
    logprobs: int | None = None  # None = none; 0 = the sampled token's; k = also the k most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    n: int = 1  # answers to generate
    echo: bool = False  # completions: the prompt first (with logprobs: its tokens' too)
    # vLLM's extensions (types.proto says what each means); VLLM_NEUTRAL holds the values that change nothing
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None

    @property
    def structured(self) -> bool:
        """Whether the answer is constrained to JSON."""
        return self.json_schema is not None or self.json_object

    @property
    def fixed_length(self) -> bool:
        """Whether the answer runs to max_tokens whatever the model says (ignore_eos, no stop condition): what a
        benchmark asks for, and what the scheduler and the quotas then count as its output."""
        return self.ignore_eos and not self.stop and not self.stop_token_ids and not self.structured

    def vllm_extensions(self) -> dict[str, object]:
        """The vLLM extensions set to something other than their neutral value, by name.

        >>> Sampling(min_p=0.1, ignore_eos=True).vllm_extensions()
        {'ignore_eos': True, 'min_p': 0.1}
        """
        return {name: getattr(self, name) for name, neutral in VLLM_NEUTRAL.items() if getattr(self, name) != neutral}


def sampling_from_proto(pb: types_pb2.SamplingParams) -> Sampling:
    optional = {name: getattr(pb, name) if pb.HasField(name) else None for name in _OPTIONAL}
    for name in ("repetition_penalty", "min_p"):  # float32 on the wire: rounded so a value survives the trip
        value = optional[name]
        if value is not None:
            optional[name] = round(float(value), 6)
    return Sampling(max_tokens=pb.max_tokens, stop=tuple(pb.stop), json_object=pb.json_object, n=max(pb.n, 1),
                    echo=pb.echo,
                    logit_bias=tuple(sorted((int(k), round(v, 4)) for k, v in pb.logit_bias.items())),
                    ignore_eos=pb.ignore_eos, min_tokens=pb.min_tokens, stop_token_ids=tuple(pb.stop_token_ids),
                    include_stop_str_in_output=pb.include_stop_str_in_output, **optional)


def sampling_to_proto(s: Sampling) -> types_pb2.SamplingParams:
    pb = types_pb2.SamplingParams(max_tokens=s.max_tokens, stop=list(s.stop), json_object=s.json_object, n=s.n,
                                  echo=s.echo, logit_bias=dict(s.logit_bias), ignore_eos=s.ignore_eos,
                                  min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids),
                                  include_stop_str_in_output=s.include_stop_str_in_output)
    for name in _OPTIONAL:
        value = getattr(s, name)
        if value is not None:
            setattr(pb, name, value)
    return pb


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token, its log probability and the most likely tokens at its position.

    >>> t = TokenLogprob("Paris", -0.01, (("Paris", -0.01), ("Lyon", -4.6)))
    >>> logprobs_from_proto(logprobs_to_proto([t])) == (t,)
    True
    """

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def logprobs_to_proto(tokens: Sequence[TokenLogprob]) -> list[types_pb2.TokenLogprob]:
    return [types_pb2.TokenLogprob(token=t.token, logprob=t.logprob,
                                   top=[types_pb2.TopLogprob(token=tok, logprob=lp) for tok, lp in t.top])
            for t in tokens]


def logprobs_from_proto(tokens: Iterable[types_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    # float32 on the wire: rounded to 6 digits so a value survives the trip unchanged (NaN stays NaN)
    return tuple(TokenLogprob(t.token, t.logprob if math.isnan(t.logprob) else round(t.logprob, 6),
                              tuple((x.token, round(x.logprob, 6)) for x in t.top)) for t in tokens)
