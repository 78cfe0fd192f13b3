"""A customer-support style trace replayed through the gateway with the response cache on: the share of inference
requests the cache avoided, and the TTFT of hits versus misses.

    python -m loadtests.cache_trace                       # starts a local platform (1 vLLM worker) for the run
    python -m loadtests.cache_trace --url http://127.0.0.1:8080 --key KEY
    python -m loadtests.cache_trace --render loadtests/reports/cache_trace.json  # the report again

The trace (seeded) draws support questions with a Zipf-like popularity, as support traffic is: each request is the
canonical question, an exact repeat, or a hand-written paraphrase; a few are near misses of a popular question (the
opposite action, another number) and a few are time-sensitive ("today"). Every request is a greedy streamed chat
(SSE) with the same system prompt; TTFT is measured at the client to the first content chunk. A hit is *wrong* when
its answer is none of the answers generated (on a miss) for its own question or a paraphrase of it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtests import bench
from loadtests.common import machine_info, summarize

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are the support assistant of Acme Cloud. Answer in one or two sentences."
# (canonical, paraphrases...); near misses are separate questions that must NOT be served another's answer
QUESTIONS: list[list[str]] = [
    ["How do I reset my password?", "How can I reset my password?", "How do I reset my account password?"],
    ["How do I cancel my subscription?", "How can I cancel my subscription?", "How do I cancel my plan?"],
    ["Where can I download my invoices?", "Where do I download my invoices?", "Where can I find my invoices?"],
    ["How do I enable two-factor authentication?", "How can I enable two-factor authentication?",
     "How do I set up two-factor authentication?"],
    ["How do I change the email address on my account?", "How can I change my account email address?"],
    ["Which payment methods do you accept?", "What payment methods do you accept?"],
    ["How do I add a team member to my workspace?", "How can I add a team member to my workspace?"],
    ["Can I get a refund for an annual plan?", "Is a refund possible for an annual plan?"],
    ["How do I export my data?", "How can I export my data?"],
    ["How do I delete my account?", "How can I delete my account?", "How do I remove my account?"],
    ["Why was my card declined?", "Why did my card get declined?"],
    ["How do I rotate an API key?", "How can I rotate an API key?"],
    ["Is my data encrypted at rest?", "Is my data stored encrypted at rest?"],
    ["How do I upgrade to the Pro plan?", "How can I upgrade to the Pro plan?"],
    ["How do I contact support by phone?", "How can I contact support by phone?"],
]
NEAR_MISSES = ["How do I disable two-factor authentication?", "Is my data not encrypted at rest?",
               "How do I downgrade to the Pro plan?", "How do I add 5 team members to my workspace?"]
TIME_SENSITIVE = ["Is there an outage today?", "What is the latest version of the CLI?"]


def build_trace(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(QUESTIONS))]
    trace: list[dict[str, Any]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05:
            trace.append({"question": rng.choice(NEAR_MISSES), "kind": "near miss", "base": None})
            continue
        if r < 0.08:
            trace.append({"question": rng.choice(TIME_SENSITIVE), "kind": "time-sensitive", "base": None})
            continue
        base = rng.choices(range(len(QUESTIONS)), weights)[0]
        variants = QUESTIONS[base]
        pick = 0 if rng.random() < 0.55 else rng.randrange(1, len(variants))
        trace.append({"question": variants[pick], "kind": "repeat" if pick == 0 else "paraphrase", "base": base})
    for t in trace:  # the question's own identity (near misses are their own questions)
        t["id"] = t["base"] if t["base"] is not None else t["question"]
    return trace


def send(client: httpx.Client, url: str, key: str, question: str, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    with client.stream("POST", url + "/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        status = resp.headers.get("x-goodput-cache", "")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(content)
    return {"status": status, "ttft": ttft if ttft is not None else time.perf_counter() - start,
            "e2e": time.perf_counter() - start, "text": "".join(parts)}


def run(url: str, key: str, trace: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    answers: dict[Any, set[str]] = {}  # every answer generated for a question (its canonical form or a paraphrase)
    out = []
    with httpx.Client(timeout=180) as client:
        for i, t in enumerate(trace):
            r = send(client, url, key, t["question"], max_tokens)
            hit = r["status"].startswith("hit")
            layer = r["status"].split("layer=")[1].split(";")[0] if hit else ""
            # a hit is right when its answer is one generated for the same question (or a paraphrase of it)
            wrong = hit and r["text"] not in answers.get(t["id"], set())
            if not hit:
                answers.setdefault(t["id"], set()).add(r["text"])
            out.append({**t, "hit": hit, "layer": layer, "wrong": bool(wrong), "ttft_s": r["ttft"],
                        "e2e_s": r["e2e"], "status": r["status"], "answer": r["text"]})
            if (i + 1) % 20 == 0:
                print(f"{i + 1}/{len(trace)} requests", file=sys.stderr)
            time.sleep(0.05)  # the store happens after the stream, off the response path
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [r for r in rows if r["hit"]]
    misses = [r for r in rows if not r["hit"]]
    by_kind = {}
    for kind in ("repeat", "paraphrase", "near miss", "time-sensitive"):
        rs = [r for r in rows if r["kind"] == kind]
        by_kind[kind] = {"requests": len(rs), "hits": sum(r["hit"] for r in rs),
                         "l1": sum(r["layer"] == "l1" for r in rs), "l2": sum(r["layer"] == "l2" for r in rs)}
    return {"requests": len(rows), "hits": len(hits), "avoided_share": len(hits) / len(rows) if rows else 0.0,
            "l1_hits": sum(r["layer"] == "l1" for r in hits), "l2_hits": sum(r["layer"] == "l2" for r in hits),
            "wrong_hits": sum(r["wrong"] for r in hits), "by_kind": by_kind,
            "ttft_hit": summarize([r["ttft_s"] for r in hits]), "ttft_miss": summarize([r["ttft_s"] for r in misses]),
            "e2e_hit": summarize([r["e2e_s"] for r in hits]), "e2e_miss": summarize([r["e2e_s"] for r in misses])}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Replays the trace through the gateway at ``--url``, or through a local platform started for the run."""
    trace = build_trace(args.requests, args.seed)
    if args.url:
        rows, platform = run(args.url, args.key, trace, args.max_tokens), f"gateway at {args.url}"
    else:
        rows = _on_local_platform(args, trace)
        platform = f"local platform ({args.workers} vLLM CPU worker(s), SmolLM2-135M)"
    return {"seed": args.seed, "max_tokens": args.max_tokens, "platform": platform, "summary": summarise(rows),
            "requests": rows, "machine": machine_info()}


def _on_local_platform(args: argparse.Namespace, trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from goodput_cli.supervisor import Platform

    prefix = f"goodput:cache:trace-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="cache-trace-") as tmp:
        platform = Platform(workdir=Path(tmp), workers=args.workers, port_offset=args.port_offset, knowledge=False,
                            cache=True, env={"GOODPUT_CACHE_KEY_PREFIX": prefix},
                            api_keys=[{"key": "trace-key", "tenant": "support", "max_priority": "P0"}])
        print("starting a local platform (vLLM on CPU takes a minute or two)...", file=sys.stderr)
        platform.start(timeout_s=900)
        try:
            return run(platform.gateway_http, "trace-key", trace, args.max_tokens)
        finally:
            platform.stop()
            import redis

            r = redis.Redis.from_url(platform.redis_url)
            keys = list(r.scan_iter(match=f"{prefix}:*"))
            if keys:
                r.delete(*keys)
            r.close()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="", help="a running gateway; empty = start a local platform for the run")
    ap.add_argument("--key", default="")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--port-offset", type=int, default=int(os.environ.get("GOODPUT_TEST_PORT_OFFSET", "3000")))


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick and args.out is None:  # a smoke run leaves the committed report alone
        args.out = ROOT / "loadtests" / "out" / "cache_trace"


BENCHMARK = bench.Benchmark(
    name="cache_trace", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare, seed=11,
    quick={"requests": 20}, quick_help="20 requests (a smoke run)",
    out=str(ROOT / "loadtests" / "reports" / "cache_trace"), reports=("cache_trace",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
