"""The setting-against-setting runner of the overhead benchmark, end to end on the simulated engine: two variants,
one run each, the second's setting reaching its platform (every request a Generate call, none on the worker
streams), its client's gRPC streams on two connections and, where there are two cores, its gateway placed on a core
of its own; the comparison names both with each
one's numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loadtests import overhead_ab

# no other test or benchmark uses it (see test_overhead_smoke.py's list; chaos: 4700)
PORT_OFFSET = 4800


@pytest.mark.integration
def test_two_variants_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    usable = sorted(os.sched_getaffinity(0))
    own_core = f",gateway-cores={usable[-1]}" if len(usable) > 1 else ""
    calls = f"early:GOODPUT_GATEWAY_SPECULATIVE_START=true,grpc-channels=2{own_core}"
    assert overhead_ab.main(["--variant", "default", "--variant", calls,
                             "--rounds", "1", "--concurrency", "2", "--requests-per-level", "4", "--max-tokens", "4",
                             "--port-offset", str(PORT_OFFSET), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert [v["name"] for v in report["variants"]] == ["default", "early"]
    assert [r["variant"] for r in report["runs"]] == ["default", "early"]
    (level,) = report["levels"]
    for name in ("default", "early"):
        cpu = level["variants"][name]["gateway CPU ms/request"]
        assert cpu is not None and cpu["n"] == 1 and cpu["median"] > 0
    assert level["variants"]["early"]["gRPC ΔTTFT p50 ms"]["vs_baseline"] is not None
    runs = {r["variant"]: json.loads(Path(r["report"]).read_text(encoding="utf-8"))
            for r in report["runs"]}
    assert sum(runs["early"]["levels"][0]["speculative_starts"].values()) > 0  # the setting held
    assert runs["early"]["config"]["gateway_cores"] == ([usable[-1]] if own_core else None)
    assert runs["default"]["config"]["gateway_cores"] is None
    assert runs["early"]["config"]["grpc_channels"] == 2 and runs["default"]["config"]["grpc_channels"] == 1
    assert sorted(os.sched_getaffinity(0)) == usable  # the benchmark gave this process its cores back
    assert not any(runs["default"]["levels"][0]["speculative_starts"].values())  # off by default
    assert not list((tmp_path / "ab-runs").glob("*-platform"))  # the runs' scratch folders are gone
    md = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "default (the baseline), early" in md and "`GOODPUT_GATEWAY_SPECULATIVE_START=true`" in md
    assert "`--grpc-channels 2`" in md
    assert "## 2 streams" in md
    # the comparison re-renders from its JSON alone
    out.with_suffix(".md").unlink()
    assert overhead_ab.main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text(encoding="utf-8") == md
