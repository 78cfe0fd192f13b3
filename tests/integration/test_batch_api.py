"""OpenAI's Batch API through the unchanged SDK on the real platform: a JSONL file uploaded, a batch of several
chat requests run at P2 by the jobs worker on the real vLLM CPU engine, its output file downloaded with one answer
per custom_id; files and batches are the tenant's alone."""

from __future__ import annotations

import json

import openai
import pytest

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, KEY_P2

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

QUESTIONS = {"france": "What is the capital of France?", "colours": "Name two colours.", "count": "Count to three."}


def sdk(platform: Platform, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_batch_completes_with_its_output_file(platform: Platform) -> None:
    client = sdk(platform, KEY_P2)
    model = client.models.list().data[0].id
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                       "temperature": 0}} for cid, q in QUESTIONS.items()]
    uploaded = client.files.create(file=("questions.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                   purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "integration"})
    assert batch.request_counts is not None and batch.request_counts.total == len(QUESTIONS)
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired")
                      and b, timeout=300, interval=1.0, message="the batch did not complete")
    assert done.status == "completed", done
    assert done.request_counts is not None and done.request_counts.completed == len(QUESTIONS)
    assert done.output_file_id and done.error_file_id is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(QUESTIONS)
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
    assert "paris" in answers["france"].lower()
    assert batch.id in [b.id for b in client.batches.list()]
    # another tenant sees neither the batch nor its files
    other = sdk(platform, KEY_P0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


@pytest.mark.parametrize("body,why", [
    ({"messages": []}, "line 2"),
    # poison: text no encoder takes (a lone surrogate, as JSON can spell it) is refused with the batch, never run
    # and retried as a job
    ({"messages": [{"role": "user", "content": "caf\ud800"}]}, "line 2 of the input file: body.messages[0].content"),
])
def test_a_bad_line_is_refused_by_number(platform: Platform, body: dict[str, object], why: str) -> None:
    client = sdk(platform, KEY_P2)
    good = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]}}
    bad = {**good, "custom_id": "y", "body": body}
    uploaded = client.files.create(file=("bad.jsonl", (json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode()),
                                   purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert why in str(err.value)
    client.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
