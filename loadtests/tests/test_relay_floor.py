"""The relay floor end to end in its smoke mode: an upstream on the engine's cadence, a bare grpc.aio relay on a core
of its own (where there are two), every request answered on both paths, the caller's cores given back, and a report
that renders again from its JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from loadtests import relay_floor


def test_smoke_measures_both_paths_and_restores_the_cores(tmp_path: Path) -> None:
    mine = os.sched_getaffinity(0)
    out = tmp_path / "floor"
    assert relay_floor.main(["--smoke", "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == mine

    report = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        (only,) = level["rounds"]
        for path in ("direct", "relay"):
            assert only[path]["requests"] == level["concurrency"] * 2  # every request got its first token
            assert only[path]["messages"] == only[path]["requests"] * 5  # started + 4 tokens, nothing lost
        assert level["ttft_p50_diff_ms"] == only["ttft_p50_diff_ms"]
    if len(mine) > 1:
        assert report["config"]["relay_cores"] == [max(mine)]
        assert max(mine) not in report["config"]["other_cores"]

    markdown = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "bare grpc.aio relay" in markdown and report["machine"]["cpu_model"] in markdown
    assert relay_floor.main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text(encoding="utf-8") == markdown
