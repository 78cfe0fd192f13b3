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
                               "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    row = data["results"]["300"]
    assert data["embedder"] == embedder
    assert row["semantic"]["p99_ms"] > 0 and row["exact"]["p99_ms"] > 0
    assert row["semantic_l2_hit_share"] > 0  # the stored questions' paraphrases are found
    assert says in out.with_suffix(".md").read_text()
