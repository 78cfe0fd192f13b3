"""The retrieval evaluation end to end on a tiny SciFact-shaped folder: every fusion through Retriever.search, and
rerank rows over each fusion with a real (tiny) cross-encoder, scored on the chosen part of the queries."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from loadtests import retrieval_eval

TOPICS = ["insulin resistance and type 2 diabetes", "statins lower cholesterol", "vitamin D and bone density",
          "smoking raises lung cancer risk", "exercise improves heart health", "sleep loss impairs memory"]


def _scifact(root: Path) -> None:
    (root / "scifact").mkdir(parents=True)
    corpus = [{"_id": str(i), "title": f"A study of {t}", "text": f"We report that {t}. " * 3, "metadata": {}}
              for i, t in enumerate(TOPICS)]
    (root / "scifact" / "corpus.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(d) + "\n" for d in corpus).encode()))
    queries = [{"_id": str(100 + i), "text": f"{TOPICS[i % len(TOPICS)]}?", "metadata": {}} for i in range(12)]
    (root / "scifact" / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "scifact" / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{100 + i}\t{i % len(TOPICS)}\t1\n" for i in range(12)))


def test_rerank_rows_beside_each_fusion(tmp_path: Path, tiny_cross_encoder: Path) -> None:
    _scifact(tmp_path / "data")
    out = tmp_path / "retrieval_eval"
    retrieval_eval.main(["--data-dir", str(tmp_path / "data"), "--out", str(out), "--split", "all",
                         "--reranker-model", str(tiny_cross_encoder), "--cache-dir", str(tmp_path / "cache"),
                         "--rerank-candidates", "4"])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["queries"] == 12 and data["split"] == "all"
    methods = {r["method"] for r in data["results"]}
    assert {"hybrid RRF k=60 + rerank", "hybrid weighted w_dense=0.5 + rerank", "BM25 alone + rerank"} <= methods
    rerank = next(r for r in data["results"] if r["method"] == "hybrid RRF k=60 + rerank")
    assert rerank["rerank_skipped"] == 0 and rerank["latency"]["rerank"]["p95_ms"] > 0
    assert 0 <= rerank["ndcg@10"] <= 1
    text = out.with_suffix(".md").read_text()
    assert "## Rerank" in text and "≤ 120 ms" in text


def test_without_a_model_the_report_says_how_to_make_one(tmp_path: Path) -> None:
    _scifact(tmp_path / "data")
    out = tmp_path / "retrieval_eval"
    retrieval_eval.main(["--data-dir", str(tmp_path / "data"), "--out", str(out), "--split", "all",
                         "--cache-dir", str(tmp_path / "cache"), "--rrf-k", "--dense-weight"])
    assert "goodput train reranker" in out.with_suffix(".md").read_text()
