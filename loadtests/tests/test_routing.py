"""The routing benchmark's smoke run: both parts' fleets start (workers of two speeds, then two models with their
prices and windows), the same arrivals are served by each configuration, ``auto`` never sends a request to a model
whose window it does not fit, and the report names its numbers. Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import routing
from loadtests.common import free_port_block, pyplot


@pytest.mark.integration
def test_the_smoke_run_serves_every_configuration_and_reports_cost_slo_and_prediction_error(tmp_path: Path) -> None:
    out = tmp_path / "routing"
    assert routing.main(["--smoke", "--out", str(out), "--base-port", str(free_port_block())]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    placement, auto = report["placement"], report["auto"]
    for conf in placement["configs"].values():
        assert conf["success_rate"] == 1.0 and conf["ttft"]["p99_ms"] and conf["output_tokens_per_s"]
        assert set(conf["share_by_kind"]) == {"fast", "slow"}
        # the scheduler learned both workers' speeds from the warm-up's finished leases
        assert all(s["samples"] > 0 for s in conf["speed_after_warmup"].values())
    for conf in auto["configs"].values():
        assert conf["ok"] == conf["n"] and conf["cost"]["batch_share"] > 0
        assert set(conf["classes"]) == {"P0", "P2"}
    assert auto["configs"]["large"]["share_by_model"]["large"] == 1.0
    # a prompt beyond the small model's window is routed to the large one
    assert set(auto["configs"]["auto"]["by_shape"]["long_doc"]) == {"large"}
    assert auto["configs"]["auto"]["prediction"]
    markdown = out.with_suffix(".md").read_text()
    assert "Simulated engine" in markdown and "batch-share cost" in markdown and "predictor's error" in markdown
    assert out.with_suffix(".png").exists() or pyplot() is None  # the plot needs matplotlib
