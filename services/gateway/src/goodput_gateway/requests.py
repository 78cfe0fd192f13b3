"""The gateway's view of a generation request, and its validation — shared by REST and gRPC.

REST bodies are parsed with :func:`from_openai_chat` / :func:`from_openai_completion`, gRPC messages with
:func:`from_proto`; both end in :func:`validate`, so the same input gets the same error on either API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2

from goodput_core.errors import InvalidArgument
from goodput_core.priority import parse_priority
from goodput_core.sampling import Sampling, sampling_from_proto

from goodput_gateway.config import GatewaySettings

ROLES = {"system", "user", "assistant", "tool"}
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""


@dataclass(frozen=True)
class GenerationRequest:
    model: str = ""
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = types_pb2.PRIORITY_UNSPECIFIED
    stream: bool = False
    include_usage: bool = False
    session_id: str = ""
    kind: str = "chat"  # "chat" or "completion"

    def prompt_chars(self) -> int:
        return sum(len(m.content) for m in self.messages) + len(self.prompt)

    def prefix_hint(self, limit: int = 512) -> str:
        """The start of the prompt (system prompt first) for prefix-affinity placement."""
        text = "".join(f"{m.role}:{m.content}\n" for m in self.messages) if self.messages else self.prompt
        return text[:limit]


# ---- REST (OpenAI shapes) ------------------------------------------------------------------------------------


def _type_error(param: str, expected: str) -> InvalidArgument:
    return InvalidArgument(f"'{param}' must be {expected}", param=param, code="invalid_type")


def _opt_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number")
    if not lo <= value <= hi:
        raise InvalidArgument(f"'{name}' must be between {lo:g} and {hi:g}", param=name, code="invalid_value")
    return float(value)


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer")
    return value


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content: only text parts are supported",
                                      param=f"messages[{i}].content", code="invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts")


def _sampling_from_body(body: dict[str, Any]) -> Sampling:
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidArgument("'max_tokens' must be at least 1", param="max_tokens", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _type_error("stop", "a string or a list of strings")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise InvalidArgument("only n=1 is supported", param="n", code="invalid_value")
    top_k = _opt_int(body, "top_k")
    return Sampling(
        max_tokens=max_tokens or 0,
        temperature=_opt_number(body, "temperature", 0.0, 2.0),
        top_p=_opt_number(body, "top_p", 1e-9, 1.0),
        top_k=top_k,
        stop=stops,
        seed=_opt_int(body, "seed"),
        presence_penalty=_opt_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", -2.0, 2.0),
    )


def _common(body: dict[str, Any], header_priority: str | None) -> dict[str, Any]:
    model = body.get("model", "")
    if model is None:
        model = ""
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    priority_value = body.get("priority", header_priority)
    priority: int = types_pb2.PRIORITY_UNSPECIFIED
    if priority_value is not None:
        if not isinstance(priority_value, str):
            raise _type_error("priority", "one of 'P0', 'P1', 'P2'")
        priority = parse_priority(priority_value)
    session = body.get("user") or ""
    return {"model": model, "stream": stream, "include_usage": bool(options.get("include_usage")),
            "priority": priority, "sampling": _sampling_from_body(body),
            "session_id": session if isinstance(session, str) else ""}


def from_openai_chat(body: Any, *, header_priority: str | None = None) -> GenerationRequest:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", code="invalid_json")
    messages = body.get("messages")
    if messages is None:
        raise InvalidArgument("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"messages[{i}].role", "a string")
        role = _ROLE_ALIASES.get(role, role)
        name = m.get("name") or ""
        parsed.append(Message(role=role, content=_content_text(m.get("content"), i),
                              name=name if isinstance(name, str) else ""))
    return GenerationRequest(messages=tuple(parsed), **_common(body, header_priority))


def from_openai_completion(body: Any, *, header_priority: str | None = None) -> GenerationRequest:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", code="invalid_json")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise InvalidArgument("'prompt' is required", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise _type_error("prompt", "a string (batches of prompts are not supported)")
    return GenerationRequest(prompt=prompt, kind="completion", **_common(body, header_priority))


# ---- gRPC ----------------------------------------------------------------------------------------------------


def from_proto(req: gateway_pb2.GenerateRequest, *, stream: bool) -> GenerationRequest:
    s = req.sampling
    if s.max_tokens < 0:
        raise InvalidArgument("max_tokens must be at least 1", param="max_tokens", code="invalid_value")
    sampling = sampling_from_proto(s)
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0)):
        value = getattr(sampling, name)
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g}", param=name, code="invalid_value")
    messages = tuple(Message(role=_ROLE_ALIASES.get(m.role, m.role), content=m.content, name=m.name)
                     for m in req.messages)
    return GenerationRequest(model=req.model, messages=messages, prompt=req.prompt, sampling=sampling,
                             priority=int(req.priority), stream=stream, session_id=req.session_id,
                             kind="completion" if req.prompt and not req.messages else "chat")


def to_openai_body(req: GenerationRequest, *, knowledge_base: str = "") -> tuple[str, dict[str, Any]]:
    """The route (``chat`` or ``completions``) and OpenAI-shaped body of a parsed request: how a gRPC request is
    stored when it is parked as a job, so a job runs the same way whichever API submitted it."""
    body: dict[str, Any] = {"model": req.model}
    if req.kind == "chat":
        body["messages"] = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                            for m in req.messages]
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
    if req.session_id:
        body["user"] = req.session_id
    if knowledge_base:
        body["knowledge_base"] = knowledge_base
    return ("chat" if req.kind == "chat" else "completions"), body


# ---- shared validation ---------------------------------------------------------------------------------------


def validate_shape(req: GenerationRequest, settings: GatewaySettings) -> None:
    """Checks what needs no knowledge of the model: roles, emptiness, sizes."""
    if req.messages and req.prompt:
        raise InvalidArgument("set either messages or prompt, not both", param="messages")
    if not req.messages and not req.prompt:
        param = "messages" if req.kind == "chat" else "prompt"
        raise InvalidArgument(f"'{param}' must not be empty", param=param, code="invalid_value")
    if len(req.messages) > settings.max_messages:
        raise InvalidArgument(f"too many messages ({len(req.messages)}); the limit is {settings.max_messages}",
                              param="messages", code="invalid_value")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role {m.role!r} is not one of {sorted(ROLES)}",
                                  param=f"messages[{i}].role", code="invalid_value")
    if req.prompt_chars() > settings.max_prompt_chars:
        raise InvalidArgument(f"the prompt has {req.prompt_chars()} characters; the limit is "
                              f"{settings.max_prompt_chars}", param="messages", code="context_length_exceeded")
    if len(req.sampling.stop) > settings.max_stop_sequences:
        raise InvalidArgument(f"at most {settings.max_stop_sequences} stop sequences", param="stop",
                              code="invalid_value")


def apply_model_limits(req: GenerationRequest, settings: GatewaySettings, *, max_model_len: int) -> GenerationRequest:
    """Checks max_tokens against the model's context window and fills the default. The worker checks the exact
    prompt length in tokens."""
    sampling = req.sampling
    if sampling.max_tokens >= max_model_len:
        raise InvalidArgument(f"max_tokens ({sampling.max_tokens}) must be below the model's context window "
                              f"({max_model_len} tokens, prompt included)", param="max_tokens",
                              code="context_length_exceeded")
    if sampling.max_tokens == 0:
        # Leave room for the prompt (a generous estimate of its tokens: 3 characters a token).
        default = min(settings.default_max_tokens, max(max_model_len - req.prompt_chars() // 3 - 16, 1))
        sampling = replace(sampling, max_tokens=default)
    return replace(req, sampling=sampling)
