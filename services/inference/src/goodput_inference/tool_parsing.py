"""``tool_choice: auto``: the model decides between answering and calling a function, and vLLM's own tool-call
parser for the model's format reads the calls out of its answer. Nothing of a model's tool format is re-implemented
here: the tools are rendered by a chat template (the model's own, or the one configured, as vLLM's
``--chat-template``), and the answer is read by the parser vLLM's OpenAI server would use (``--tool-call-parser``).

One :class:`ToolReader` per answer. It runs the parser's streaming method on every delta only to tell text from a
call: text the parser calls content streams at once; anything else (a call being written, or text that might
become one) is held. At the end the parser reads the whole answer: its calls are returned, and held text that was
not a call after all is released. So a text answer streams as usual, and no text of a call ever reaches the caller.

The dev model (SmolLM2-135M-Instruct) has no tool format of its own; it is served with vLLM's ``pythonic`` parser
(Llama 3.2's format: ``[get_weather(city="Paris")]``) and the bundled ChatML template
``templates/chatml_pythonic_tools.jinja``.

Example (with vLLM installed; the pythonic parser needs no special tokens)::

    reader = ToolReader(ToolReader.parser_class("pythonic"), tokenizer, tools_json)
    reader.feed('[get_weather(city="Paris")]', [])   # -> "" (held: it is a call)
    reader.finish()                                    # -> ("", (ToolCall(id=..., name="get_weather", ...),))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from goodput_core.errors import InvalidArgument

from goodput_inference.engine import ChatTurn, ToolCall

__all__ = ["DEV_TEMPLATE", "DEV_TOOL_PARSER", "ToolReader", "conversation", "parse_tools"]

log = logging.getLogger("goodput.inference.tools")

DEV_TOOL_PARSER = "pythonic"
DEV_TEMPLATE = Path(__file__).parent / "templates" / "chatml_pythonic_tools.jinja"


def conversation(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them (OpenAI's shape; a call's arguments as a mapping, as vLLM's
    server passes them to templates).

    >>> conversation([ChatTurn("assistant", "", tool_calls=(ToolCall("c1", "f", '{"x": 1}'),)),
    ...               ChatTurn("tool", "42", tool_call_id="c1")])  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'c1', 'type': 'function',
      'function': {'name': 'f', 'arguments': {'x': 1}}}]},
     {'role': 'tool', 'content': '42', 'tool_call_id': 'c1'}]
    """
    out: list[dict[str, Any]] = []
    for t in turns:
        message: dict[str, Any] = {"role": t.role, "content": t.content}
        if t.name:
            message["name"] = t.name
        if t.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                     for c in t.tool_calls]
        if t.tool_call_id:
            message["tool_call_id"] = t.tool_call_id
        out.append(message)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def parse_tools(text: str) -> list[dict[str, Any]]:
    """A request's tools (OpenAI's ``tools`` array, as JSON text), checked enough for a template to render."""
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"tools is not JSON: {err}", param="tools", code="invalid_value") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise InvalidArgument('tools must be a list of {"type": "function", "function": {"name": ...}}',
                              param="tools", code="invalid_value")
    return tools


class ToolReader:
    """Reads one answer with a vLLM tool-call parser: :meth:`feed` per delta (returns the text to stream now),
    :meth:`finish` at the end (the rest of the text, and the calls)."""

    @staticmethod
    def parser_class(name: str) -> Any:
        from vllm.tool_parsers import ToolParserManager

        try:
            return ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"unknown tool-call parser {name!r}") from None

    def __init__(self, parser_class: Any, tokenizer: Any, tools: list[dict[str, Any]], *,
                 parallel: bool = True) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self._parser_class = parser_class
        self._tokenizer = tokenizer
        self._request = ChatCompletionRequest(model="goodput", messages=[{"role": "user", "content": ""}],
                                              tools=tools, tool_choice="auto")
        self._streaming = parser_class(tokenizer, self._request.tools)
        self._parallel = parallel
        self.text = ""
        self._ids: list[int] = []
        self._released = ""  # text streamed so far (the parser's content)

    def feed(self, delta: str, token_ids: Sequence[int]) -> str:
        """The part of this delta to stream now ("" while it may be a call)."""
        previous_text, previous_ids = self.text, list(self._ids)
        self.text += delta
        self._ids.extend(token_ids)
        try:
            message = self._streaming.extract_tool_calls_streaming(
                previous_text, self.text, delta, previous_ids, self._ids, list(token_ids), self._request)
        except Exception as err:  # noqa: BLE001 - a parser's streaming bug holds the text; finish() decides
            log.debug("tool parser failed on a delta; holding it", extra={"error": repr(err)})
            return ""
        if message is None or message.tool_calls or not message.content:
            return ""
        if not self.text.startswith(self._released + message.content):
            return ""  # content the parser rewrote: released at the end, from the answer itself
        self._released += message.content
        return message.content

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The text still to stream and the calls the answer made (none: it was text)."""
        parser = self._parser_class(self._tokenizer, self._request.tools)
        try:
            info = parser.extract_tool_calls(self.text, self._request)
        except Exception as err:  # noqa: BLE001 - an answer the parser cannot read is text
            log.warning("tool parser failed on an answer; returning it as text", extra={"error": repr(err)})
            return self._rest(), ()
        if not info.tools_called or not info.tool_calls:
            return self._rest(), ()
        calls = tuple(ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in info.tool_calls)
        return "", calls if self._parallel else calls[:1]

    def _rest(self) -> str:
        return self.text[len(self._released):] if self.text.startswith(self._released) else ""
