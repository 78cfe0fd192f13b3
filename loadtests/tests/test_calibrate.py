"""Simulator calibration: the fit recovers an engine's constants from trace lines shaped like the probes', and the
smoke run (the committed traces of the last full run, a few workload requests on one simulated worker) reports the
error per metric. The full run needs vLLM and minutes; it is not a test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goodput_contracts.trace import TraceRecord

from loadtests import calibrate
from loadtests.common import free_port_block

REPORT = Path(__file__).resolve().parents[1] / "reports" / "calibration.json"


def test_the_fit_recovers_prefill_and_step_times() -> None:
    probes = []
    for i, n in enumerate((32, 128, 512, 1024, 1536)):  # one at a time: TTFT = 40 ms + 0.5 ms per token
        probes.append(TraceRecord(arrival_s=100.0 + 10 * i, priority="P0", prompt_tokens=n + 16, cached_tokens=16,
                                  output_tokens=2, ttft_s=0.040 + 0.0005 * n, e2e_s=0.1 + 0.0005 * n))
    for j, k in enumerate((1, 2, 4, 8, 16)):  # k streams together: TPOT = 20 ms + 3 ms per sequence
        tpot = 0.020 + 0.003 * k
        probes += [TraceRecord(arrival_s=200.0 + 100 * j, priority="P0", prompt_tokens=64, output_tokens=64,
                               ttft_s=0.1, tpot_s=tpot, e2e_s=0.1 + 63 * tpot) for _ in range(k)]
    fit = calibrate.fit_params(probes, prefill_window=(100.0, 150.0), decode_window=(200.0, 700.0),
                               max_batched_tokens=4096)
    p = fit["sim_params"]
    assert p["step_base_s"] == pytest.approx(0.020) and p["step_per_seq_s"] == pytest.approx(0.003)
    assert p["max_batched_tokens"] == 4096
    # the idle TTFT's line is 40 ms + 0.5 ms/token, the simulator's must start at its step (23 ms): its slope is a
    # little steeper, so the short prompts are a little under, the long ones a little over
    assert fit["prefill_fit"]["slope"] == pytest.approx(0.0005) and fit["ttft_intercept_s"] == pytest.approx(0.040)
    assert 0.0005 < p["prefill_s_per_token"] < 0.0006
    errors = [r["rel_error"] for r in fit["idle_ttft"]]
    assert errors[0] < 0 < errors[-1] and max(map(abs, errors)) < 0.3


@pytest.mark.integration
def test_the_smoke_run_fits_the_committed_traces_and_reports_the_error(tmp_path: Path) -> None:
    out = tmp_path / "calibration"
    argv = ["--smoke", "--from-report", str(REPORT), "--out", str(out), "--base-port", str(free_port_block())]
    assert calibrate.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["smoke"] and report["calibrated"]["outcomes"] == {"ok": report["workload"]["requests"]}
    metrics = {c["metric"]: c for c in report["calibrated"]["comparison"]}
    assert {"TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "throughput (output tokens/s)"} <= set(metrics)
    assert all(metrics[m]["rel_error"] is not None for m in ("TTFT p50", "TPOT p50"))
    assert report["fit"]["sim_params"]["prefill_s_per_token"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert "smoke run" in markdown and "not for an A100" in markdown
