"""The semantic-cache evaluation: its decision rule (the cache's, including the ambiguity margin) and a run end to
end on a tiny data folder in the shared data's format, GPTCache included."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from loadtests import cache_eval

SIMS = np.array([0.95, 0.94, 0.80, 0.50])  # similarity of one lookup to stored entries 0..3
TOP = np.array([0, 1, 2, 3])


def test_the_best_candidate_is_served_when_nothing_comes_close() -> None:
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.0, None) == 0
    assert cache_eval._decide(SIMS, TOP, 0.96, 0.0, None) is None  # below the threshold


def test_a_runner_up_within_the_margin_makes_a_miss_even_below_the_threshold() -> None:
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.02, None) is None  # 0.94 is within 0.02 of 0.95
    assert cache_eval._decide(SIMS, TOP, 0.945, 0.02, None) is None  # the runner-up may sit under the threshold
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.01, None) == 0  # 0.94 is not within 0.01


def test_the_guard_picks_among_candidates_and_a_vetoed_one_is_no_runner_up() -> None:
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.02, lambda e: e != 1) == 0
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.0, lambda e: e != 0) == 1
    assert cache_eval._decide(SIMS, TOP, 0.90, 0.0, lambda e: e > 1) is None  # 0.80 is below the threshold


def _write(folder: Path, name: str, rows: list[dict[str, object]], gz: bool = False) -> None:
    (folder / name).mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        (folder / name / "pairs.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (folder / name / "pairs.jsonl").write_text(text)


def _tiny_data(data: Path) -> None:
    pairs = [("How do I reset my password?", "How can I reset my password?", 1),
             ("How do I turn on dark mode?", "How do I turn off dark mode?", 0),
             ("Where can I download my invoices?", "Where do I find my invoices?", 1),
             ("What is the refund window?", "How many days do I have to get a refund?", 1)]
    _write(data, "qqp", [{"id": i, "text_a": a, "text_b": b, "label": y} for i, (a, b, y) in enumerate(pairs)],
           gz=True)
    for name in ("paws", "mrpc"):
        _write(data, name, [{"id": i, "sentence1": a, "sentence2": b, "label": y}
                            for i, (a, b, y) in enumerate(pairs)])
    _write(data, "gptcache_mock", [{"id": i, "origin": a, "similar": b} for i, (a, b, y) in enumerate(pairs) if y])


def test_the_evaluation_reports_all_three_rules_against_gptcache(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _tiny_data(data)
    out = tmp_path / "report" / "cache_eval"
    assert cache_eval.main(["--data-dir", str(data), "--out", str(out), "--workdir", str(tmp_path / "work"),
                            "--part", "all"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    qqp = result["results"]["qqp"]["goodput"]
    assert {(r["guard"], r["margin"]) for r in qqp} == {(False, 0.0)} | {(True, m) for m in cache_eval.MARGINS}
    guarded = cache_eval._pick(qqp, 0.90, True)
    assert guarded["wrong_hits"] == 0 and guarded["correct_hits"] >= 1  # on/off is vetoed, the paraphrase found
    assert [r["threshold"] for r in result["results"]["qqp"]["gptcache"]] == cache_eval.GPTCACHE_THRESHOLDS
    assert "What the ambiguity margin buys" in out.with_suffix(".md").read_text()
    assert out.with_name("cache_eval.png").stat().st_size > 0


def test_the_verifier_is_the_fourth_rule(tmp_path: Path, tiny_cross_encoder: Path) -> None:
    data = tmp_path / "data"
    _tiny_data(data)
    out = tmp_path / "report" / "cache_eval"
    assert cache_eval.main(["--data-dir", str(data), "--out", str(out), "--workdir", str(tmp_path / "work"),
                            "--part", "all", "--verifier-model", str(tiny_cross_encoder)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["verifier"]["threshold"] == 0.5
    rows = result["results"]["qqp"]["verifier"]["rows"]
    assert {r["bound"] for r in rows} == set(cache_eval.VERIFY_BOUNDS) and {r["guard"] for r in rows} == {True, False}
    everything = cache_eval._vpick(rows, 0.70, False, 0.3)
    nothing = [r for r in rows if r["bound"] == 0.70 and not r["guard"] and r["threshold"] == 0.98]
    assert everything["hits"] >= nothing[0]["hits"]  # a stricter probability never serves more
    assert "The verifier (the fourth rule)" in out.with_suffix(".md").read_text()
