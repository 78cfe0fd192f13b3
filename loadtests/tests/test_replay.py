"""Trace replay: prompts rebuilt to the recorded lengths, cache hits left out, and the smoke runs — a synthetic
trace, and a trace file with recorded latencies (the comparison) — served in full by a simulated fleet. Timings are
not asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from goodput_contracts.trace import TraceRecord

from loadtests import replay
from loadtests.common import free_port_block


def test_sim_prompts_have_the_recorded_length_and_share_the_cached_prefix() -> None:
    prompts = replay.SimPrompts()
    a = TraceRecord(arrival_s=0, priority="P0", prompt_tokens=300, output_tokens=5, cached_tokens=128, tenant="x")
    b = TraceRecord(arrival_s=1, priority="P0", prompt_tokens=200, output_tokens=5, cached_tokens=128, tenant="x")
    pa, pb = prompts(a, 0), prompts(b, 1)
    assert math.ceil(len(pa) / 4) == 300 and math.ceil(len(pb) / 4) == 200  # the simulated engine's count
    assert pa[:512] == pb[:512] and pa[:600] != pb[:600]  # 128 cached tokens shared, the rest unique
    other = prompts(TraceRecord(arrival_s=2, priority="P0", prompt_tokens=300, output_tokens=5, cached_tokens=128,
                                tenant="y"), 2)
    assert other[:512] != pa[:512]


def test_cache_hits_are_left_out_and_arrivals_counted_from_the_first() -> None:
    recs = [TraceRecord(arrival_s=100.0 + i, priority="P1", prompt_tokens=10, output_tokens=3,
                        outcome="cache_hit" if i == 1 else "stop") for i in range(3)]
    todo, skipped = replay.prepare(recs)
    assert [r.arrival_s for r in todo] == [0.0, 2.0] and skipped["cache_hit"] == 1


@pytest.mark.integration
def test_the_smoke_run_and_a_recorded_trace_replay_on_a_simulated_fleet(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    assert replay.main(["--smoke", "--out", str(out), "--base-port", str(free_port_block())]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["outcomes"] == {"ok": 30} and report["replayed"]["all"]["ttft"]["p99_ms"]
    assert report["replayed"]["all"]["output_tokens"] == report["output_tokens_asked"]
    # a trace with the latencies it was served with: the replay is compared with them
    trace = tmp_path / "trace.jsonl"
    recs = replay.synthetic_trace(12, rate=8.0, seed=5, prompt_tokens=(16, 256), output_tokens=(4, 16))
    trace.write_text("".join(TraceRecord(**{**r.__dict__, "arrival_s": 1.7e9 + r.arrival_s, "ttft_s": 0.05,
                                            "tpot_s": 0.015, "e2e_s": 0.05 + 0.015 * r.output_tokens,
                                            "sample": 0.5}).to_json_line() + "\n" for r in recs), encoding="utf-8")
    out = tmp_path / "trace"
    assert replay.main(["--trace", str(trace), "--out", str(out), "--base-port", str(free_port_block())]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["outcomes"] == {"ok": 12} and report["trace_sample"] == 0.5
    assert {c["metric"] for c in report["comparison"]} >= {"TTFT p50", "TPOT p99", "throughput (output tokens/s)"}
    assert all(c["rel_error"] is not None for c in report["comparison"])
    markdown = out.with_suffix(".md").read_text()
    assert "Replayed versus recorded" in markdown and "×2 speed approximates" in markdown
