"""A report is its JSON: every committed report of a benchmark on the skeleton (``loadtests.bench``) renders again
through the benchmark's template, and every number its Markdown showed is still there, at least as precisely (the
prose may change; the numbers may not go missing). Rendering starts no service: these tests take a second."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from loadtests import bench

REPORTS = Path(__file__).resolve().parents[1] / "reports"
# the reports of the gateway's third restructuring ("house3"), each against the reference report of the same benchmark
HOUSE3 = [("prefix", "prefix-house3"), ("overload", "overload-house3"), ("overhead", "overhead-sim-house3")]
LOADTESTS = REPORTS.parent
# (benchmark module, committed report): every committed report of every benchmark on the skeleton (its ``reports``)
COMMITTED = [(path.stem, name) for path in sorted(LOADTESTS.glob("*.py"))
             if re.search(r"^BENCHMARK = ", path.read_text(encoding="utf-8"), re.MULTILINE)
             for name in importlib.import_module(f"loadtests.{path.stem}").BENCHMARK.reports]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def generated(md: str) -> str:
    """A report's generated part: without the sections added by hand after the run."""
    hand = bench.HAND_WRITTEN.search(md)
    return md if hand is None else md[:hand.start()]


def numbers(md: str, *, tables: bool = False) -> list[str]:
    """The numbers in a report's generated part (with ``tables``, in its tables only)."""
    return [n for line in generated(md).splitlines() if not tables or line.startswith("|")
            for n in NUMBER.findall(line)]


def shown(number: str, numbers: set[str]) -> bool:
    """``number`` is among ``numbers``, given with as many decimals or more (46.7 is shown by 46.71).

    >>> shown("46.7", {"46.71"}), shown("126.5", {"126.46"}), shown("231", {"230.86"}), shown("46.71", {"46.7"})
    (True, True, True, False)
    """
    decimals = len(number.partition(".")[2])
    return any(len(n.partition(".")[2]) >= decimals and abs(round(float(n), decimals) - float(number)) < 1e-9
               for n in numbers)


def rendered(module: str, name: str) -> tuple[bench.Benchmark, dict[str, Any], str]:
    benchmark = importlib.import_module(f"loadtests.{module}").BENCHMARK
    report = json.loads((REPORTS / f"{name}.json").read_text(encoding="utf-8"))
    return benchmark, report, bench.markdown(benchmark, report)


@pytest.mark.parametrize(("module", "name"), COMMITTED)
def test_a_committed_report_renders_from_its_json_with_every_number_it_showed(module: str, name: str) -> None:
    _, _, after = rendered(module, name)
    before = (REPORTS / f"{name}.md").read_text(encoding="utf-8")
    now = set(numbers(after))
    lost = sorted({n for n in numbers(before) if not shown(n, now)}, key=float)
    assert not lost, f"{name}.md showed {lost}, not in the report rendered again from {name}.json"
    assert len(numbers(after, tables=True)) >= len(numbers(before, tables=True)) // 2  # the tables themselves


@pytest.mark.parametrize(("module", "name"), HOUSE3)
def test_the_house3_reports_judge_every_goal_from_their_json(module: str, name: str) -> None:
    benchmark, report, md = rendered(module, name)
    goals = benchmark.evaluate(report)
    assert goals and all(g["met"] is not None for g in goals)  # every field a goal reads is in the JSON
    if module != "overhead":  # overhead's goals are its verdict, with the intervals the goals table has no room for
        for g in goals:
            cells = [g["name"], *(bench.fmt_goal(g, k) for k in ("value", "baseline", "judged", "threshold"))]
            assert "| " + " | ".join(cells) + f" | {'yes' if g['met'] else '**no**'} |" in md


@pytest.mark.parametrize("name", ["overhead", "overhead-sim-mtls", "overhead-sim"])
def test_an_overhead_report_is_held_to_its_own_goal_not_todays(name: str) -> None:
    benchmark, report, md = rendered("overhead", name)
    ttft, itl = report["goal"]["ttft_p50_diff_ms"], report["goal"]["itl_p50_diff_ms"]
    assert f"adds at most **{ttft:g} ms** to TTFT p50 and at most **{itl:g} ms** to ITL p50" in md
    assert {g["threshold"] for g in benchmark.evaluate(report)} == {ttft, itl}


def test_the_house3_reports_show_their_goals_and_key_rows() -> None:
    """The numbers the house3 commits quote, as their reports show them."""
    expected = {
        "prefix-house3": [
            "| shared prefixes: mean TTFT ≥ 40% lower than round-robin | 104 ms | 181 ms | -42.7% | ≤ -40.0% | yes |",
            "| no reuse: mean TTFT ≤ 3% worse than round-robin | 312 ms | 312 ms | -0.0% | ≤ +3.0% | yes |",
            "| shared | prefix_aware | 600 | 0 | 104 | 34 | 294 | 428 | 587 | least_loaded 112, prefill_gate 65, "
            "prefix_affinity 423 |"],
        "overload-house3": [
            "| P0 p99 TTFT at 3x ≤ 1.5x unloaded p99 | 212 ms | 179 ms | 1.18× | ≤ 1.50× | yes |",
            "| P0 p99 TTFT ≥ 10x better than FIFO at 3x | 212 ms | 19859 ms | 93.64× | ≥ 10.00× | yes |",
            "| 3x (14.2/s) | P0 | 108 | 100.0% | 0.0% | 0.0% | 166 | 199 | 212 | 3278 | 4755 | 5022 | 1 | 3.60 | — |",
            "| goodput | 3x | 0.62 | 11 / 17 / 27 | 13.0 / 16 | 1 / 2 / 2 | least_loaded 54, least_prefill 32, "
            "prefill_gate 16, prefix_affinity 6 |"],
        "overhead-sim-house3": [
            "- **1 stream** — gateway gRPC: TTFT p50 +3.27 ms (**FAIL**), ITL p50 +0.03 ms (PASS)",
            "- **128 streams** — gateway gRPC: TTFT p50 +14.99 ms (**FAIL**), ITL p50 +0.07 ms (PASS); gateway REST "
            "(SSE): TTFT p50 +10.05 ms (**FAIL**)",
            "| 128 | gateway gRPC | TTFT | +14.99 | +12.87 … +16.83 | +108.50 | +162.08 | 1.130× | 1.746× | ≤ 2 | "
            "**FAIL** |",
            "| 128 | 5.91 | 0.79 | 6.70 | — |",
            "SPECULATIVE_START, opt-in: off in this run"],  # the run's JSON: no speculative start, the default
    }
    for module, name in HOUSE3:
        md = rendered(module, name)[2]
        for text in expected[name]:
            assert text in md, f"{name}: {text!r}"


def test_render_writes_the_markdown_and_plot_again_keeps_the_notes_and_leaves_the_json(tmp_path: Path,
                                                                                     capsys: pytest.CaptureFixture[str]
                                                                                     ) -> None:
    from loadtests import overload

    for suffix in (".json", ".md"):
        shutil.copy(REPORTS / f"overload{suffix}", tmp_path / f"overload{suffix}")
    saved = (tmp_path / "overload.json").read_bytes()
    assert overload.main(["--render", str(tmp_path / "overload.json")]) == 0
    assert (tmp_path / "overload.json").read_bytes() == saved
    md = (tmp_path / "overload.md").read_text(encoding="utf-8")
    assert md.startswith("# Overload benchmark") and "## Goals" in md
    assert md.count("## Run notes (read before the numbers)") == 1  # written by hand after the run: kept, once
    assert md.index("## Reading it") < md.index("## Run notes")
    assert (tmp_path / "overload.png").stat().st_size > 0
    # each goal printed: measured, the same run's baseline and their ratio, against the threshold
    assert "MET  P0 p99 TTFT at 3x ≤ 1.5x unloaded p99: 231 ms against 181 ms in the same run (ratio 1.280)" in (
        capsys.readouterr().out)


def test_quick_sets_only_what_the_command_line_left_at_its_default() -> None:
    from loadtests import overhead, prefix

    args = bench.parse(prefix.BENCHMARK, ["--quick", "--workers", "3"])
    assert (args.workers, args.requests, args.systems) == (3, 120, 24)
    args = bench.parse(overhead.BENCHMARK, ["--smoke", "--start", "--concurrency", "4"])
    assert (args.concurrency, args.requests_per_level, args.max_tokens) == ([4], 4, 8)
    assert bench.parse(overhead.BENCHMARK, ["--start"]).concurrency == [1, 8, 32, 128]
