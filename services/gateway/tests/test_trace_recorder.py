"""The workload trace (TRACE_PATH): a sample of finished answers, one JSON line each, with token counts and
latencies but no prompt text and no tenant name, bounded on disk. The recorder alone: sampling, the bound."""

from __future__ import annotations

import random
from pathlib import Path

from prometheus_client import CollectorRegistry

from goodput_contracts.trace import TraceRecord, read_trace

from goodput_gateway.config import GatewaySettings
from goodput_gateway.trace_recorder import TraceRecorder


def _record(i: int = 0) -> TraceRecord:
    return TraceRecord(arrival_s=1000.0 + i, priority="P1", prompt_tokens=100, output_tokens=20, model="m")


def test_a_fraction_of_answers_is_sampled(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", sample=0.25, max_bytes=1 << 20, rng=random.Random(7))
    kept = sum(recorder.offer(lambda _t, i=i: _record(i), tenant="a") for i in range(2000))  # type: ignore[misc]
    recorder.close()
    assert 400 < kept < 600  # 25% of 2000, give or take the draw
    assert len(read_trace(tmp_path / "t.jsonl")) == kept
    assert TraceRecorder.from_settings(GatewaySettings(trace_path="")) is None
    assert TraceRecorder.from_settings(GatewaySettings(trace_path=str(tmp_path / "x"), trace_sample=0)) is None


def test_the_file_is_bounded_one_previous_file_kept(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder(path, sample=1.0, max_bytes=2048, registry=registry)
    line = len(_record().to_json_line()) + 1
    for i in range(100):
        recorder.offer(lambda _t, i=i: _record(i), tenant="a")  # type: ignore[misc]
    recorder.close()
    assert path.stat().st_size <= 2048 and (tmp_path / "t.jsonl.1").stat().st_size <= 2048
    assert not (tmp_path / "t.jsonl.2").exists()
    kept, previous = read_trace(path), read_trace(tmp_path / "t.jsonl.1")
    assert kept[-1].arrival_s == 1099.0  # the newest are in the current file, the ones just before in .1
    assert previous[-1].arrival_s == kept[0].arrival_s - 1 and len(previous) == 2048 // line
    value = registry.get_sample_value
    assert value("goodput_gateway_trace_records_total", {"result": "written"}) == 100
    assert value("goodput_gateway_trace_records_total", {"result": "rotated"}) >= 2
