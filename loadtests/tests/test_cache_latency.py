"""The cache latency benchmark end to end at a tiny size: both places the question can be embedded (in-process, and
an Embedding service the benchmark starts as its own process), against the local Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import cache_latency


@pytest.mark.parametrize("embedder, says", [("local", "in-process"), ("service", "Embedding service over gRPC")])
def test_the_benchmark_times_lookups_and_says_where_it_embedded(tmp_path: Path, embedder: str, says: str) -> None:
    out = tmp_path / "latency"
    assert cache_latency.main(["--sizes", "300", "--lookups", "20", "--real", "20", "--embedder", embedder,
                               "--verifier-model", "none", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    row = data["results"]["300"]
    assert data["embedder"] == embedder
    assert row["semantic"]["p99_ms"] > 0 and row["exact"]["p99_ms"] > 0
    assert row["semantic_l2_hit_share"] > 0  # the stored questions' paraphrases are found
    assert says in out.with_suffix(".md").read_text()


def test_lookups_are_also_timed_with_the_verifier(tmp_path: Path, tiny_cross_encoder: Path) -> None:
    out = tmp_path / "latency"
    assert cache_latency.main(["--sizes", "300", "--lookups", "10", "--real", "10", "--verifier-model",
                               str(tiny_cross_encoder), "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["verifier"]["threshold"] == 0.5
    assert data["results"]["300"]["semantic_verified"]["p99_ms"] > 0
    assert "## With the verifier" in out.with_suffix(".md").read_text()


def test_qqp_questions_are_the_labelled_duplicates(tmp_path: Path) -> None:
    import gzip

    rows = [{"id": 1, "text_a": "How do I learn Python?", "text_b": "What is the best way to learn Python?",
             "label": 1},
            {"id": 2, "text_a": "Is tea healthy?", "text_b": "Is coffee healthy?", "label": 0},
            {"id": 3, "text_a": "Why is the sky blue?", "text_b": "What makes the sky blue?", "label": 1}]
    (tmp_path / "qqp").mkdir()
    (tmp_path / "qqp" / "pairs.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n"
                                                                           for r in rows).encode()))
    assert cache_latency._pairs(tmp_path, 10, "qqp") == [(rows[0]["text_a"], rows[0]["text_b"]),
                                                         (rows[2]["text_a"], rows[2]["text_b"])]
    assert cache_latency._pairs(tmp_path / "absent", 2, "qqp") == cache_latency.FALLBACK_PAIRS[:2]
