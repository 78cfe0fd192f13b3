"""The workload trace format: what the gateway writes, the load tests read back, and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goodput_contracts.trace import TraceRecord, read_trace, relative


def test_a_record_round_trips_and_has_no_field_for_text() -> None:
    r = TraceRecord(arrival_s=10.5, priority="P2", prompt_tokens=100, output_tokens=7, model="m", cached_tokens=None,
                    outcome="stop", ttft_s=None, tenant="abc123", sample=0.5)
    assert TraceRecord.from_json_line(r.to_json_line()) == r
    doc = json.loads(r.to_json_line())
    assert not {"prompt", "messages", "text", "content", "input"} & set(doc)


def test_a_newer_writers_keys_are_ignored_and_a_bad_line_is_named(tmp_path: Path) -> None:
    good = {"v": 2, "arrival_s": 3.0, "priority": "P0", "prompt_tokens": 5, "output_tokens": 1, "gpu": "h100"}
    early = {**good, "arrival_s": 1.0}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(early) + "\n", encoding="utf-8")
    assert [r.arrival_s for r in read_trace(path)] == [1.0, 3.0]
    assert [r.arrival_s for r in relative(read_trace(path))] == [0.0, 2.0]
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "priority": "P9"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: unknown class"):
        read_trace(path)
    path.write_text(json.dumps({"arrival_s": 1.0, "priority": "P0"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="lacks prompt_tokens, output_tokens"):
        read_trace(path)
