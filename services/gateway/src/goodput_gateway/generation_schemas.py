"""The chat and completions request bodies (:mod:`goodput_gateway.schemas` says how a body is checked), the domain
request each becomes and :func:`to_body`, its way back. vLLM's own request fields are treated as OpenAI's: its
sampling extensions (``ignore_eos``, ``min_tokens``, ...) are carried to the engine with vLLM's meaning, the rest
(beam search, chat template overrides, ...) are accepted only at the value that asks for nothing
(:data:`VLLM_NEUTRAL_FIELDS`).

Example:
    >>> from goodput_gateway.schemas import parse
    >>> body = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    >>> body.to_request().sampling.max_tokens
    8
    >>> parse(ChatCompletionRequest, {"messages": [], "audio": {"voice": "alloy"}})
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: 'audio' is not supported by this gateway (accepted: null)
    >>> body = parse(CompletionRequest, {"prompt": "Hi", "max_tokens": 32, "ignore_eos": True, "priority": 0})
    >>> body.to_request().sampling.fixed_length
    True
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any, Literal

from goodput.common.v1 import types_pb2
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from goodput_core.errors import InvalidArgument
from goodput_core.priority import parse_priority
from goodput_core.sampling import Sampling

from goodput_gateway.requests import ROLE_ALIASES, GenerationRequest, Message
from goodput_gateway.schemas import Body
from goodput_gateway.tools import resolve

__all__ = ["ChatCompletionRequest", "CompletionRequest", "VLLM_NEUTRAL_FIELDS", "to_body"]

# vLLM's request fields that Goodput does not implement -> the values that ask for nothing (vLLM's defaults): a
# client of `vllm serve` that sends its defaults explicitly is served; anything else is refused by name.
VLLM_NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1),  # length_penalty is beam search's only
    "truncation_side": (None, "left"), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "watermarking": (None, False), "kv_transfer_params": (None,),
    "cache_salt": (None,),  # Goodput salts the prefix cache per tenant itself
    "vllm_xargs": (None,), "request_id": (None,), "thinking_token_budget": (None,)}


class StreamOptions(Body):
    UNSUPPORTED = {"include_obfuscation": (None, False)}
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, the usage so far on every chunk


class FunctionCall(Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCall(Body):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedTool(Body):
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _named(cls, value: dict[str, str]) -> dict[str, str]:
        if set(value) != {"name"}:
            raise PydanticCustomError("invalid_value", "must be {\"name\": <a function in tools>}")
        return value


class ChatMessage(Body):
    UNSUPPORTED = {"function_call": (None,), "audio": (None,), "refusal": (None,)}
    role: str
    content: str | None = None  # text, or a list of text parts (joined), see below
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            if value is not None and not isinstance(value, str):
                raise PydanticCustomError("invalid_type", "must be a string or an array of text parts")
            return value
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str) or part.get("type") != "text" \
                    or set(part) - {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else None
                raise PydanticCustomError("unsupported_value", f"part {j}: only text parts are supported"
                                          + (f", not {kind!r}" if isinstance(kind, str) and kind != "text" else ""))
            texts.append(part["text"])
        return "".join(texts)


class JsonSchemaFormat(Body):
    """``response_format.json_schema``: the schema the answer must match (the engine enforces it whether or not
    ``strict`` is set)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (structured output)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "json_schema is required with type json_schema, and only then")
        return self

    def sampling(self) -> dict[str, Any]:
        """The Sampling fields this format sets (the schema as canonical JSON text, so equal schemas are equal)."""
        if self.json_schema is not None:
            return {"json_schema": json.dumps(self.json_schema.schema_, sort_keys=True, separators=(",", ":"))}
        return {"json_object": self.type == "json_object"}


class _Generation(Body):
    """What chat and completions share: model, sampling, streaming and the Goodput extensions."""

    UNSUPPORTED = {"service_tier": (None, "auto", "default"),
                   "store": (None, False), "metadata": (None, {}), **VLLM_NEUTRAL_FIELDS}
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    stop: list[str] = []
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=128)  # answers to generate (the gateway's LIMITS__CHOICES bounds it)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, -100 to 100
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the session id of session-affine placement
    prompt_cache_key: str | None = None  # placement for prefix reuse, within the tenant (over `user`)
    safety_identifier: str | None = None  # the end user; logs and traces keep only a hash of it
    # vLLM's sampling extensions, with vLLM's meaning (types.proto's SamplingParams says what each does)
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Goodput extensions (with the openai SDK: extra_body={...})
    priority: str | int | None = None  # "P0" | "P1" | "P2"; or the X-Goodput-Priority header (see _classes)
    knowledge_base: str | None = None  # RAG; or the X-Goodput-Knowledge-Base header

    @field_validator("priority")
    @classmethod
    def _classes(cls, value: str | int | None) -> str | None:
        """Goodput's priority is a class. vLLM's integer ``priority`` (an order inside its one queue, default 0)
        has no such meaning here: its default 0 is taken as unset, any other number is refused by name."""
        if isinstance(value, int):
            if value != 0:
                raise PydanticCustomError(
                    "unsupported_value", "is a class here, \"P0\", \"P1\" or \"P2\" (vLLM's integer priority is "
                    "not honoured; its default 0 is accepted as unset)")
            return None
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise PydanticCustomError("invalid_type", "must be a string or an array of strings")
        return value

    @abstractmethod
    def to_request(self, *, header_priority: str | None = None, header_kb: str | None = None) -> GenerationRequest:
        """The domain request (chat and completions each say how); headers fill what the body leaves unset."""

    def _common(self, *, header_priority: str | None, header_kb: str | None, max_tokens: int | None,
                structured: dict[str, Any]) -> dict[str, Any]:
        priority_value = str(self.priority) if self.priority is not None else header_priority
        priority = parse_priority(priority_value) if priority_value is not None else types_pb2.PRIORITY_UNSPECIFIED
        kb = self.knowledge_base if self.knowledge_base is not None else (header_kb or "")
        bias: list[tuple[int, float]] = []
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise InvalidArgument(f"logit_bias maps token ids (integers as strings) to biases from -100 to 100; "
                                      f"not {token[:16]!r}: {value}", param="logit_bias", code="invalid_value")
            bias.append((int(token), float(value)))
        sampling = Sampling(max_tokens=max_tokens or 0, temperature=self.temperature, top_p=self.top_p,
                            logit_bias=tuple(sorted(bias)), n=self.n or 1,
                            top_k=self.top_k, stop=tuple(self.stop), seed=self.seed,
                            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                            ignore_eos=bool(self.ignore_eos), min_tokens=self.min_tokens or 0,
                            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                            stop_token_ids=tuple(self.stop_token_ids or ()),
                            include_stop_str_in_output=bool(self.include_stop_str_in_output),
                            skip_special_tokens=self.skip_special_tokens,
                            spaces_between_special_tokens=self.spaces_between_special_tokens,
                            truncate_prompt_tokens=self.truncate_prompt_tokens, **structured)
        return {"model": self.model or "", "sampling": sampling, "priority": priority, "stream": bool(self.stream),
                "include_usage": bool(self.stream_options and self.stream_options.include_usage),
                "continuous_usage": bool(self.stream_options and self.stream_options.include_usage
                                         and self.stream_options.continuous_usage_stats),
                "session_id": self.user or "", "knowledge_base": kb.strip(), "cache_key": self.prompt_cache_key or "",
                "safety_identifier": self.safety_identifier or ""}


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    UNSUPPORTED = {**_Generation.UNSUPPORTED, "functions": (None, []), "function_call": (None, "none"),
                   "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
                   "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
                   # vLLM's chat-only fields, at their defaults
                   "echo": (None, False), "add_generation_prompt": (None, True),
                   "continue_final_message": (None, False), "add_special_tokens": (None, False),
                   "documents": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
                   "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}), "include_reasoning": (None, True)}
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "needs logprobs: true")
        return value

    def to_request(self, *, header_priority: str | None = None, header_kb: str | None = None) -> GenerationRequest:
        messages = tuple(Message(role=ROLE_ALIASES.get(m.role, m.role), content=m.content or "", name=m.name or "",
                                 tool_calls=json.dumps([c.model_dump() for c in m.tool_calls], sort_keys=True)
                                 if m.tool_calls else "", tool_call_id=m.tool_call_id or "")
                         for m in self.messages)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        structured = self.response_format.sampling() if self.response_format is not None else {}
        if self.logprobs:
            structured["logprobs"] = self.top_logprobs or 0
        tools = self._tools()
        if tools and (structured.get("json_schema") or structured.get("json_object")):
            raise InvalidArgument("tools and a JSON response_format cannot be combined", param="response_format",
                                  code="invalid_value")
        return GenerationRequest(messages=messages, kind="chat", tools=tools, **self._common(
            header_priority=header_priority, header_kb=header_kb, max_tokens=max_tokens, structured=structured))

    def _tools(self) -> str:
        """The tools as :func:`goodput_gateway.tools.tool_spec` (empty without tools, or with an empty list)."""
        choice = self.tool_choice
        return resolve([t.function.model_dump(exclude_none=True) for t in self.tools or []],
                       choice if isinstance(choice, str) or choice is None else choice.function["name"],
                       parallel=self.parallel_tool_calls)


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt (a string, or an array of one string)."""

    UNSUPPORTED = {**_Generation.UNSUPPORTED, "best_of": (None, 1), "suffix": (None, ""),
                   "add_special_tokens": (None, True), "prompt_embeds": (None,)}
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's: how many top tokens per position
    echo: bool | None = None  # the prompt first, in the text (and, with logprobs, its tokens' logprobs)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) == 1 and isinstance(value[0], str):
                return value[0]
            raise PydanticCustomError("unsupported_value", "must be one string (batches of prompts and token arrays "
                                      "are not supported)")
        return value

    def to_request(self, *, header_priority: str | None = None, header_kb: str | None = None) -> GenerationRequest:
        return GenerationRequest(prompt=self.prompt, kind="completion", **self._common(
            header_priority=header_priority, header_kb=header_kb, max_tokens=self.max_tokens,
            structured={**({"logprobs": self.logprobs} if self.logprobs is not None else {}),
                        **({"echo": True} if self.echo else {})}))


def to_body(req: GenerationRequest) -> tuple[str, dict[str, Any]]:
    """The route (``chat`` or ``completions``) and the OpenAI-shaped body of a parsed request, which parses back to
    the same request: how a shed request is stored when it is parked as a job, whichever API sent it."""
    body: dict[str, Any] = {"model": req.model}
    if req.kind == "chat":
        body["messages"] = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {}),
                             **({"tool_calls": json.loads(m.tool_calls)} if m.tool_calls else {}),
                             **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                            for m in req.messages]
        if req.tools:
            spec = json.loads(req.tools)
            body["tools"] = [{"type": "function", "function": f} for f in spec["functions"]]
            body["tool_choice"] = (spec["choice"] if spec["choice"] in ("none", "auto", "required")
                                   else {"type": "function", "function": {"name": spec["choice"]}})
            body["parallel_tool_calls"] = spec["parallel"]
    else:
        body["prompt"] = req.prompt
    s = req.sampling
    if s.max_tokens:
        body["max_tokens"] = s.max_tokens
    if s.stop:
        body["stop"] = list(s.stop)
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            body[name] = value
    body.update({k: list(v) if isinstance(v, tuple) else v for k, v in s.vllm_extensions().items()})
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.n > 1:
        body["n"] = s.n
    if s.echo:
        body["echo"] = True
    if s.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "response", "schema": json.loads(s.json_schema)}}
    elif s.json_object:
        body["response_format"] = {"type": "json_object"}
    if s.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": s.logprobs} if req.kind == "chat" else {"logprobs": s.logprobs})
    extras = {"user": req.session_id, "prompt_cache_key": req.cache_key, "safety_identifier": req.safety_identifier,
              "knowledge_base": req.knowledge_base}
    body.update({name: value for name, value in extras.items() if value})
    return ("chat" if req.kind == "chat" else "completions"), body
