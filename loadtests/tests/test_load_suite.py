"""The load suite's smoke runs (stair-step concurrency, long context, multi-turn, shared prefix): each starts a small
simulated fleet (real worker and scheduler processes), serves its requests and writes its report (JSON, Markdown,
PNG). They assert that the report was produced and requests were served, never timings: a benchmark does not fail
on a missed goal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import long_context, multiturn, shared_prefix, stairstep
from loadtests.common import free_port_block

pytestmark = pytest.mark.integration



def _run(module: Any, name: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    out = tmp_path / name
    assert module.main(["--smoke", "--out", str(out), "--base-port", str(free_port_block())]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    markdown = out.with_suffix(".md").read_text()
    assert report["engine"]["engine"] == "sim" and "Simulated fleet" in markdown and "P0 SLO" in markdown
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0
    return report, markdown


def test_stairstep_serves_every_step_and_names_the_knee(tmp_path: Path) -> None:
    report, markdown = _run(stairstep, "stairstep", tmp_path)
    assert [st["concurrency"] for st in report["steps"]] == [1, 4]
    assert all(st["served"] > 0 for st in report["steps"])
    assert "knee" in report and "**Knee**" in markdown


def test_long_context_serves_every_length_in_both_arms(tmp_path: Path) -> None:
    report, markdown = _run(long_context, "long_context", tmp_path)
    arms = set(report["arms"])  # chunked-N for each chunk budget, and unchunked
    assert "unchunked" in arms and any(a.startswith("chunked-") for a in arms)
    for arm in report["arms"].values():
        assert all(row["unloaded_ttft"]["n"] and row["loaded_ttft"]["n"] for row in arm["lengths"])
        assert arm["background_requests"] > 0
    assert "TTFT growth" in markdown or "unloaded TTFT" in markdown


def test_multiturn_serves_every_turn_in_each_arm(tmp_path: Path) -> None:
    report, markdown = _run(multiturn, "multiturn", tmp_path)
    for arm in report["arms"].values():
        assert arm["all"]["served"] == report["setup"]["requests"]
        assert [row["turn"] for row in arm["turns"]] == [1, 2, 3, 4, 5]
    assert "TTFT per turn" in markdown


def test_shared_prefix_serves_both_arms(tmp_path: Path) -> None:
    report, markdown = _run(shared_prefix, "shared_prefix", tmp_path)
    assert set(report["arms"]) == {"shared", "unique"}
    assert all(lv["served"] > 0 for a in report["arms"].values() for lv in a["levels"])
    assert "shared" in markdown and "unique" in markdown
