"""Sampling parameters as every service sees them, and their one conversion to and from the proto.

Unset fields stay ``None`` end to end, so the model's own defaults (its generation_config) apply at the worker.

Example:
    >>> s = Sampling(max_tokens=16, temperature=0.0)
    >>> sampling_from_proto(sampling_to_proto(s)) == s
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from goodput.common.v1 import types_pb2

_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


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


def sampling_from_proto(pb: types_pb2.SamplingParams) -> Sampling:
    optional = {name: getattr(pb, name) if pb.HasField(name) else None for name in _OPTIONAL}
    return Sampling(max_tokens=pb.max_tokens, stop=tuple(pb.stop), **optional)


def sampling_to_proto(s: Sampling) -> types_pb2.SamplingParams:
    pb = types_pb2.SamplingParams(max_tokens=s.max_tokens, stop=list(s.stop))
    for name in _OPTIONAL:
        value = getattr(s, name)
        if value is not None:
            setattr(pb, name, value)
    return pb
