"""The streamed chunks' encoding: the faster encoder writes the same JSON as the stdlib's compact form; a token's
chunk byte for byte (only a float's exponent may be spelled differently: 1e-7 for 1e-07)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from goodput_gateway.responses import event as _event
from goodput_gateway.wire import sse as _sse

PAYLOADS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733390000, "model": "m",
     "choices": [{"index": 0, "delta": {"content": " héllo, 世界 \"quoted\" \\ \n\t\u2028"}, "finish_reason": None,
                  "logprobs": None}]},
    {"choices": [{"index": 1, "text": "", "finish_reason": "length",
                  "logprobs": {"tokens": ["a"], "token_logprobs": [-0.25], "top_logprobs": [{"a": -0.25, "b": -9999.0}],
                               "text_offset": [3]}}]},
    {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
     "goodput_timing": {"ttft_ms": 12.345678901234, "stages": [["auth", 0.1], ["queue_wait", 1e-07]]}},
    {"error": {"message": "emoji 🚀 and control \x01", "type": "invalid_request_error", "param": None, "code": None}},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_sse_chunk_is_the_stdlib_compact_json(payload: dict) -> None:
    event = _sse(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == payload
    if "goodput_timing" not in payload:  # no float in exponent form
        assert event == b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def test_responses_event_is_the_stdlib_compact_json() -> None:
    fields = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "ünï \"x\""}
    stdlib = json.dumps({"type": "response.output_text.delta", "sequence_number": 7, **fields},
                        separators=(",", ":"), ensure_ascii=False)
    assert _event("response.output_text.delta", 7, **fields) == \
        f"event: response.output_text.delta\ndata: {stdlib}\n\n".encode()


def test_numbers_the_stdlib_wrote_are_written_too() -> None:
    """A number of a subclass (numpy's, say) and a non-string key: the stdlib's json wrote them, so must this."""
    payload = {"score": np.float64(0.25), "count": np.int64(3), 7: "seven"}
    assert json.loads(_sse(payload)[6:]) == {"score": 0.25, "count": 3, "7": "seven"}
    with pytest.raises(TypeError):
        _sse({"not json": object()})
