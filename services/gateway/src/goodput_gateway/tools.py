"""Tool calling. ``tool_choice`` ``required`` or a named function is enforced with the engine's structured output
(the answer must be a call: a JSON document of the function's ``parameters`` schema), so it works with every model,
a 135M one included; ``none`` answers in text. ``auto`` (the model chooses between text and a call) is the model's
own skill: the worker renders the tools with the model's tool chat template and reads the answer with vLLM's
tool-call parser for that model (``goodput_inference.tool_parsing``); a model served without a parser refuses it by
name.

The request keeps what the caller sent (``GenerationRequest.tools``, the conversation's ``tool_calls`` and
``tool_call_id``); :func:`apply_tools` turns it into what the engine sees just before the request is looked up in
the cache and admitted: for ``required``/named/``none``, the functions described in the system message, earlier
calls and results as text, and the JSON schema of an answer (``auto`` goes to the worker as it came).
:func:`tool_calls` reads a ``required``/named answer back as OpenAI's ``tool_calls``; an ``auto`` answer's calls
come from the worker with the stream's end.

    >>> spec = tool_spec([{"name": "weather", "parameters": {"type": "object", "properties": {
    ...     "city": {"type": "string"}}, "required": ["city"]}}], choice="weather", parallel=True)
    >>> req = apply_tools(GenerationRequest(messages=(Message("user", "Weather in Paris?"),), tools=spec))
    >>> json.loads(req.sampling.json_schema or "")["required"], req.messages[0].role
    (['city'], 'system')
    >>> [c["function"] for c in tool_calls(req, '{"city": "Paris"}', ids=iter(["call_1"]))]
    [{'name': 'weather', 'arguments': '{"city": "Paris"}'}]
    >>> auto = GenerationRequest(messages=(Message("user", "Weather in Paris?"),), tools=tool_spec(
    ...     [{"name": "weather"}], choice="auto", parallel=False))
    >>> apply_tools(auto) is auto, calling(auto), json.loads(worker_tools(auto)[0])[0]["function"]["name"]
    (True, False, 'weather')
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from goodput_core.errors import InvalidArgument

from goodput_gateway.requests import GenerationRequest, Message

__all__ = ["apply_tools", "auto", "calling", "named", "new_call_id", "resolve", "tool_calls", "tool_spec",
           "worker_tools"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def resolve(functions: list[dict[str, Any]], choice: str | None, *, parallel: bool | None) -> str:
    """A request's tools as :func:`tool_spec` (empty without functions), checked the same for REST and gRPC: a
    choice needs functions; none given is ``auto`` (OpenAI's default with tools)."""
    if not functions:
        if choice not in (None, "", "none"):
            raise InvalidArgument("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return ""
    return tool_spec(functions, choice=choice or "auto", parallel=parallel is not False)


def tool_spec(functions: list[dict[str, Any]], *, choice: str, parallel: bool) -> str:
    """The canonical text of a request's tools: its functions (name, description, parameters), the choice
    (``none``, ``auto``, ``required`` or a function's name) and whether several calls may come at once."""
    if choice not in ("none", "auto", "required") and choice not in {f["name"] for f in functions}:
        raise InvalidArgument(f"tool_choice names {choice!r}, which is not in tools", param="tool_choice",
                              code="invalid_value")
    return json.dumps({"functions": functions, "choice": choice, "parallel": parallel}, sort_keys=True,
                      separators=(",", ":"))


def _spec(req: GenerationRequest) -> dict[str, Any] | None:
    return json.loads(req.tools) if req.tools else None


def calling(req: GenerationRequest) -> bool:
    """Whether the answer is a call (``required`` or a named function), not text."""
    spec = _spec(req)
    return spec is not None and spec["choice"] not in ("none", "auto")


def auto(req: GenerationRequest) -> bool:
    """Whether the model chooses between text and calls (``tool_choice: auto``): the worker's tool parser reads
    its answer."""
    spec = _spec(req)
    return spec is not None and spec["choice"] == "auto"


def named(req: GenerationRequest) -> str | None:
    """The function a request must call (``tool_choice`` naming one), else None."""
    spec = _spec(req)
    return spec["choice"] if spec is not None and spec["choice"] not in ("none", "auto", "required") else None


def worker_tools(req: GenerationRequest) -> tuple[str, bool]:
    """``tool_choice: auto``: the tools as OpenAI's array (JSON), for the worker's template, and whether several
    calls may come at once; ("", True) otherwise."""
    spec = _spec(req)
    if spec is None or spec["choice"] != "auto":
        return "", True
    return json.dumps([{"type": "function", "function": f} for f in spec["functions"]], ensure_ascii=False,
                      separators=(",", ":")), bool(spec["parallel"])


def _call_schema(spec: dict[str, Any]) -> dict[str, Any]:
    functions = {f["name"]: f.get("parameters") or _ANY_OBJECT for f in spec["functions"]}
    if spec["choice"] != "required":  # a named function: the answer is its arguments
        return functions[spec["choice"]]
    one = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": name}, "arguments": params}}
                     for name, params in functions.items()]}
    return {"type": "array", "minItems": 1, "items": one} if spec["parallel"] else one


def _described(spec: dict[str, Any]) -> str:
    listed = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}
                         for f in spec["functions"]], ensure_ascii=False)
    if spec["choice"] == "none":
        return f"Functions exist ({listed}), but answer in text now; call none."
    if spec["choice"] == "required":
        how = ("one or more of them, as a JSON array of {\"name\", \"arguments\"} objects" if spec["parallel"]
               else "one of them, as a JSON object {\"name\", \"arguments\"}")
        return f"You can call these functions: {listed}. Answer with a call of {how}, and nothing else."
    return (f"You can call these functions: {listed}. Call {spec['choice']}: answer with its arguments as a "
            "JSON object, and nothing else.")


def _as_text(m: Message) -> Message:
    """Earlier calls and results as the text the chat template renders."""
    if m.tool_calls:
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in json.loads(m.tool_calls)]
        return Message(role=m.role, content=(m.content + "\n" if m.content else "") + "Called: "
                       + json.dumps(calls, ensure_ascii=False), name=m.name)
    if m.tool_call_id:
        return Message(role=m.role, content=f"Result of call {m.tool_call_id}: {m.content}", name=m.name)
    return m


def apply_tools(req: GenerationRequest) -> GenerationRequest:
    """The request as the engine sees it (unchanged without tools or tool messages, and with ``auto``: the
    worker's tool template renders the tools, the calls and their results)."""
    spec = _spec(req)
    if spec is not None and spec["choice"] == "auto":
        return req
    messages = tuple(_as_text(m) for m in req.messages)
    if spec is None:
        return replace(req, messages=messages) if messages != req.messages else req
    note = _described(spec)
    if messages and messages[0].role == "system":
        messages = (replace(messages[0], content=f"{messages[0].content}\n\n{note}"), *messages[1:])
    else:
        messages = (Message(role="system", content=note), *messages)
    sampling = req.sampling
    if spec["choice"] != "none":
        sampling = replace(sampling, json_schema=json.dumps(_call_schema(spec), sort_keys=True,
                                                            separators=(",", ":")))
    return replace(req, messages=messages, sampling=sampling)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(req: GenerationRequest, text: str, *, ids: Iterator[str] | None = None) -> list[dict[str, Any]] | None:
    """The answer as OpenAI's ``tool_calls``; None when the request asked for text, or when a ``required``
    answer is not a whole call (cut by max_tokens: it stays text)."""
    spec = _spec(req)
    if spec is None or spec["choice"] in ("none", "auto"):
        return None
    ids = ids or iter(new_call_id, None)

    def call(name: str, arguments: str) -> dict[str, Any]:
        return {"id": next(ids), "type": "function", "function": {"name": name, "arguments": arguments}}

    if spec["choice"] != "required":
        return [call(spec["choice"], text)]
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = answer if isinstance(answer, list) else [answer]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls]
