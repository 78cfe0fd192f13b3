"""The gateway's view of a generation request and the domain checks every request passes, whichever API sent it.

REST bodies become a :class:`GenerationRequest` in :mod:`goodput_gateway.generation_schemas` (pydantic models of
OpenAI's shapes), gRPC messages in :mod:`goodput_gateway.servicer`; both then go through :func:`validate` here, so the
same input gets the same error (and the same ``param``) on either API.

Token estimates are made here and nowhere else (:func:`estimate_tokens`), at one ratio: the worker counts the
exact prompt tokens, the gateway only needs a generous bound before it has a tokenizer's answer.

Example:
    >>> req = GenerationRequest(messages=(Message("user", "What is goodput?"),))
    >>> estimate_tokens(req.prompt_chars())
    5
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace

from goodput.common.v1 import types_pb2

from goodput_core.errors import InvalidArgument
from goodput_core.priority import check_priority
from goodput_core.sampling import Sampling

from goodput_gateway.config import GatewaySettings
from goodput_gateway.limits import load_json

__all__ = ["CHARS_PER_TOKEN", "ROLES", "ROLE_ALIASES", "Cost", "GenerationRequest", "Message", "Sampling",
           "check_length", "check_schema", "estimate_tokens", "resolve_cost", "validate"]

ROLES = {"system", "user", "assistant", "tool"}
ROLE_ALIASES = {"developer": "system"}
# Characters per token of the gateway's estimates (admission cost, the max_tokens default, the RAG budget): a
# generous estimate (English averages ~4 with the served tokenizers), so a bound made with it is not overrun.
CHARS_PER_TOKEN = 3
# Sampling ranges (OpenAI's), checked for REST and gRPC alike.
SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "presence_penalty": (-2.0, 2.0),
                   "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (1e-6, 2.0), "min_p": (0.0, 1.0)}
INT_RANGES = {"max_tokens": (0, 2**31 - 1), "top_k": (-(2**31), 2**31 - 1), "seed": (-(2**63), 2**63 - 1),
              "min_tokens": (0, 2**31 - 1), "truncate_prompt_tokens": (-1, 2**31 - 1)}


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""
    tool_calls: str = ""  # an assistant's calls, as OpenAI's tool_calls JSON (goodput_gateway.tools)
    tool_call_id: str = ""  # a tool message: the call it answers


@dataclass(frozen=True)
class GenerationRequest:
    model: str = ""
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = types_pb2.PRIORITY_UNSPECIFIED  # the caller's ask until the service resolves it against the key
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    session_id: str = ""
    knowledge_base: str = ""  # RAG: the tenant's knowledge base to ground the answer on; empty = none
    kind: str = "chat"  # "chat" or "completion"
    tools: str = ""  # the functions the caller offers and its tool_choice (goodput_gateway.tools.tool_spec)
    cache_key: str = ""  # OpenAI's prompt_cache_key: requests of the tenant sharing it are placed together
    safety_identifier: str = ""  # OpenAI's: the end user, kept only as a hash (safety_hash)

    def prompt_chars(self) -> int:
        """Every character the prompt is rendered from: each message's content, name, tool calls (their arguments)
        and the call id a tool answer names, or the completion prompt."""
        return sum(len(m.content) + len(m.name) + len(m.tool_calls) + len(m.tool_call_id)
                   for m in self.messages) + len(self.prompt)

    def affinity(self, tenant: str) -> str:
        """The key of affine placement (the scheduler's session affinity, the gateway's early start): the
        prompt_cache_key, else the session id (``user``), hashed with the tenant so that two tenants' equal keys
        never meet; empty without either.

        >>> r = GenerationRequest(cache_key="faq-v2")
        >>> r.affinity("acme") == r.affinity("acme") != r.affinity("globex"), len(r.affinity("acme"))
        (True, 32)
        >>> GenerationRequest().affinity("acme")
        ''
        """
        return _tenant_digest(tenant, self.cache_key or self.session_id, 32)

    def safety_hash(self, tenant: str) -> str:
        """The safety_identifier as logs and traces keep it: a hash with the tenant, never the value."""
        return _tenant_digest(tenant, self.safety_identifier, 16)

    def fingerprint(self, tenant: str, model: str) -> str:
        """The request as the quarantine knows it (:mod:`goodput_gateway.quarantine`): a hash of the tenant, the model
        and everything the worker shapes the answer from (messages, prompt, tools, sampling), never the content;
        not the priority, the session or whether it streams.

        >>> r = GenerationRequest(messages=(Message("user", "hi"),))
        >>> r.fingerprint("acme", "m") == replace(r, stream=True).fingerprint("acme", "m"), len(r.fingerprint("a", "m"))
        (True, 32)
        >>> len({r.fingerprint("acme", "m"), r.fingerprint("globex", "m"), r.fingerprint("acme", "m2"),
        ...      replace(r, sampling=Sampling(temperature=0.5)).fingerprint("acme", "m")})
        4
        """
        shaped = json.dumps([model, self.kind, self.prompt, self.tools, repr(self.sampling),
                             [[m.role, m.content, m.name, m.tool_calls, m.tool_call_id] for m in self.messages]],
                            ensure_ascii=False)
        return _tenant_digest(tenant, shaped, 32)

    @property
    def resumable(self) -> bool:
        """Whether the answer can be continued on another worker call from the tokens already sent (the prompt plus
        those tokens, as vLLM resumes a request it preempted): not for several answers, constrained decoding, tools
        (their state is not in the tokens), a seed (a resumed answer would not be the one the seed reproduces), stop
        strings (one could span the seam), presence or frequency penalties (they count the answer's tokens, which
        become prompt) or echo (the prompt's logprobs would cover the continuation).

        >>> GenerationRequest().resumable, GenerationRequest(sampling=Sampling(seed=7)).resumable
        (True, False)
        """
        s = self.sampling
        return (s.n == 1 and not s.structured and not self.tools and s.seed is None and not s.stop and not s.echo
                and not s.presence_penalty and not s.frequency_penalty)

    def prefix_hint(self, limit: int = 512) -> str:
        """The start of the prompt (system prompt first) for prefix-affinity placement."""
        text = "".join(f"{m.role}:{m.content}\n" for m in self.messages) if self.messages else self.prompt
        return text[:limit]


def _tenant_digest(tenant: str, value: str, length: int) -> str:
    """``value`` as a hash scoped to ``tenant`` (hex, ``length`` digits); empty for an empty value."""
    return hashlib.sha256(f"{tenant}\0{value}".encode("utf-8", "surrogatepass")).hexdigest()[:length] if value else ""


def estimate_tokens(chars: int) -> int:
    """Tokens of ``chars`` characters of text, as the gateway estimates them (:data:`CHARS_PER_TOKEN`)."""
    return chars // CHARS_PER_TOKEN


def check_length(value: str, limit: int, *, param: str) -> None:
    """InvalidArgument naming ``param`` when ``value`` is longer than ``limit`` (the value itself is not echoed)."""
    if len(value) > limit:
        raise InvalidArgument(f"'{param}' is {len(value)} characters long; the limit is {limit}", param=param,
                              code="string_above_max_length")


def validate(req: GenerationRequest, settings: GatewaySettings) -> None:
    """The domain checks that need no knowledge of the model: emptiness, roles, sizes, sampling ranges, the priority
    class. Every string and list a caller sends is bounded here by a setting (REST bodies are bounded in bytes
    before they are parsed; gRPC messages by ``max_grpc_message_bytes``)."""
    limits = settings.limits
    check_priority(req.priority)
    if req.messages and req.prompt:
        raise InvalidArgument("set either messages or prompt, not both", param="messages")
    if not req.messages and not req.prompt:
        param = "messages" if req.kind == "chat" else "prompt"
        raise InvalidArgument(f"'{param}' must not be empty", param=param, code="invalid_value")
    if len(req.messages) > limits.messages:
        raise InvalidArgument(f"too many messages ({len(req.messages)}); the limit is {limits.messages}",
                              param="messages", code="invalid_value")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role {m.role[:32]!r} is not one of {sorted(ROLES)}",
                                  param=f"messages[{i}].role", code="invalid_value")
        check_length(m.name, limits.name_chars, param=f"messages[{i}].name")
        check_length(m.tool_call_id, limits.name_chars, param=f"messages[{i}].tool_call_id")
        for part, text in (("content", m.content), ("tool_calls", m.tool_calls)):
            if len(text) > limits.message_chars:
                raise InvalidArgument(f"messages[{i}].{part} has {len(text)} characters; the limit is "
                                      f"{limits.message_chars}", param=f"messages[{i}].{part}",
                                      code="context_length_exceeded")
    if len(req.prompt) > limits.message_chars:
        raise InvalidArgument(f"the prompt has {len(req.prompt)} characters; the limit is {limits.message_chars}",
                              param="prompt", code="context_length_exceeded")
    if req.prompt_chars() > limits.prompt_chars:
        raise InvalidArgument(f"the prompt has {req.prompt_chars()} characters; the limit is {limits.prompt_chars}",
                              param="messages" if req.messages else "prompt", code="context_length_exceeded")
    s = req.sampling
    if s.json_schema is not None:
        if len(s.json_schema) > limits.response_schema_chars:
            raise InvalidArgument(f"the response_format schema has {len(s.json_schema)} characters; the limit is "
                                  f"{limits.response_schema_chars}", param="response_format", code="invalid_value")
        try:
            schema = load_json(s.json_schema.encode(), max_depth=limits.json_depth, what="the response_format schema")
        except InvalidArgument as err:
            raise InvalidArgument(err.message, param="response_format", code=err.code) from None
        if not isinstance(schema, dict):
            raise InvalidArgument("the response_format schema must be a JSON object (a JSON Schema document)",
                                  param="response_format", code="invalid_value")
        check_schema(schema, settings, param="response_format")
    if not 1 <= s.n <= limits.choices:
        raise InvalidArgument(f"n asks for {s.n} answers; the limit is {limits.choices}", param="n",
                              code="invalid_value")
    if s.n > 1 and req.tools:
        raise InvalidArgument("n > 1 with tools is not supported", param="n", code="unsupported_value")
    if s.logprobs is not None and req.tools and json.loads(req.tools)["choice"] == "auto":
        # the tool parser holds back text that may be a call; its tokens' logprobs would not match what streams
        raise InvalidArgument("logprobs with tool_choice 'auto' is not supported", param="logprobs",
                              code="unsupported_value")
    if len(s.logit_bias) > limits.logit_bias:
        raise InvalidArgument(f"logit_bias has {len(s.logit_bias)} entries; the limit is {limits.logit_bias}",
                              param="logit_bias", code="invalid_value")
    if any(not -100 <= b <= 100 for _, b in s.logit_bias):
        raise InvalidArgument("a logit_bias value is outside -100 to 100", param="logit_bias", code="invalid_value")
    if len(req.tools) > limits.tools_chars:
        raise InvalidArgument(f"the tools take {len(req.tools)} characters; the limit is {limits.tools_chars}",
                              param="tools", code="invalid_value")
    if req.tools:
        for i, function in enumerate(json.loads(req.tools)["functions"]):
            check_schema(function.get("parameters"), settings, param=f"tools[{i}].function.parameters")
    if s.logprobs is not None and not 0 <= s.logprobs <= limits.top_logprobs:
        raise InvalidArgument(f"logprobs asks for {s.logprobs} top tokens per position; the limit is "
                              f"{limits.top_logprobs}", param="top_logprobs", code="invalid_value")
    if s.structured and req.kind != "chat":
        raise InvalidArgument("structured output (response_format) is for chat requests", param="response_format",
                              code="unsupported_parameter")
    if s.max_tokens < 0:
        raise InvalidArgument("'max_tokens' must be at least 1", param="max_tokens", code="invalid_value")
    for name, (lo, hi) in SAMPLING_RANGES.items():
        value = getattr(s, name)
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InvalidArgument(f"'{name}' must be between {lo:g} and {hi:g}", param=name, code="invalid_value")
    if len(s.stop) > limits.stop_sequences:
        raise InvalidArgument(f"at most {limits.stop_sequences} stop sequences", param="stop", code="invalid_value")
    if len(s.stop_token_ids) > limits.stop_sequences:  # one bound for both kinds of stop condition
        raise InvalidArgument(f"at most {limits.stop_sequences} stop_token_ids", param="stop_token_ids",
                              code="invalid_value")
    if any(not 0 <= t < 2**31 for t in s.stop_token_ids):
        raise InvalidArgument("stop_token_ids are token ids, from 0", param="stop_token_ids", code="invalid_value")
    if s.truncate_prompt_tokens == 0:
        raise InvalidArgument("'truncate_prompt_tokens' keeps the prompt's last k tokens: k >= 1, or -1 for as many as "
                              "the context window allows", param="truncate_prompt_tokens", code="invalid_value")
    if s.max_tokens and s.min_tokens > s.max_tokens:
        raise InvalidArgument(f"'min_tokens' ({s.min_tokens}) must be at most max_tokens ({s.max_tokens})",
                              param="min_tokens", code="invalid_value")
    for name, (lo, hi) in INT_RANGES.items():  # the proto's integer widths: a bigger number is a 400, not a 500
        value = getattr(s, name)
        if value is not None and not lo <= value <= hi:
            raise InvalidArgument(f"'{name}' must be between {lo} and {hi}", param=name, code="invalid_value")
    for i, stop in enumerate(s.stop):
        check_length(stop, limits.stop_chars, param=f"stop[{i}]")
    check_length(req.model, limits.name_chars, param="model")
    check_length(req.session_id, limits.name_chars, param="user")  # gRPC: session_id
    check_length(req.knowledge_base, limits.name_chars, param="knowledge_base")
    check_length(req.cache_key, limits.name_chars, param="prompt_cache_key")
    check_length(req.safety_identifier, limits.name_chars, param="safety_identifier")


# JSON Schema keywords whose number a grammar repeats (constrained decoding compiles minItems 100000 into as many
# states, stalling the engine for every request beside it)
_REPEATS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
            "maxContains")


def check_schema(schema: object, settings: GatewaySettings, *, param: str) -> None:
    """InvalidArgument naming ``param`` when the JSON Schema (response_format's, a tool's parameters) sets a
    repetition count (minItems, maxLength...) above ``limits.schema_repetition``. Its size and depth were bounded
    where it was read (the body's or the text's :func:`~goodput_gateway.limits.load_json`).

    >>> check_schema({"type": "array", "minItems": 100000}, GatewaySettings(), param="response_format")
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: response_format sets minItems to 100000; the limit is 1000
    """
    bound = settings.limits.schema_repetition
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key in _REPEATS:
                count = item.get(key)
                if isinstance(count, int | float) and count > bound:
                    raise InvalidArgument(f"{param} sets {key} to {count}; the limit is {bound}", param=param,
                                          code="invalid_value")
            stack.extend(item.values())


@dataclass(frozen=True)
class Cost:
    """What a request asks of a worker, as the scheduler's admission sees it."""

    prompt_tokens: int  # estimated (the worker counts them exactly)
    max_tokens: int
    fixed_output: bool = False  # the answer runs to max_tokens (ignore_eos): its output is known at admission
    n: int = 1  # answers (sequences) generated

    @property
    def reservation(self) -> int:
        """The most the request may use, which its quotas reserve at admission: the prompt and every answer's
        max_tokens."""
        return self.prompt_tokens + self.max_tokens * self.n


def resolve_cost(req: GenerationRequest, settings: GatewaySettings, *,
                 max_model_len: int) -> tuple[GenerationRequest, Cost]:
    """The request with its max_tokens checked against the model's window (and the default filled in), and its
    cost. Called once per request, on the final prompt (after RAG)."""
    sampling = req.sampling
    prompt_tokens = estimate_tokens(req.prompt_chars())
    if sampling.truncate_prompt_tokens is not None and sampling.truncate_prompt_tokens > 0:  # the worker cuts it
        prompt_tokens = min(prompt_tokens, sampling.truncate_prompt_tokens)
    if sampling.max_tokens >= max_model_len:
        raise InvalidArgument(f"max_tokens ({sampling.max_tokens}) must be below the model's context window "
                              f"({max_model_len} tokens, prompt included)", param="max_tokens",
                              code="context_length_exceeded")
    if sampling.max_tokens == 0:  # leave room for the prompt
        sampling = replace(sampling, max_tokens=min(settings.default_max_tokens,
                                                    max(max_model_len - prompt_tokens - 16, 1)))
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidArgument(f"'min_tokens' ({sampling.min_tokens}) must be at most max_tokens "
                              f"({sampling.max_tokens}, the default here)", param="min_tokens", code="invalid_value")
    return replace(req, sampling=sampling), Cost(prompt_tokens=prompt_tokens, max_tokens=sampling.max_tokens,
                                                 fixed_output=sampling.fixed_length, n=sampling.n)
