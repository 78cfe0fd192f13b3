"""Cache lookup latency at 1k, 10k and 100k entries: exact (L1) and semantic (L2) p50/p99, in-process.

    python -m loadtests.cache_latency [--sizes 1000 10000 100000] [--lookups 1000] [--redis-url redis://...]
        [--questions mock | qqp]
        [--embedder local | --embedder service [--embedder-addr HOST:PORT]]

What is timed is ``ResponseCache.lookup`` as the gRPC servicer calls it (validation, key derivation, Redis round
trips, and for L2 the embedding of the question, the partition search and the guard); the gRPC hop itself is
measured by the gateway's ``cache`` stage. All entries sit in ONE partition (one tenant, model and system prompt):
the worst case for the semantic search, which searches only the request's partition (an HNSW graph from
``GOODPUT_CACHE_ANN_MIN_ENTRIES`` entries on; the benchmark waits until the graph holds every entry, as in a
service that has been running). Filler entries are written to Redis directly (no embedding) with random unit
vectors in the L2 index; the looked-up entries are real pairs stored through ``ResponseCache.store`` and looked up
by their paraphrase: ``--questions mock`` (default; GPTCache's mock pairs, long answer-like statements: the worst
case for the embedding) or ``--questions qqp`` (Quora duplicate questions, as users type them). Everything is
written under a fresh key prefix and deleted afterwards.

Where the question is embedded: ``--embedder local`` (default) runs the model in the benchmark's process, as the
cache does by default; ``--embedder service`` goes to the Embedding service over gRPC, as the cache does with
``GOODPUT_CACHE_EMBEDDER_ADDR``: the one at ``--embedder-addr`` (for instance on a GPU), or else one started here
as a separate process on a free port with ``--embed-threads`` threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtests import bench
from loadtests.common import free_port_block, machine_info, summarize

ROOT = Path(__file__).resolve().parent.parent
GOALS_MS = {"exact_p99": 5.0, "semantic_p99": 20.0}
FALLBACK_PAIRS = [("How do I reset my password?", "How can I reset my password?"),
                  ("Where can I download my invoice?", "Where do I download my invoices?"),
                  ("How do I cancel my subscription?", "How can I cancel my subscription?")]


# Which questions are stored and looked up (--questions): the embedding's time, and so the semantic p99, follows
# their length.
QUESTION_SETS = {
    "mock": "GPTCache's mock pairs: answer-like statements and their paraphrases, up to 150+ tokens",
    "qqp": "Quora duplicate-question pairs: questions as users type them, mostly under 32 tokens",
}


def _pairs(data_dir: Path, n: int, questions: str = "mock") -> list[tuple[str, str]]:
    """``n`` (stored, looked-up) pairs of the chosen set; a few support questions when the data folder is absent."""
    if questions == "qqp":
        path = data_dir / "qqp" / "pairs.jsonl.gz"
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            pairs = {r["text_a"]: r["text_b"] for r in rows if int(r["label"]) == 1}  # one pair per stored question
            return list(pairs.items())[:n]
    else:
        path = data_dir / "gptcache_mock" / "pairs.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return [(r["origin"], r["similar"]) for r in rows[:n]]
    return (FALLBACK_PAIRS * (n // len(FALLBACK_PAIRS) + 1))[:n]


@contextlib.asynccontextmanager
async def _vectoriser(args: argparse.Namespace) -> AsyncIterator[Any]:
    """The cache's model in-process, or the Embedding service (given, or started here and stopped afterwards)."""
    from goodput_core.clients import make_channel

    from goodput_cache.embedding import LocalVectoriser, RemoteVectoriser

    if args.embedder == "local":
        yield LocalVectoriser(threads=args.embed_threads, spin=args.embed_spin)
        return
    proc = None
    log = tempfile.TemporaryFile()
    addr = args.embedder_addr
    if not addr:
        # Below the ephemeral range: a port the kernel handed out for port 0 can be taken by any outgoing connection
        # before the service binds it, and the service then cannot start.
        port = free_port_block(2)
        addr = f"127.0.0.1:{port}"
        # Plaintext, said explicitly: the benchmark's client dials the embedder without a certificate.
        env = {**os.environ, "GOODPUT_INSECURE_INTERNAL": "true", "GOODPUT_EMBEDDER_GRPC_PORT": str(port),
               "GOODPUT_EMBEDDER_HTTP_PORT": str(port + 1),
               "GOODPUT_EMBEDDER_INTRA_OP_THREADS": str(args.embed_threads)}
        # Its log goes to a file that the error below quotes when the service does not come up.
        proc = subprocess.Popen([sys.executable, "-m", "goodput_embedder"], env=env, stdout=log, stderr=log)
    channel = make_channel(addr, None, traced=False)
    try:
        vectoriser = RemoteVectoriser(channel, timeout_s=10.0)
        started = time.monotonic()
        while True:  # until the service answers (a fresh one loads its model first)
            try:
                await vectoriser.embed(["ready?"])
                break
            except Exception as exc:  # noqa: BLE001 - not up yet
                exited = proc is not None and proc.poll() is not None
                if exited or time.monotonic() - started > 180:
                    log.seek(0)
                    tail = "\n".join(log.read().decode(errors="replace").splitlines()[-30:])
                    why = f"exited with {proc.returncode}" if exited and proc else f"last error: {exc!r}"
                    raise RuntimeError(f"the Embedding service at {addr} did not answer after "
                                       f"{time.monotonic() - started:.0f} s ({why}); its log ends:\n{tail}") from None
                await asyncio.sleep(0.5)
        yield vectoriser
    finally:
        await channel.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        log.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with _vectoriser(args) as vectoriser:
        return await _run(args, vectoriser)


async def _run(args: argparse.Namespace, vectoriser: Any) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from redis.asyncio import Redis
    from tokenizers import Tokenizer

    from goodput_minilm import tokenizer_dir

    from goodput_cache.cache import Answer, CacheMetrics, ResponseCache
    from goodput_cache.config import CacheSettings
    from goodput_cache.exact import Entry
    from goodput_cache.keys import CacheRequest, Message, Sampling, derive

    tokenizer = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128: count the question's own word pieces
    rng = np.random.default_rng(1)
    pairs = _pairs(Path(args.data_dir), args.real, args.questions)
    results: dict[str, Any] = {}
    verifier = _verifier(args)

    def request(question: str) -> CacheRequest:
        return CacheRequest(tenant="bench", model="smollm2", model_version="1",
                            messages=[Message("system", "You are a support agent."), Message("user", question)],
                            sampling=Sampling(max_tokens=128, temperature=0.0))

    for size in args.sizes:
        prefix = f"bench-cache-{uuid.uuid4().hex[:8]}"
        settings = CacheSettings(redis_url=args.redis_url, key_prefix=prefix, kb_key_prefix=prefix,
                                 version_channel=f"{prefix}:kb", max_entries=max(args.sizes) * 2,
                                 max_partition_entries=max(args.sizes) * 2, ann_build_threads=args.build_threads,
                                 vector_memo_entries=0, max_l2_bytes=max(args.sizes) * 2 * 8 * 1024)  # ~4 KiB/entry
        redis = Redis.from_url(settings.redis_url, socket_timeout=1.0)
        cache = ResponseCache(settings, redis=redis, vectoriser=vectoriser, metrics=CacheMetrics(CollectorRegistry()))
        try:
            # the looked-up entries: real questions, stored the normal way (embedded)
            for origin, _ in pairs:
                await cache.store(request(origin), Answer(text="An answer of a few sentences. " * 8,
                                                          completion_tokens=80))
            partition = derive(request(pairs[0][0])).partition
            filler = size - len(pairs)
            t0 = time.perf_counter()
            batch = 2000
            for start in range(0, filler, batch):
                n = min(batch, filler - start)
                vecs = rng.standard_normal((n, vectoriser.dim)).astype(np.float32)
                vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
                pipe = redis.pipeline(transaction=False)
                now = time.time()
                for i in range(n):
                    key = uuid.uuid4().hex + uuid.uuid4().hex
                    e = Entry(key=key, tenant="bench", partition=partition, model="smollm2", model_version="1",
                              question=f"filler question {start + i}", text="filler answer " * 20,
                              completion_tokens=40, created=now, expires=now + 3600, semantic=True)
                    pipe.hset(f"{prefix}:e:{key}", mapping={"meta": e.to_json()})
                    pipe.expire(f"{prefix}:e:{key}", 3600)
                    pipe.zadd(f"{prefix}:lru", {key: now})
                    cache.index.add(partition, key, vecs[i], question=e.question, expires=e.expires)
                await pipe.execute()
            fill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            settle = getattr(cache.index, "settle", None)
            if settle is not None:
                settle(3600, complete=True)
            build_s = time.perf_counter() - t0
            # warm-up
            for origin, similar in pairs[:20]:
                await cache.lookup(request(origin))
                await cache.lookup(request(similar))
            exact: list[float] = []
            semantic: list[float] = []
            embed: list[float] = []
            embed_tokens: list[int] = []
            search: list[float] = []
            exact_hits = semantic_hits = verified_hits = 0
            verified: list[float] = []
            for i in range(args.lookups):
                origin, similar = pairs[i % len(pairs)]
                t = time.perf_counter()
                r = await cache.lookup(request(origin), allow_semantic=False)
                exact.append(time.perf_counter() - t)
                exact_hits += r.hit
                t = time.perf_counter()
                r = await cache.lookup(request(similar), allow_semantic=True)
                semantic.append(time.perf_counter() - t)
                semantic_hits += r.hit and r.layer == "l2"
                if verifier is not None:  # the same lookup with the verifier reading the candidates
                    cache.verifier = verifier
                    t = time.perf_counter()
                    r = await cache.lookup(request(similar), allow_semantic=True)
                    verified.append(time.perf_counter() - t)
                    verified_hits += r.hit and r.verdict == "same"
                    cache.verifier = None
            for i in range(min(args.lookups, 300)):
                _, similar = pairs[i % len(pairs)]
                t = time.perf_counter()
                v = (await vectoriser.embed([similar]))[0]
                embed.append(time.perf_counter() - t)
                embed_tokens.append(len(tokenizer.encode(similar).ids))
                t = time.perf_counter()
                await asyncio.to_thread(cache.index.search, partition, v, k=4,
                                        min_similarity=settings.threshold - settings.ambiguity_margin)
                search.append(time.perf_counter() - t)
            results[str(size)] = {
                "entries": size, "fill_seconds": fill_s, "index_build_seconds": build_s,
                "l2_index_entries": len(cache.index), "l2_search": "hnsw" if size >= settings.ann_min_entries
                else "exact",
                "exact": summarize(exact), "semantic": summarize(semantic),
                "semantic_embedding": summarize(embed), "semantic_search": summarize(search),
                "embedding_by_tokens": _by_tokens(embed, embed_tokens),
                "exact_hit_share": exact_hits / args.lookups, "semantic_l2_hit_share": semantic_hits / args.lookups,
            }
            if verified:
                results[str(size)]["semantic_verified"] = summarize(verified)
                results[str(size)]["verified_hit_share"] = verified_hits / args.lookups
            print(f"{size}: exact p99 {results[str(size)]['exact']['p99_ms']:.2f} ms, semantic p99 "
                  f"{results[str(size)]['semantic']['p99_ms']:.2f} ms", file=sys.stderr)
        finally:
            cursor = 0
            while True:
                cursor, keys = await redis.scan(cursor, match=f"{prefix}:*", count=5000)
                if keys:
                    await redis.delete(*keys)
                if cursor == 0:
                    break
            await redis.aclose()
    return results


def _verifier(args: argparse.Namespace) -> Any:
    """The cache's verifier as the service loads it, or None (no model, or --verifier-model none)."""
    from goodput_crossencoder.card import default_model_dir

    from goodput_cache.config import CacheSettings
    from goodput_cache.verify import load_verifier

    if args.verifier_model == "none":
        return None
    path = Path(args.verifier_model) if args.verifier_model else default_model_dir(Path(args.data_dir), "verifier")
    if not (path / "config.json").is_file():
        print(f"no verifier at {path}: semantic lookups are not timed with verification", file=sys.stderr)
        return None
    verifier = load_verifier(CacheSettings(verifier="cross-encoder", verifier_model=str(path)))
    args.verifier_info = {"model": verifier.name if verifier else "", "threshold": verifier.threshold if verifier
                          else None, "threads": CacheSettings().verifier_threads,
                          "min_similarity": CacheSettings().verify_min_similarity}
    return verifier


def _started_model(args: argparse.Namespace) -> str:
    """The model of the Embedding service this benchmark starts (its settings come from GOODPUT_EMBEDDER_*)."""
    if args.embedder != "service" or args.embedder_addr:
        return ""
    from goodput_embedder.config import EmbedderSettings

    started = EmbedderSettings()
    return started.model if started.model == "minilm-onnx-int8" else f"{started.model} on {started.device}"


def _by_tokens(seconds: list[float], tokens: list[int]) -> list[dict[str, Any]]:
    """Embedding time by question length: the model's work grows with the tokens of the question."""
    out = []
    for lo, hi in ((0, 32), (32, 64), (64, 128), (128, 100_000)):
        part = [t for t, n in zip(seconds, tokens, strict=True) if lo <= n < hi]
        if part:
            out.append({"tokens": f"{lo}-{hi - 1}" if hi < 100_000 else f"{lo}+", **summarize(part)})
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results = await run(args)
    return {"lookups": args.lookups, "verifier": getattr(args, "verifier_info", None), "questions": args.questions,
            "embed_threads": args.embed_threads, "embed_spin": args.embed_spin, "embedder": args.embedder,
            "embedder_addr": args.embedder_addr, "embedder_model": _started_model(args), "results": results,
            "goals_ms": GOALS_MS, "machine": machine_info()}


def largest(report: dict[str, Any], key: str = "semantic") -> dict[str, Any]:
    """The row of the largest size that measured ``key``."""
    return max((r for r in report["results"].values() if key in r), key=lambda r: int(r["entries"]))


def p99_at_largest(key: str) -> Any:
    return lambda report: (largest(report, key)[key]["p99_ms"], None)


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    verified = any("semantic_verified" in r for r in report["results"].values())
    return [bench.Goal("exact lookup p99 at the largest size", p99_at_largest("exact"), GOALS_MS["exact_p99"],
                       at_most=True),
            bench.Goal("semantic lookup p99 at the largest size, embedding included", p99_at_largest("semantic"),
                       GOALS_MS["semantic_p99"], at_most=True),
            *([bench.Goal("semantic lookup p99 with verification at the largest size",
                          p99_at_largest("semantic_verified"), GOALS_MS["semantic_p99"], at_most=True)]
              if verified else [])]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """The largest size's row; the median rest of a semantic lookup besides the embedding, the embedding's share of
    the semantic goal that leaves, and how many question-length buckets (shortest first) fit in it at p99."""
    big = largest(report)
    rest = big["semantic"]["p50_ms"] - big["semantic_embedding"]["p50_ms"]
    budget = GOALS_MS["semantic_p99"] - max(rest, 0.0)
    buckets = big.get("embedding_by_tokens", [])
    return {"big": big, "rest_ms": rest, "budget_ms": budget, "goal_ms": GOALS_MS,
            "fits": next((i for i, b in enumerate(buckets) if b["p99_ms"] > budget), len(buckets)),
            "verified": {size: r for size, r in report["results"].items() if "semantic_verified" in r}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 100000])
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--real", type=int, default=200, help="real question pairs stored and looked up")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--embed-threads", type=int, default=None,
                    help="CPU threads of one embedding (default: the cache's GOODPUT_CACHE_EMBEDDER_THREADS)")
    ap.add_argument("--embedder", choices=["local", "service"], default="local",
                    help="embed in-process (the cache's default) or through the Embedding service over gRPC")
    ap.add_argument("--embedder-addr", default="", help="--embedder service: an Embedding service to use (for "
                                                        "instance on a GPU); default: start one here")
    ap.add_argument("--build-threads", type=int, default=2, help="threads of the L2 graph build (setup, not timed)")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--questions", choices=sorted(QUESTION_SETS), default="mock",
                    help="the question pairs stored and looked up: " + "; ".join(f"{k}: {v}"
                                                                              for k, v in QUESTION_SETS.items()))
    ap.add_argument("--verifier-model", default="",
                    help="the cache's verifier (default <data-dir>/models/goodput-verifier-minilm when it is there): "
                         "each semantic lookup is also timed with verification; 'none' = not measured")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The report's default path for Quora's questions and for a smoke run; the embedder's threads and spinning as
    the cache would have them (in-process: the cache's settings; a service started here: the Embedding service's)."""
    from goodput_cache.config import CacheSettings
    from goodput_embedder.config import EmbedderSettings

    if args.out is None and (args.quick or args.questions == "qqp"):  # a smoke run leaves the reports alone
        args.out = ROOT / "loadtests" / "out" / "cache_latency" if args.quick else Path(f"{BENCHMARK.out}-qqp")
    if args.embed_threads is None:
        args.embed_threads = CacheSettings().embedder_threads
    if args.embedder_addr:
        args.embedder = "service"
    args.embed_spin = CacheSettings().embedder_spin if args.embedder == "local" else EmbedderSettings().intra_op_spin


BENCHMARK = bench.Benchmark(
    name="cache_latency", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare, goals=goals,
    context=context, quick={"sizes": [300], "lookups": 20, "real": 20},
    out=str(ROOT / "loadtests" / "reports" / "cache_latency"),  # with -qqp for --questions qqp
    quick_help="300 entries, 20 lookups of each kind (a smoke run)",
    reports=("cache_latency", "cache_latency-qqp", "cache_latency-service"))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
