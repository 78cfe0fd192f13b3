"""tool_choice auto on the worker: the dev model's tool template and vLLM's own ``pythonic`` parser (no engine
needed: the template is rendered by the model's tokenizer and the parser reads text). The answers themselves, from
the real engine, are in tests/integration/test_tools.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goodput_core.errors import InvalidArgument

from goodput_inference.engine import ChatTurn, ToolCall
from goodput_inference.tool_parsing import DEV_TEMPLATE, DEV_TOOL_PARSER, ToolReader, conversation, parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer() -> object:
    from transformers import AutoTokenizer

    from goodput_inference.devmodel import ensure_dev_model

    return AutoTokenizer.from_pretrained(ensure_dev_model())


def _reader(tokenizer: object, *, parallel: bool = True) -> ToolReader:
    return ToolReader(ToolReader.parser_class(DEV_TOOL_PARSER), tokenizer, TOOLS, parallel=parallel)


def _stream(reader: ToolReader, pieces: list[str]) -> str:
    return "".join(reader.feed(p, []) for p in pieces)


def test_a_call_is_held_back_and_read_whole(tokenizer: object) -> None:
    reader = _reader(tokenizer)
    streamed = _stream(reader, ["[get", "_weather(city=", '"Paris"', ")]"])
    rest, calls = reader.finish()
    assert streamed == "" and rest == ""  # no text of the call reaches the caller
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id


def test_text_streams_as_it_comes(tokenizer: object) -> None:
    reader = _reader(tokenizer)
    streamed = _stream(reader, ["The capital", " of France", " is Paris."])
    assert streamed == "The capital of France is Paris." and reader.finish() == ("", ())


def test_text_that_only_looked_like_a_call_is_released_at_the_end(tokenizer: object) -> None:
    reader = _reader(tokenizer)
    streamed = _stream(reader, ["[1, 2", ", 3] are numbers."])
    assert streamed == "" and reader.finish() == ("[1, 2, 3] are numbers.", ())


def test_parallel_calls_and_the_first_only(tokenizer: object) -> None:
    answer = '[get_weather(city="Paris"), get_weather(city="Rome")]'
    both = _reader(tokenizer)
    _stream(both, [answer])
    assert [json.loads(c.arguments)["city"] for c in both.finish()[1]] == ["Paris", "Rome"]
    first = _reader(tokenizer, parallel=False)
    _stream(first, [answer])
    assert [json.loads(c.arguments)["city"] for c in first.finish()[1]] == ["Paris"]


def test_the_template_renders_tools_calls_and_results(tokenizer: object) -> None:
    turns = (ChatTurn("user", "Weather in Paris?"),
             ChatTurn("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
             ChatTurn("tool", "18 C", tool_call_id="call_1"), ChatTurn("user", "And in Rome?"))
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        conversation(turns), tools=TOOLS, chat_template=DEV_TEMPLATE.read_text(), tokenize=False,
        add_generation_prompt=True)
    assert '"name": "get_weather"' in text  # the functions, in the system message
    assert '[get_weather(city="Paris")]' in text  # the earlier call, in the model's own format
    assert "<|im_start|>tool\n18 C<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_without_tools_the_template_is_the_models_own(tokenizer: object) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, chat_template=Path(DEV_TEMPLATE).read_text(), tokenize=False, add_generation_prompt=True) == own


@pytest.mark.parametrize("tools", ["not json", '{"a": 1}', '[{"type": "function"}]'])
def test_malformed_tools_are_refused(tools: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_tools(tools)
    assert err.value.param == "tools"


def test_an_unknown_parser_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolReader.parser_class("no-such-parser")
