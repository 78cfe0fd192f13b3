"""The pools benchmark's smoke run: both fleets start (workers declaring their pools), the same arrivals are served
by each, and the report names both numbers and the goal."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests import pools
from loadtests.common import free_port_block


def test_the_smoke_run_serves_both_fleets_and_reports_both_numbers(tmp_path: Path) -> None:
    out = tmp_path / "pools"
    base = free_port_block()
    assert pools.main(["--smoke", "--out", str(out), "--base-port", str(base)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    for name in ("shared", "pools"):
        conf = report["configs"][name]
        assert conf["P0"]["success_rate"] == 1.0 and conf["P2"]["success_rate"] == 1.0
        assert conf["P0"]["ttft"]["p99_ms"] and conf["P2"]["output_tokens_per_s"]
    # with pools each class ran on its own pool's worker only (the first interactive, the second batch)
    assert set(report["configs"]["pools"]["P0"]["workers"]) == {f"127.0.0.1:{base + 1}"}
    assert set(report["configs"]["pools"]["P2"]["workers"]) == {f"127.0.0.1:{base + 2}"}
    markdown = out.with_suffix(".md").read_text()
    assert "P0 TTFT p99" in markdown and "P2 output tokens/s" in markdown and "Goal" in markdown
