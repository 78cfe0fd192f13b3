"""OpenAI's Responses API through the unchanged SDK on the real platform: text and message input, instructions,
streaming as the typed response.* events, retrieval, and a conversation continued with previous_response_id on the
other gateway replica (the stored conversation lives in Redis, not in the replica that answered)."""

from __future__ import annotations

import openai
import pytest

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, KEY_P2

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def sdk(platform: Platform, key: str = KEY_P0, replica: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=platform.gateway_http_at(replica) + "/v1", api_key=key, max_retries=0,
                         timeout=120)


def test_a_response_is_stored_and_continued_on_the_other_replica(platform: Platform) -> None:
    first_replica, second_replica = sdk(platform, replica=0), sdk(platform, replica=1)
    model = first_replica.models.list().data[0].id
    first = first_replica.responses.create(model=model, input="What is the capital of France?",
                                           instructions="Answer in a short sentence.", max_output_tokens=24,
                                           temperature=0)
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    assert "paris" in first.output_text.lower()
    assert first.usage is not None and first.usage.output_tokens > 0
    # retrieved, and continued, through the other replica
    assert second_replica.responses.retrieve(first.id).output_text == first.output_text
    second = second_replica.responses.create(model=model, previous_response_id=first.id, max_output_tokens=24,
                                             temperature=0, input=[{"role": "user", "content": "And of Italy?"}])
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8  # the history


def test_streaming_sends_the_typed_events_in_order(platform: Platform) -> None:
    client = sdk(platform)
    stream = client.responses.create(model=client.models.list().data[0].id, input="Count to five.",
                                     max_output_tokens=16, temperature=0, stream=True)
    kinds, deltas, final = [], [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert len(deltas) > 1 and final is not None and final.output_text == "".join(deltas)
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored when streamed too


def test_responses_are_the_tenants_alone_and_unsupported_fields_are_refused(platform: Platform) -> None:
    client = sdk(platform)
    model = client.models.list().data[0].id
    mine = client.responses.create(model=model, input="Hi", max_output_tokens=4, store=True)
    with pytest.raises(openai.NotFoundError):
        sdk(platform, KEY_P2).responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        sdk(platform, KEY_P2).responses.create(model=model, input="Hi", previous_response_id=mine.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="Hi", tools=[{"type": "web_search"}])
    assert "tools" in str(err.value)
    client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)
