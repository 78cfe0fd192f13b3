"""Degradation-ladder benchmark: P0 RAG traffic with a slow retrieval leg at rising load on a simulated fleet,
through the gateway with its degradation ladder on and off, in one run.

Two platforms (``goodput_cli.supervisor.Platform``: real gateway, scheduler and simulated workers,
``GOODPUT_INFERENCE_ENGINE=sim``; only the GPU is simulated) with the same settings but one:
``GOODPUT_GATEWAY_LADDER__ENABLED=true`` on the first (arm ``ladder``), ``false`` on the second (arm
``no_ladder``). Only one of them carries load at any time. Both gateways search a **stand-in retriever** this module
serves itself (``goodput.retriever.v1.Retrieval/Search`` over the platforms' mutual TLS, in a process of its own):
it runs no search, it sleeps what a hybrid search with a cross-encoder rerank would take,

    latency = base + per_chunk x top_k + (rerank ? rerank : 0)      (80 ms + 10 ms x top_k + 150 ms by default)

and returns ``top_k`` synthetic chunks of ~400 characters derived from the query (no prefix-cache reuse), so the
two steps of the ladder that act on retrieval change the cost: ``skip_rerank`` saves the rerank's time, and
``fewer_chunks`` (half the chunks) saves retrieval time and makes the prompt shorter, hence the simulated engine's
prefill cheaper. The gateways ask for a rerank (``GOODPUT_GATEWAY_RAG__RERANK=true``) and ``rag_top_k`` chunks; the
rerank runs under the rerank budget the gateway sends, as the retriever's does. Everything else is the platform's
defaults (the scheduler's queues, queue-wait budget and deadline prediction, the gateway's breakers and ladder
settings).

In this order:

1. **capacity** (arm ``no_ladder``): the fleet's throughput (closed loop, every slot busy, completions per second),
   then a short rising ramp of open-loop Poisson rates around it; *capacity* is the offered rate of the last rate
   before the first at which less than ``--capacity-share`` of the requests met their SLO (the P0 SLO of the
   latency profile, the same for both arms);
2. **steps**: Poisson arrivals at each ``--multiples`` x capacity for ``--step-s`` seconds, drawn once per step
   (seeded) and replayed on both arms (the arm that goes first alternates from step to step).

Per request the client measures (REST, streaming) TTFT to the first content delta, TPOT (the rest of the stream
over the output tokens after the first), the status and error code (``degraded_shed``: the ladder's last step) and
the degradation steps the gateway reports (``X-Goodput-Degraded`` header, ``goodput_degraded`` on the first chunk,
``goodput_timing.degraded`` on the last). A request *met its SLO* when it was served (200, whole stream) with TTFT
<= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s``; *share within SLO* = met / offered; *goodput* = output tokens of the
requests that met their SLO per second of the step (and per engine-busy second, from the workers'
``goodput_worker_engine_busy_seconds_total``). The headline is the ratio ladder / no ladder of both at 2x capacity
(goal: >= 1.5x), over every request of the step: the ladder's reaction time counts (it moves one step per
``ladder_interval_s`` on finished requests, and starts a step at the level the previous one left); the requests of
each step's second half are reported beside it.

    python -m loadtests.ladder                                  # 2 workers, ~10 min on 2 cores, ports +4100/+4140
    python -m loadtests.ladder --out loadtests/reports/ladder   # the reference run
    python -m loadtests.ladder --quick                          # a smoke run (1 worker, 2 short steps)
    python -m loadtests.ladder --render loadtests/reports/ladder.json   # re-render report + plot

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtests.common import cpu_label, machine_info, markdown_table, percentile, produce, pyplot, summarize
from loadtests.simfleet import random_text

__all__ = ["ARMS", "Outcome", "RetrievalCost", "Slo", "analyse_run", "capacity_from_ramp", "headline", "main",
           "render_markdown", "render_plot", "settled", "stand_in_hits", "timeline"]

LADDER, NO_LADDER = "ladder", "no_ladder"
ARMS = (LADDER, NO_LADDER)
# Ports: the ladder arm's platform at PORT_OFFSET, the other's ARM_SHIFT above (gateway, scheduler, workers and the
# stand-in retriever on the topology's ports + offset). No other test or benchmark uses them (tests: 1000, 2300-3900;
# loadtests: 300, 3000, 3400, 3450; the smoke test: 4200 and 4240).
PORT_OFFSET = 4100
ARM_SHIFT = 40
GOAL_RATIO = 1.5
GOAL_MULTIPLE = 2.0
TENANT = "ladder-bench"
KNOWLEDGE_BASE = "handbook"
DEGRADED_HEADER = "x-goodput-degraded"
SHED_CODE = "degraded_shed"


# ---- the stand-in retriever -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RetrievalCost:
    """What one search costs the stand-in retriever (seconds) and how long its chunks are.

    >>> cost = RetrievalCost()
    >>> round(cost.latency_s(8, rerank=True), 3), round(cost.latency_s(4, rerank=False), 3)
    (0.31, 0.12)
    """

    base_s: float = 0.080
    per_chunk_s: float = 0.010
    rerank_s: float = 0.150
    chunk_chars: int = 400

    def latency_s(self, top_k: int, *, rerank: bool) -> float:
        return self.base_s + self.per_chunk_s * top_k + (self.rerank_s if rerank else 0.0)


def stand_in_hits(query: str, top_k: int, chunk_chars: int) -> list[tuple[str, str, float, str]]:
    """``top_k`` synthetic chunks (chunk id, document id, score, text) derived from the query: the same query gets
    the same chunks, another query others (so no two requests share a prompt prefix beyond the instruction).

    >>> hits = stand_in_hits("how long do refunds take?", 3, 400)
    >>> [(h[0], len(h[3])) for h in hits]
    [('c0', 400), ('c1', 400), ('c2', 400)]
    >>> hits == stand_in_hits("how long do refunds take?", 3, 400) != stand_in_hits("other", 3, 400)
    True
    """
    out = []
    for i in range(top_k):
        rng = random.Random(f"{query}\x00{i}")
        out.append((f"c{i}", f"d{i % 3}", round(1.0 / (i + 1), 4), random_text(rng, chunk_chars)))
    return out


def _stand_in_servicer(arm: str, cost: RetrievalCost, events: Any) -> Any:
    from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc

    class StandInRetrieval(retriever_pb2_grpc.RetrievalServicer):
        """Sleeps what the search would take (its legs, then the rerank pass under the caller's rerank budget)
        and answers synthetic chunks; reports (arm, top_k, rerank) of each search to the benchmark's process."""

        async def Search(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
            top_k = request.top_k or 5  # the proto's default
            events.put((arm, top_k, bool(request.rerank)))
            legs = cost.latency_s(top_k, rerank=False)
            await asyncio.sleep(legs)
            timings = [retriever_pb2.LegTiming(leg="dense", seconds=legs, ok=True),
                       retriever_pb2.LegTiming(leg="lexical", seconds=legs, ok=True)]
            notes = []
            if request.rerank:
                # as the retriever does: the rerank pass under the caller's budget, the fused order when over it
                budget = request.rerank_budget_s or None
                seconds = cost.rerank_s if budget is None else min(cost.rerank_s, budget)
                await asyncio.sleep(seconds)
                timings.append(retriever_pb2.LegTiming(leg="rerank", seconds=seconds, ok=seconds >= cost.rerank_s))
                if seconds < cost.rerank_s:
                    notes.append(f"rerank skipped: over its budget of {budget:g} s")
            hits = [retriever_pb2.Hit(chunk_id=c, document_id=d, score=s, text=t)
                    for c, d, s, t in stand_in_hits(request.query, top_k, cost.chunk_chars)]
            return retriever_pb2.SearchResponse(hits=hits, timings=timings, notes=notes, kb_version=1)

    return StandInRetrieval()


async def _serve_stand_in(listen: Sequence[tuple[str, str, str | None]], cost: RetrievalCost, events: Any,
                          ready: Any) -> None:
    import grpc
    from goodput.retriever.v1 import retriever_pb2_grpc
    from grpc import aio

    from goodput_core.tls import tls_files

    servers = []
    for arm, address, tls_dir in listen:
        server = aio.server()
        retriever_pb2_grpc.add_RetrievalServicer_to_server(_stand_in_servicer(arm, cost, events), server)
        if tls_dir is None:
            server.add_insecure_port(address)
        else:
            # The platform's retriever identity: its gateway checks the certificate against the platform's CA.
            cert, key, ca = tls_files(Path(tls_dir), "retriever").read()
            server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                                        require_client_auth=True))
        await server.start()
        servers.append(server)
    ready.set()
    await asyncio.gather(*(s.wait_for_termination() for s in servers))


def serve_stand_in(listen: Sequence[tuple[str, str, str | None]], cost: RetrievalCost, events: Any,
                   ready: Any) -> None:
    """The stand-in retriever's process: one server per ``(arm, address, tls_dir)`` (tls_dir None: plaintext)."""
    asyncio.run(_serve_stand_in(listen, cost, events, ready))


class StandIn:
    """The stand-in retriever in a process of its own (its sleeps do not share the load generator's event loop)."""

    def __init__(self, listen: Sequence[tuple[str, str, str | None]], cost: RetrievalCost) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.events: Any = ctx.Queue()
        self._ready = ctx.Event()
        self._proc = ctx.Process(target=serve_stand_in, args=(list(listen), cost, self.events, self._ready),
                                 name="stand-in-retriever", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self._proc.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError("the stand-in retriever did not start")

    def drain(self) -> list[tuple[str, int, bool]]:
        """The searches reported since the last drain."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# ---- one request through the gateway -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Slo:
    """The P0 SLO a request is judged by (the latency profile's ``slo``)."""

    ttft_s: float
    tpot_s: float


@dataclass
class Outcome:
    """One streamed RAG request as the client saw it."""

    scheduled_s: float  # arrival, seconds after the run's start
    lag_s: float = 0.0  # how late the client sent it
    status: int = 0  # HTTP status; 0 = no response
    code: str = ""  # the OpenAI error body's code (a refusal, or an error event mid-stream)
    message: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    sources: int | None = None  # chunks the gateway put in the prompt (the first chunk's `sources`)
    completed: bool = False  # a finish_reason and [DONE] arrived
    degraded: tuple[str, ...] = ()  # the ladder's steps the gateway reports for this request
    stages_ms: dict[str, float] = field(default_factory=dict)  # goodput_timing on the last chunk

    @property
    def served(self) -> bool:
        return self.status == 200 and self.completed

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def met(self, slo: Slo) -> bool:
        """Served with TTFT and TPOT within the SLO.

        >>> slo = Slo(ttft_s=1.0, tpot_s=0.1)
        >>> Outcome(0.0, status=200, completed=True, ttft_s=0.8, e2e_s=2.0, completion_tokens=17).met(slo)
        True
        >>> Outcome(0.0, status=200, completed=True, ttft_s=0.8, e2e_s=3.0, completion_tokens=17).met(slo)
        False
        >>> Outcome(0.0, status=429, code="degraded_shed").met(slo)
        False
        """
        if not self.served or self.ttft_s is None or self.ttft_s > slo.ttft_s:
            return False
        tpot = self.tpot_s
        return tpot is None or tpot <= slo.tpot_s


def _steps(value: Any) -> list[str]:
    """Degradation steps from a header value ("skip_rerank, fewer_chunks") or a JSON list."""
    if not value:
        return []
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if isinstance(value, list | tuple):
        return [str(s) for s in value if s]
    return []


def _error_of(raw: bytes) -> tuple[str, str]:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or ""), str(err.get("message") or "")[:240]
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", raw[:240].decode("utf-8", "replace")


def question(tag: str, i: int, chars: int) -> str:
    head = f"{tag} question {i}: "
    return head + random_text(random.Random(f"{tag}-{i}"), max(chars - len(head), 1)) + "?"


@dataclass(frozen=True)
class Traffic:
    """One run's arrivals against one gateway."""

    base_url: str
    key: str
    tag: str  # makes the questions (so the chunks and the prompts) unique to the run
    arrivals: tuple[float, ...]  # seconds after t0
    t0: float
    question_chars: int
    max_tokens: int
    timeout_s: float = 120.0


async def send(client: httpx.AsyncClient, traffic: Traffic, i: int) -> Outcome:
    scheduled = traffic.arrivals[i] if i < len(traffic.arrivals) else None
    out = Outcome(scheduled_s=scheduled or 0.0)
    body = {"messages": [{"role": "user", "content": question(traffic.tag, i, traffic.question_chars)}],
            "max_tokens": traffic.max_tokens, "stream": True, "priority": "P0", "knowledge_base": KNOWLEDGE_BASE,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    out.lag_s = 0.0 if scheduled is None else max(0.0, start - (traffic.t0 + scheduled))
    degraded: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {traffic.key}"}) as resp:
            out.status = resp.status_code
            degraded += _steps(resp.headers.get(DEGRADED_HEADER))
            if resp.status_code != 200:
                raw = await resp.aread()
                out.code, out.message = _error_of(raw)
                try:
                    degraded += _steps(json.loads(raw).get("goodput_degraded"))
                except (ValueError, AttributeError):
                    pass
                return out
            finished = done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.code, out.message = str(event["error"].get("code") or ""), str(event["error"].get("message"))
                    continue
                degraded += _steps(event.get("goodput_degraded"))
                if "sources" in event and out.sources is None:
                    out.sources = len(event["sources"] or ())
                timing = event.get("goodput_timing")
                if isinstance(timing, dict):
                    out.stages_ms = {k: float(v) for k, v in (timing.get("stages_ms") or {}).items()}
                    degraded += _steps(timing.get("degraded"))
                usage = event.get("usage")
                if isinstance(usage, dict):
                    out.completion_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                for choice in event.get("choices") or ():
                    if out.ttft_s is None and (choice.get("delta") or {}).get("content"):
                        out.ttft_s = time.monotonic() - start
                    if choice.get("finish_reason"):
                        finished = True
            out.completed = finished and done
            out.e2e_s = time.monotonic() - start
    except (httpx.HTTPError, ValueError) as err:
        out.message = f"{type(err).__name__}: {err}"[:240]
    finally:
        out.degraded = tuple(dict.fromkeys(degraded))  # each step once, in the order reported
    return out


async def drive(traffic: Traffic, on_done: Any = None) -> list[Outcome]:
    """Sends every arrival at its time (open loop) and waits for all of them."""
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    timeout = httpx.Timeout(traffic.timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=traffic.base_url, timeout=timeout, limits=limits) as client:
        async def one(i: int) -> Outcome:
            o = await send(client, traffic, i)
            if on_done is not None:
                on_done()
            return o

        tasks = []
        for i, at in enumerate(traffic.arrivals):
            delay = traffic.t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        return list(await asyncio.gather(*tasks))


def poisson(rng: random.Random, rate: float, duration_s: float) -> tuple[float, ...]:
    """Poisson arrival times within ``duration_s`` at ``rate`` per second.

    >>> a = poisson(random.Random(1), 10.0, 5.0)
    >>> 30 < len(a) < 70 and all(0 < t <= 5.0 for t in a) and list(a) == sorted(a)
    True
    """
    out: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        out.append(round(t, 4))
    return tuple(out)


async def throughput(base_url: str, key: str, *, concurrency: int, warmup_s: float, measure_s: float,
                     question_chars: int, max_tokens: int) -> dict[str, Any]:
    """Closed loop with every slot busy: RAG completions per second (what the fleet can finish, SLO or not)."""
    traffic = Traffic(base_url, key, f"throughput {secrets.token_hex(3)}", (), 0.0, question_chars, max_tokens)
    done: list[float] = []
    failed: Counter[str] = Counter()
    counter = iter(range(1_000_000))
    start = time.monotonic()
    stop = start + warmup_s + measure_s

    async def loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            r = await send(client, traffic, next(counter))
            if r.served:
                done.append(time.monotonic())
            else:
                failed[outcome_kind(r)] += 1
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as client:
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
    window = [t for t in done if start + warmup_s <= t <= start + warmup_s + measure_s]
    rps = len(window) / measure_s
    if not window and done:  # a window shorter than one request (a smoke run): all of it, warm-up included
        rps = len(done) / (max(done) - start)
    return {"rps": rps, "completed_in_window": len(window), "completed": len(done),
            "not_served": dict(failed.most_common()), "concurrency": concurrency, "warmup_s": warmup_s,
            "measure_s": measure_s}


# ---- analysis ------------------------------------------------------------------------------------------------------

def outcome_kind(o: Outcome) -> str:
    """What happened to a request, for the tables.

    >>> outcome_kind(Outcome(0.0, status=429, code="degraded_shed")), outcome_kind(Outcome(0.0))
    ('429 degraded_shed', 'no response')
    """
    if o.status == 0:
        return "no response"
    if o.status == 200:
        return "served" if o.completed else f"stream: {o.code or o.message[:60]}"
    return f"{o.status} {o.code or o.message[:60]}".strip()


def _gist(message: str) -> str:
    """A message with its measured numbers blurred, so that the same refusal counts once.

    >>> _gist("the request waited 4.99997 s for a worker, its class's queue-wait budget")
    "the request waited ~5 s for a worker, its class's queue-wait budget"
    """
    return re.sub(r"\b\d+\.\d+\b", lambda m: f"~{float(m.group()):.2g}", message[:160])


def _ms(values: Sequence[float]) -> list[float]:
    return [round(v * 1000, 1) for v in values]


def analyse_run(outcomes: list[Outcome], *, slo: Slo, duration_s: float, engine_busy_s: float | None = None,
                searches: Sequence[tuple[str, int, bool]] = ()) -> dict[str, Any]:
    """One arm at one load step: share within SLO, goodput, TTFT of the served, shed share, steps taken.

    >>> slo = Slo(ttft_s=1.0, tpot_s=0.1)
    >>> ok = Outcome(0.1, status=200, completed=True, ttft_s=0.5, e2e_s=1.5, completion_tokens=11,
    ...              degraded=("skip_rerank",))
    >>> late = Outcome(0.2, status=200, completed=True, ttft_s=1.5, e2e_s=2.5, completion_tokens=11)
    >>> shed = Outcome(0.3, status=429, code="degraded_shed")
    >>> r = analyse_run([ok, late, shed], slo=slo, duration_s=2.0, searches=[("ladder", 8, True)])
    >>> r["n"], r["served"], r["met"], round(r["share_within_slo"], 3), r["goodput_tok_s"], r["shed"]
    (3, 2, 1, 0.333, 5.5, 1)
    >>> r["degraded_steps"], r["outcomes"]
    ({'skip_rerank': 1}, {'served': 2, '429 degraded_shed': 1})
    """
    served = [o for o in outcomes if o.served]
    met = [o for o in served if o.met(slo)]
    n = len(outcomes)
    ttft = [o.ttft_s for o in served if o.ttft_s is not None]
    tpot = [t for o in served if (t := o.tpot_s) is not None]
    met_tokens = sum(o.completion_tokens for o in met)
    steps: Counter[str] = Counter(s for o in outcomes for s in o.degraded)
    shed = sum(1 for o in outcomes if o.code == SHED_CODE)
    retrieval = [o.stages_ms["retrieval"] / 1000 for o in served if "retrieval" in o.stages_ms]
    sources = [o.sources for o in served if o.sources is not None]
    out: dict[str, Any] = {
        "n": n, "offered_rps": n / duration_s if duration_s else None, "duration_s": duration_s,
        "served": len(served), "met": len(met), "share_within_slo": len(met) / n if n else None,
        "goodput_tok_s": met_tokens / duration_s if duration_s else None,
        "goodput_tok_per_engine_s": met_tokens / engine_busy_s if engine_busy_s else None,
        "engine_busy_s": engine_busy_s,
        "output_tokens_served": sum(o.completion_tokens for o in served),
        "ttft": summarize(ttft), "tpot": summarize(tpot), "ttft_ms": _ms(ttft),
        "retrieval_stage": summarize(retrieval),
        "prompt_tokens_mean": (sum(o.prompt_tokens for o in served) / len(served)) if served else None,
        "sources_mean": (sum(sources) / len(sources)) if sources else None,
        "shed": shed, "shed_share": shed / n if n else None,
        "degraded_steps": dict(steps.most_common()),
        "requests_degraded": sum(1 for o in outcomes if o.degraded),
        "outcomes": dict(Counter(outcome_kind(o) for o in outcomes).most_common()),
        "messages": Counter(f"{outcome_kind(o)}: {_gist(o.message)}" for o in outcomes
                            if not o.served and o.code != SHED_CODE).most_common(4),
        "client_lag_p99_ms": (percentile([o.lag_s for o in outcomes], 99) or 0.0) * 1000,
    }
    out["timeline"] = timeline(outcomes, slo=slo, duration_s=duration_s)
    if searches:
        top_k = Counter(k for _, k, _ in searches)
        out["searches"] = {"n": len(searches), "reranked": sum(1 for _, _, r in searches if r),
                           "top_k": {str(k): v for k, v in sorted(top_k.items())}}
    return out


def timeline(outcomes: Sequence[Outcome], *, slo: Slo, duration_s: float,
             bucket_s: float = 5.0) -> list[dict[str, Any]]:
    """What became of the requests by arrival time, in buckets of ``bucket_s``: how the ladder's moves show within
    a step.

    >>> tl = timeline([Outcome(1.0, status=429, code="degraded_shed"),
    ...                Outcome(6.0, status=200, completed=True, ttft_s=0.5, e2e_s=1.0, completion_tokens=11)],
    ...               slo=Slo(1.0, 0.1), duration_s=10.0)
    >>> [(b["t"], b["n"], b["met"], b["shed"]) for b in tl]
    [(0.0, 1, 0, 1), (5.0, 1, 1, 0)]
    """
    out = []
    buckets = max(1, int(duration_s / bucket_s + 0.999))
    for k in range(buckets):
        lo, hi = k * bucket_s, (k + 1) * bucket_s
        inside = [o for o in outcomes if lo <= o.scheduled_s < hi or (k == buckets - 1 and o.scheduled_s >= hi)]
        served = [o.ttft_s for o in inside if o.served and o.ttft_s is not None]
        out.append({"t": lo, "n": len(inside), "met": sum(1 for o in inside if o.met(slo)),
                    "shed": sum(1 for o in inside if o.code == SHED_CODE),
                    "degraded": sum(1 for o in inside if o.degraded),
                    "ttft_p50_ms": None if not served else round((percentile(served, 50) or 0.0) * 1000, 1)})
    return out


def capacity_from_ramp(ramp: Sequence[dict[str, Any]], share: float) -> tuple[float, bool]:
    """Capacity from a rising ramp: the offered rate of the last step before the first whose share of requests
    within SLO fell below ``share`` (a lucky draw at a higher rate does not count), and whether any step met it
    (if none, the first step's rate). Rates are the offered ones (requests / seconds), not the nominal.

    >>> ramp = [{"offered_rps": 1.0, "share_within_slo": 1.0}, {"offered_rps": 2.0, "share_within_slo": 0.95},
    ...         {"offered_rps": 3.0, "share_within_slo": 0.6}, {"offered_rps": 3.5, "share_within_slo": 0.96}]
    >>> capacity_from_ramp(ramp, 0.9)
    (2.0, True)
    >>> capacity_from_ramp([{"offered_rps": 1.0, "share_within_slo": 0.5}], 0.9)
    (1.0, False)
    """
    found: float | None = None
    for r in ramp:
        if (r.get("share_within_slo") or 0.0) < share:
            break
        found = r["offered_rps"]
    if found is None:
        return ramp[0]["offered_rps"], False
    return found, True


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return float("inf") if a > 0 else None
    return a / b


def headline(report: dict[str, Any]) -> dict[str, Any] | None:
    """Ladder / no ladder, share within SLO and goodput, at the step nearest to 2x capacity, against the goal.

    >>> steps = [{"multiple": 2.0, "arms": {"ladder": {"share_within_slo": 0.6, "goodput_tok_s": 30.0},
    ...                                     "no_ladder": {"share_within_slo": 0.3, "goodput_tok_s": 24.0}}}]
    >>> h = headline({"steps": steps})
    >>> h["share_ratio"], h["goodput_ratio"], h["share_met"], h["goodput_met"]
    (2.0, 1.25, True, False)
    """
    steps = report.get("steps") or []
    if not steps:
        return None
    step = min(steps, key=lambda s: abs(s["multiple"] - GOAL_MULTIPLE))
    on, off = step["arms"].get(LADDER), step["arms"].get(NO_LADDER)
    if not on or not off:
        return None
    share = _ratio(on["share_within_slo"], off["share_within_slo"])
    goodput = _ratio(on["goodput_tok_s"], off["goodput_tok_s"])
    out: dict[str, Any] = {"multiple": step["multiple"], "share_ratio": share, "goodput_ratio": goodput,
                           "share": [on["share_within_slo"], off["share_within_slo"]],
                           "goodput": [on["goodput_tok_s"], off["goodput_tok_s"]],
                           "share_met": None if share is None else share >= GOAL_RATIO,
                           "goodput_met": None if goodput is None else goodput >= GOAL_RATIO}
    if on.get("settled") and off.get("settled"):
        a, b = on["settled"], off["settled"]
        out["settled"] = {"share": [a["share_within_slo"], b["share_within_slo"]],
                          "goodput": [a["goodput_tok_s"], b["goodput_tok_s"]],
                          "share_ratio": _ratio(a["share_within_slo"], b["share_within_slo"]),
                          "goodput_ratio": _ratio(a["goodput_tok_s"], b["goodput_tok_s"])}
    return out


# ---- the platforms -------------------------------------------------------------------------------------------------

def latency_profile(args: argparse.Namespace) -> dict[str, Any]:
    """The P0 profile both arms run with (GOODPUT_GATEWAY_LATENCY_PROFILE); the other classes keep the defaults."""
    return {"P0": {"slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
                   "budgets": {"retrieval": args.retrieval_budget_s}}}


def sim_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"time_scale": args.time_scale, "stream_every": args.stream_every,
            "max_batched_tokens": args.max_batched_tokens}


def platform_env(args: argparse.Namespace, arm: str, retriever_addr: str, prefix: str) -> dict[str, str]:
    return {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps(sim_config(args)),
            "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(args.max_num_seqs),
            "GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER": str(args.max_num_seqs),
            "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.25",
            "GOODPUT_GATEWAY_RETRIEVER_ADDR": retriever_addr,
            "GOODPUT_GATEWAY_RAG__TOP_K": str(args.top_k),
            "GOODPUT_GATEWAY_RAG__RERANK": "true",
            "GOODPUT_GATEWAY_LADDER__ENABLED": "true" if arm == LADDER else "false",
            "GOODPUT_GATEWAY_LATENCY_PROFILE": json.dumps(latency_profile(args)),
            "GOODPUT_GATEWAY_QUOTAS__PREFIX": f"{prefix}:quota",
            "GOODPUT_GATEWAY_METERING__USAGE_PREFIX": f"{prefix}:usage",
            **{f"GOODPUT_{svc}_LOG_LEVEL": "WARNING" for svc in ("GATEWAY", "SCHEDULER", "INFERENCE")}}


def source_version() -> str | None:
    """The repository's commit the platforms ran (``+changes`` when libs/ or services/ had uncommitted edits)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "libs", "services"], capture_output=True,
                               text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def gateway_knows() -> dict[str, bool]:
    """Which of the settings this benchmark relies on the gateway (as installed here) has."""
    try:
        from goodput_gateway.config import GatewaySettings
    except ImportError:
        return {}
    fields = GatewaySettings.model_fields
    return {name: name in fields for name in ("ladder", "rag", "latency_profile", "retriever_addr")}


async def engine_busy(platform: Any) -> float | None:
    """Seconds the platform's engines had work, summed over its workers (None when a worker does not say)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    async with httpx.AsyncClient(timeout=5.0) as client:
        for i in range(platform.workers):
            try:
                text = (await client.get(f"{platform.worker_http(i)}/metrics")).text
            except httpx.HTTPError:
                return None
            found = False
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "goodput_worker_engine_busy_seconds_total":
                        total += s.value
                        found = True
            if not found:
                return None
    return total


_GATEWAY_FAMILIES = ("goodput_gateway_degradations", "goodput_gateway_ladder_level",
                     "goodput_gateway_ladder_shed_share", "goodput_gateway_slo_requests",
                     "goodput_gateway_deadline_refusals")


async def gateway_metrics(base_url: str) -> dict[str, float]:
    """The gateway's ladder, SLO and deadline metrics, by name and labels (the tenant and model labels left out):
    counters (``*_total``) and gauges (the ladder's level and shed share)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{base_url}/metrics")).text
        for family in text_string_to_metric_families(text):
            if family.name not in _GATEWAY_FAMILIES:
                continue
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("tenant", "model"))
                name = f"{s.name}{{{labels}}}" if labels else s.name
                out[name] = out.get(name, 0.0) + s.value
    except (httpx.HTTPError, ValueError):
        pass
    return out


def metric_changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as their increase over the run, gauges as their value at its end (zeros left out).

    >>> metric_changes({"a_total": 2.0, "level{priority=P0}": 1.0}, {"a_total": 5.0, "level{priority=P0}": 3.0})
    {'a_total': 3.0, 'level{priority=P0}': 3.0}
    """
    out = {}
    for name, value in sorted(after.items()):
        counter = name.split("{", 1)[0].endswith("_total")
        v = value - before.get(name, 0.0) if counter else value
        if v:
            out[name] = v
    return out


def delete_keys(redis_url: str, prefix: str) -> int:
    """Deletes this run's quota and usage keys (a unique prefix)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


# ---- the benchmark -------------------------------------------------------------------------------------------------

class Progress:
    """A progress bar of requests done (rich), or nothing."""

    def __init__(self, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn())

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def task(self, description: str, total: int) -> Any:
        if self._bar is None:
            return lambda: None
        task = self._bar.add_task(description, total=total)
        return lambda: self._bar.advance(task)

    def print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)


async def run_arm(arm: str, platform: Any, stand_in: StandIn, args: argparse.Namespace, key: str, *,
                  arrivals: tuple[float, ...], tag: str, duration_s: float, slo: Slo,
                  progress: Progress, label: str) -> dict[str, Any]:
    """One arm's run of one set of arrivals, analysed."""
    stand_in.drain()
    busy_before = await engine_busy(platform)
    metrics_before = await gateway_metrics(platform.gateway_http)
    t0 = time.monotonic() + 0.3
    traffic = Traffic(platform.gateway_http, key, tag, arrivals, t0, args.question_chars, args.max_tokens)
    outcomes = await drive(traffic, progress.task(label, len(arrivals)))
    drain_s = time.monotonic() - (t0 + duration_s)
    await asyncio.sleep(0.3)  # the last searches' reports reach the queue
    searches = [s for s in stand_in.drain() if s[0] == arm]
    busy_after = await engine_busy(platform)
    metrics_after = await gateway_metrics(platform.gateway_http)
    busy = None if busy_before is None or busy_after is None else busy_after - busy_before
    result = analyse_run(outcomes, slo=slo, duration_s=duration_s, engine_busy_s=busy, searches=searches)
    result["drain_s"] = drain_s
    result["gateway_metrics"] = metric_changes(metrics_before, metrics_after)
    result["settled"] = settled(outcomes, slo=slo, duration_s=duration_s)
    return result


def settled(outcomes: list[Outcome], *, slo: Slo, duration_s: float) -> dict[str, Any]:
    """The requests that arrived in the second half of a run: the load step once the ladder had time to move (it
    moves one step per ladder_interval_s, on requests that have finished).

    >>> late = Outcome(3.0, status=200, completed=True, ttft_s=0.5, e2e_s=1.5, completion_tokens=11)
    >>> s = settled([Outcome(1.0, status=429, code="queue_full"), late], slo=Slo(1.0, 0.1), duration_s=4.0)
    >>> s["n"], s["share_within_slo"], s["goodput_tok_s"]
    (1, 1.0, 5.5)
    """
    half = duration_s / 2
    r = analyse_run([o for o in outcomes if o.scheduled_s >= half], slo=slo, duration_s=duration_s - half)
    r.pop("ttft_ms", None)
    r.pop("timeline", None)
    return r


def _line(label: str, r: dict[str, Any]) -> str:
    return (f"{label}: {r['met']}/{r['n']} within SLO ({(r['share_within_slo'] or 0):.0%}), goodput "
            f"{r['goodput_tok_s'] or 0:.1f} tok/s, served TTFT p50 {r['ttft']['p50_ms'] or 0:.0f} ms p95 "
            f"{r['ttft']['p95_ms'] or 0:.0f} ms, shed {r['shed']}, steps {r['degraded_steps'] or '-'}, "
            f"outcomes {r['outcomes']}")


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from goodput_contracts.access import IDENTITIES
    from goodput_core.tls import ensure_dev_pki

    from goodput_cli.plan import grpc_addr
    from goodput_cli.supervisor import Platform

    slo = Slo(args.slo_ttft_s, args.slo_tpot_s)
    cost = RetrievalCost(args.retrieval_base_s, args.retrieval_per_chunk_s, args.rerank_s, args.chunk_chars)
    run_id = secrets.token_hex(4)
    prefix = f"goodput:ladder-{run_id}"
    key = f"ladder-{secrets.token_hex(12)}"
    keys = [{"id": "ladder-bench", "key": key, "tenant": TENANT, "max_priority": "P0", "default_priority": "P0"}]
    knows = gateway_knows()
    report: dict[str, Any] = {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "benchmark": "ladder", "machine": machine_info(), "source": source_version(),
        "setup": {"workers": args.workers, "max_num_seqs": args.max_num_seqs, "sim": sim_config(args),
                  "question_chars": args.question_chars, "max_tokens": args.max_tokens, "top_k": args.top_k,
                  "retriever": {"stand_in": True, "base_s": cost.base_s, "per_chunk_s": cost.per_chunk_s,
                                "rerank_s": cost.rerank_s, "chunk_chars": cost.chunk_chars},
                  "latency_profile": latency_profile(args), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                  "multiples": args.multiples, "step_s": args.step_s, "ramp": args.ramp,
                  "ramp_s": args.ramp_s, "capacity_share": args.capacity_share, "seed": args.seed,
                  "quick": args.quick,
                  "gateway_settings_present": knows,
                  "goal": {"ratio": GOAL_RATIO, "multiple": GOAL_MULTIPLE}},
        "steps": [],
    }
    if not knows.get("ladder", False):
        print("warning: this gateway has no ladder_enabled setting: both arms run the same gateway", file=sys.stderr)
    offsets = {LADDER: args.port_offset, NO_LADDER: args.port_offset + ARM_SHIFT}
    workdirs = {arm: tempfile.TemporaryDirectory(prefix=f"goodput-ladder-{arm}-") for arm in ARMS}
    platforms = {arm: Platform(workdir=Path(workdirs[arm].name), workers=args.workers, port_offset=offsets[arm],
                               env=platform_env(args, arm, grpc_addr("retriever", offsets[arm]), f"{prefix}:{arm}"),
                               api_keys=keys, knowledge=False, cache=False, jobs=False, redis_db=args.redis_db)
                 for arm in ARMS}
    listen = []
    for arm, p in platforms.items():
        tls_dir = p.tls_dir
        if tls_dir is not None:
            ensure_dev_pki(tls_dir, IDENTITIES)  # the platform reuses them when it starts
        listen.append((arm, grpc_addr("retriever", offsets[arm]), None if tls_dir is None else str(tls_dir)))
    stand_in = StandIn(listen, cost)
    started: list[Any] = []
    try:
        t = time.monotonic()
        stand_in.start()
        for arm in ARMS:
            platforms[arm].start(timeout_s=180)
            started.append(platforms[arm])
        report["setup"]["start_s"] = time.monotonic() - t
        with Progress(not args.no_progress) as progress:
            base = platforms[NO_LADDER]
            # warm-up: both arms, a few requests one at a time (the first calls open channels)
            for arm in ARMS:
                warm = await drive(Traffic(platforms[arm].gateway_http, key, f"warm {arm}",
                                           tuple(0.4 * i for i in range(args.warmup_n)), time.monotonic(),
                                           args.question_chars, args.max_tokens))
                report.setdefault("warmup", {})[arm] = analyse_run(warm, slo=slo, duration_s=0.4 * args.warmup_n)
                report["warmup"][arm].pop("ttft_ms", None)
                report["warmup"][arm].pop("timeline", None)
                if not any(o.served for o in warm):
                    kinds = Counter(outcome_kind(o) for o in warm)
                    raise RuntimeError(f"{arm}: no warm-up request was served: {dict(kinds)} "
                                       f"({warm[0].message if warm else ''})")
            stand_in.drain()
            unloaded = report["warmup"][NO_LADDER]
            progress.print(f"unloaded ({NO_LADDER}): TTFT p50 {unloaded['ttft']['p50_ms'] or 0:.0f} ms, TPOT p50 "
                           f"{unloaded['tpot']['p50_ms'] or 0:.0f} ms, prompt {unloaded['prompt_tokens_mean'] or 0:.0f}"
                           f" tokens, SLO TTFT {slo.ttft_s * 1000:.0f} ms TPOT {slo.tpot_s * 1000:.0f} ms")
            # 1. capacity, on the arm without the ladder
            slots = args.workers * args.max_num_seqs
            tp = await throughput(base.gateway_http, key, concurrency=slots + 2, warmup_s=args.throughput_warmup_s,
                                  measure_s=args.throughput_s, question_chars=args.question_chars,
                                  max_tokens=args.max_tokens)
            stand_in.drain()
            if tp["rps"] <= 0:
                raise RuntimeError(f"the fleet completed nothing while measuring its throughput: {tp}")
            progress.print(f"throughput ({NO_LADDER}, {slots + 2} in flight): {tp['rps']:.2f} req/s")
            ramp = []
            for j, fraction in enumerate(args.ramp):
                rate = tp["rps"] * fraction
                arrivals = poisson(random.Random(f"{args.seed}-ramp-{j}"), rate, args.ramp_s)
                r = await run_arm(NO_LADDER, base, stand_in, args, key, arrivals=arrivals, tag=f"ramp {j} {run_id}",
                                  duration_s=args.ramp_s, slo=slo, progress=progress,
                                  label=f"ramp {fraction:.2f}x throughput")
                r.pop("ttft_ms", None)
                r.pop("timeline", None)
                ramp.append({"fraction": fraction, "rate_rps": rate, **r})
                progress.print(_line(f"ramp {fraction:.2f}x throughput, {r['offered_rps']:.2f} req/s offered", r))
                await asyncio.sleep(args.pause_s)
            cap, found = capacity_from_ramp(ramp, args.capacity_share)
            report["capacity"] = {"rps": cap, "found": found, "throughput": tp, "ramp": ramp,
                                  "share": args.capacity_share}
            progress.print(f"capacity: {cap:.2f} req/s ({'' if found else 'NOT '}at >= {args.capacity_share:.0%} "
                           "within SLO)")
            # 2. the steps, both arms on the same arrivals
            for k, multiple in enumerate(args.multiples):
                rate = cap * multiple
                arrivals = poisson(random.Random(f"{args.seed}-step-{k}"), rate, args.step_s)
                step: dict[str, Any] = {"multiple": multiple, "rate_rps": rate, "n": len(arrivals), "arms": {},
                                        "order": []}
                order = ARMS if k % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    r = await run_arm(arm, platforms[arm], stand_in, args, key, arrivals=arrivals,
                                      tag=f"step {k} {arm} {run_id}", duration_s=args.step_s, slo=slo,
                                      progress=progress, label=f"{multiple:g}x capacity, {arm}")
                    step["arms"][arm] = r
                    step["order"].append(arm)
                    progress.print(_line(f"{multiple:g}x {arm}", r))
                    await asyncio.sleep(args.pause_s)
                report["steps"].append(step)
    finally:
        for p in started:
            p.stop()
        stand_in.stop()
        try:
            delete_keys(platforms[LADDER].redis_url, prefix)
        except Exception as err:  # noqa: BLE001 - leftover keys under a unique prefix are harmless
            print(f"could not delete this run's Redis keys: {err}", file=sys.stderr)
        for w in workdirs.values():
            w.cleanup()
    report["headline"] = headline(report)
    return report


# ---- report ------------------------------------------------------------------------------------------------------

def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.1f}%"


def _num(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    if v is None:
        return "—"
    return "∞" if v == float("inf") else f"{v:.2f}x"


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("**MET**" if ok else "**MISSED**")


def _steps_cell(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in r["degraded_steps"].items()) or "—"


def _searches_cell(r: dict[str, Any]) -> str:
    s = r.get("searches")
    if not s:
        return "—"
    top_k = ", ".join(f"{k}: {v}" for k, v in s["top_k"].items())
    return f"{s['n']} ({s['reranked']} reranked; top_k {top_k})"


def _others(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in r["outcomes"].items() if k not in ("served", f"429 {SHED_CODE}")) or "—"


def headline_lines(report: dict[str, Any]) -> list[str]:
    h = report.get("headline")
    if not h:
        return ["No step with both arms: no headline."]
    rows = [["share of requests within SLO", _pct(h["share"][0]), _pct(h["share"][1]), _x(h["share_ratio"]),
             _verdict(h["share_met"])],
            ["goodput (output tokens/s of requests within SLO)", _num(h["goodput"][0], 1), _num(h["goodput"][1], 1),
             _x(h["goodput_ratio"]), _verdict(h["goodput_met"])]]
    st = h.get("settled")
    if st:
        rows += [["share within SLO, second half of the step", _pct(st["share"][0]), _pct(st["share"][1]),
                  _x(st["share_ratio"]), "(for reading)"],
                 ["goodput, second half of the step", _num(st["goodput"][0], 1), _num(st["goodput"][1], 1),
                  _x(st["goodput_ratio"]), "(for reading)"]]
    return [
        f"At **{h['multiple']:g}x capacity**, every request of the step (goal: ladder / no ladder ≥ {GOAL_RATIO:g}x "
        f"at {GOAL_MULTIPLE:g}x capacity):",
        "",
        markdown_table(["measure", "ladder", "no ladder", "ratio", "goal"], rows),
        "",
        "The goal is judged on the whole step, the ladder's reaction time included (the load rises step by step; "
        "the ladder moves one step per `ladder_interval_s` on requests that have finished). The second half of "
        "the step shows the load once the ladder had time to settle.",
    ]


def _gateway_cell(r: dict[str, Any]) -> str:
    """The gateway's own view of a run: its ladder's level and shed share at the end, and its SLO judgement."""
    g = r.get("gateway_metrics") or {}
    parts = []
    level = g.get("goodput_gateway_ladder_level{priority=P0}")
    shed = g.get("goodput_gateway_ladder_shed_share{priority=P0}")
    if level or shed:
        parts.append(f"level {level or 0:g}" + (f", shedding {shed:.0%}" if shed else ""))
    met = g.get("goodput_gateway_slo_requests_total{priority=P0,result=met}", 0)
    missed = g.get("goodput_gateway_slo_requests_total{priority=P0,result=missed}", 0)
    if met or missed:
        parts.append(f"met {met:g} / missed {missed:g}")
    expired = sum(v for k, v in g.items() if k.startswith("goodput_gateway_deadline_refusals_total"))
    if expired:
        parts.append(f"deadline refusals {expired:g}")
    return "; ".join(parts) or "—"


def render_markdown(report: dict[str, Any]) -> str:
    s, m = report["setup"], report["machine"]
    rc, sim = s["retriever"], s["sim"]
    cap = report.get("capacity") or {}
    knows = s.get("gateway_settings_present") or {}
    lines = [
        "# Degradation ladder: P0 RAG with a slow retrieval leg at rising load, ladder on vs off",
        "",
        f"Generated {report.get('generated_at', '')} by `python -m loadtests.ladder"
        f"{' --quick' if s.get('quick') else ''}`"
        + (f" at commit `{report['source']}`" if report.get("source") else "")
        + f" on **{cpu_label(m)}**, {m.get('cores_usable')} CPU cores usable, shared by everything below (platforms, "
        "stand-in retriever, load generator) and by other work on the machine: **numbers compare only within this "
        "run.**",
        "",
    ]
    if not knows.get("ladder", True):
        lines += ["> **The gateway this ran against had no `ladder_enabled` setting: both arms ran the same "
                  "gateway, and the comparison below measures nothing but noise.**", ""]
    lines += ["## Headline", "", *headline_lines(report), ""]
    lines += [
        "## Set-up",
        "",
        f"- Two platforms (`goodput_cli.supervisor.Platform`), each {s['workers']} simulated worker(s) "
        f"(`GOODPUT_INFERENCE_ENGINE=sim`, A100 / 7B calibration, simulated time x{sim['time_scale']:g}, "
        f"{sim['max_batched_tokens']} tokens per engine step, {s['max_num_seqs']} sequences per worker), the real "
        "scheduler and gateway, mutual TLS inside; identical settings except `GOODPUT_GATEWAY_LADDER__ENABLED` "
        "(`true`: arm *ladder*; `false`: arm *no ladder*). One platform carries load at a time; the arm that goes "
        "first alternates from step to step.",
        f"- **The retriever is a benchmark stand-in**, served by this module (not `goodput_retriever`): "
        f"`Retrieval/Search` sleeps {rc['base_s'] * 1000:.0f} ms + {rc['per_chunk_s'] * 1000:.0f} ms x top_k + "
        f"{rc['rerank_s'] * 1000:.0f} ms when asked to rerank, and answers top_k synthetic chunks of "
        f"{rc['chunk_chars']} characters derived from the query. The gateways ask for top_k = {s['top_k']} "
        "with rerank (`GOODPUT_GATEWAY_RAG__RERANK=true`); the ladder's `skip_rerank` drops the rerank, its "
        "`fewer_chunks` halves top_k (a shorter prompt, a cheaper prefill). The rerank runs under the caller's "
        "rerank budget, as the retriever's does. No response cache runs (`exact_cache_only` changes nothing) and "
        "the profile names no fallback model (`fallback_model` is a step that changes nothing).",
        "- Everything else is the platform's defaults: the scheduler's P0 queue (depth, queue-wait budget) and "
        "deadline prediction, the gateway's circuit breakers and ladder settings (`ladder_interval_s`, "
        "`ladder_raise_at`, `ladder_lower_at`). The arm without the ladder still has all of them.",
        f"- Traffic: P0 chat requests, streamed, each with `knowledge_base` (a RAG request), a unique question of "
        f"~{s['question_chars']} characters, {s['max_tokens']} output tokens; open-loop Poisson arrivals.",
        f"- Latency profile of both arms (`GOODPUT_GATEWAY_LATENCY_PROFILE`): `{json.dumps(s['latency_profile'])}`. "
        f"**SLO: TTFT ≤ {s['slo']['ttft_s'] * 1000:.0f} ms, TPOT ≤ {s['slo']['tpot_s'] * 1000:.0f} ms**, chosen "
        "for the simulated engine at this time scale (see the unloaded values below).",
        "- A request *met its SLO* when it was served (200 and the whole stream) with TTFT (client-side, to the "
        "first content delta) and TPOT (the rest of the stream over the output tokens after the first) within "
        "the SLO. *Share within SLO* = met / offered (a shed request counts as missed). *Goodput* = output tokens "
        "of the requests within SLO per second of the step; per engine-second divides by the workers' "
        "`goodput_worker_engine_busy_seconds_total` over the step.",
        "",
    ]
    warm = report.get("warmup") or {}
    if warm:
        lines += ["## Unloaded (warm-up, one request at a time)", "",
                  markdown_table(["arm", "n", "TTFT p50 ms", "TPOT p50 ms", "prompt tokens", "chunks", "steps"],
                                 [[arm, w["n"], _num(w["ttft"]["p50_ms"]), _num(w["tpot"]["p50_ms"]),
                                   _num(w["prompt_tokens_mean"]), _num(w["sources_mean"], 1), _steps_cell(w)]
                                  for arm, w in warm.items()]), ""]
    if cap:
        tp = cap["throughput"]
        lines += [
            "## Capacity (arm *no ladder*)",
            "",
            f"Throughput with {tp['concurrency']} requests in flight: **{tp['rps']:.2f} req/s** "
            f"({tp['completed_in_window']} completed in {tp['measure_s']:g} s after {tp['warmup_s']:g} s of "
            f"warm-up). Then {s['ramp_s']:g} s of Poisson arrivals at each fraction of it, rising; capacity = the "
            f"offered rate of the last before the first with less than {cap['share']:.0%} of the requests within "
            f"SLO: **{cap['rps']:.2f} req/s**"
            + ("" if cap["found"] else " (the first rate of the ramp missed it already: its rate is used)") + ".",
            "",
            markdown_table(["fraction of throughput", "offered req/s", "n", "within SLO", "TTFT p50 ms",
                            "TTFT p95 ms", "outcomes"],
                           [[f"{r['fraction']:.2f}", _num(r["offered_rps"], 2), r["n"], _pct(r["share_within_slo"]),
                             _num(r["ttft"]["p50_ms"]), _num(r["ttft"]["p95_ms"]),
                             ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())] for r in cap["ramp"]]),
            "",
        ]
    rows = []
    for st in report["steps"]:
        for arm in ARMS:
            r = st["arms"].get(arm)
            if not r:
                continue
            half = r.get("settled") or {}
            rows.append([f"{st['multiple']:g}x", arm.replace("_", " "), _num(r["offered_rps"], 2), r["n"],
                         _pct(r["share_within_slo"]), _num(r["goodput_tok_s"], 1),
                         _num(r["goodput_tok_per_engine_s"], 1), _pct(half.get("share_within_slo")),
                         _num(half.get("goodput_tok_s"), 1), _num(r["ttft"]["p50_ms"]), _num(r["ttft"]["p95_ms"]),
                         _pct(r["shed_share"]), _steps_cell(r), _others(r)])
    lines += ["## Per load step", "",
              "*second half*: the requests that arrived in the second half of the step.", "",
              markdown_table(["load", "arm", "offered req/s", "n", "within SLO", "goodput tok/s",
                              "goodput tok/engine-s", "within SLO, second half", "goodput tok/s, second half",
                              "TTFT p50 ms (served)", "TTFT p95 ms (served)", "shed",
                              "degradation steps taken (requests)", "other outcomes"], rows), ""]
    if report["steps"]:
        focus = min(report["steps"], key=lambda st: abs(st["multiple"] - GOAL_MULTIPLE))
        on, off = ((focus["arms"].get(arm) or {}).get("timeline") or [] for arm in ARMS)
        if on and off and len(on) == len(off):
            lines += [f"## The {focus['multiple']:g}x step over time", "",
                      "The step's requests by arrival time: how the ladder's moves show (it climbs one step per "
                      "`ladder_interval_s` on requests that have finished, and sheds 10% more per interval while "
                      "more than `ladder_raise_at` of them missed).", "",
                      markdown_table(["arrival s", "n", "ladder: within SLO", "ladder: shed", "ladder: degraded",
                                      "ladder: TTFT p50 ms", "no ladder: within SLO", "no ladder: TTFT p50 ms"],
                                     [[f"{a['t']:g}–{a['t'] + (on[1]['t'] - on[0]['t'] if len(on) > 1 else 0):g}",
                                       a["n"], f"{a['met']}", f"{a['shed']}", f"{a['degraded']}",
                                       _num(a["ttft_p50_ms"]), f"{b['met']}", _num(b["ttft_p50_ms"])]
                                      for a, b in zip(on, off, strict=True)]), ""]
    rows = []
    for st in report["steps"]:
        for arm in ARMS:
            r = st["arms"].get(arm)
            if not r:
                continue
            rows.append([f"{st['multiple']:g}x", arm.replace("_", " "), _num(r["retrieval_stage"]["p50_ms"]),
                         _num(r["prompt_tokens_mean"]), _num(r["sources_mean"], 1), _num(r["tpot"]["p50_ms"]),
                         _searches_cell(r), _num(r["client_lag_p99_ms"], 1), _num(r["drain_s"], 1),
                         _gateway_cell(r)])
    lines += ["## What each arm's requests cost", "",
              "Retrieval stage as the gateway timed it (`goodput_timing` on the last chunk), the prompt and chunks "
              "of the served requests, the searches the stand-in retriever received (how many reranked, by top_k), "
              "how late the load generator sent (p99; a generator short of CPU shows here), how long the last "
              "requests took after the arrivals ended, and the gateway's own view from its /metrics: its ladder's "
              "level and shed share at the end of the run, its SLO judgement of the answers it finished, the "
              "requests it refused for their deadline.", "",
              markdown_table(["load", "arm", "retrieval p50 ms", "prompt tokens", "chunks", "TPOT p50 ms",
                              "searches", "send lag p99 ms", "drain s", "gateway"], rows), ""]
    said = []
    for st in report["steps"]:
        for arm, r in st["arms"].items():
            told: Counter[str] = Counter()
            for m, n in r.get("messages") or ():
                told[_gist(m)] += n
            if told:
                said.append(f"- {st['multiple']:g}x, {arm.replace('_', ' ')}: "
                            + "; ".join(f"{m} ({n})" for m, n in told.most_common()))
    if said:
        lines += ["## What the requests not served were told", "",
                  "The most frequent refusals and errors other than the ladder's shed, with their messages.", "",
                  *said, ""]
    lines += [
        "## Reading it",
        "",
        "- Each step's arrivals are the same for both arms (same seed, same times; only the questions' text "
        "differs, so no arm reuses the other's prefix cache).",
        "- *shed* is the ladder's last step (429 `degraded_shed`); *other outcomes* are refusals by the scheduler "
        "(`queue_full`, `deadline_unreachable_now`), 504s of a passed deadline and the like: the arm without the "
        "ladder still has the scheduler's admission control and the deadlines.",
        "- Without the ladder, an overload fills the P0 queue (its depth, then its queue-wait budget): the requests "
        "served have waited for a worker about as long as the budget allows and miss the TTFT SLO, the others are "
        "refused. The ladder's first steps make each request cheaper (no rerank, half the chunks: a shorter "
        "retrieval and prefill), its last sheds a share of them at the gateway before they queue.",
        "- The ladder's level and shed share carry over from one step to the next (it moves only on finished "
        "requests): a step starts where the previous one left it, shedding hard after a heavier step, and a step "
        "that begins in overload spends its first seconds climbing while the queue is full. *The step over time* "
        "and the third panel of the plot show it; the result of one step depends on that state, so compare the "
        "arms step by step, not a step's number with another run's.",
        "- The plot `ladder.png` shows the share within SLO and the goodput of both arms against the load multiple "
        "(the second halves of the steps faint), and the 2x step over time.",
    ]
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    steps = report["steps"]
    if not steps:
        return None
    h = report.get("headline")
    focus = min(steps, key=lambda st: abs(st["multiple"] - GOAL_MULTIPLE))
    fig, (left, right, over_time) = plt.subplots(1, 3, figsize=(17, 4.8))
    for arm, style, color in ((LADDER, "o-", "tab:blue"), (NO_LADDER, "s--", "tab:green")):
        xs = [st["multiple"] for st in steps if arm in st["arms"]]
        share = [100 * (st["arms"][arm]["share_within_slo"] or 0.0) for st in steps if arm in st["arms"]]
        goodput = [st["arms"][arm]["goodput_tok_s"] or 0.0 for st in steps if arm in st["arms"]]
        label = arm.replace("_", " ")
        left.plot(xs, share, style, color=color, label=label)
        right.plot(xs, goodput, style, color=color, label=label)
        half = [st["arms"][arm].get("settled") or {} for st in steps if arm in st["arms"]]
        if all(half):
            faint = {"color": color, "alpha": 0.35, "linewidth": 1, "label": f"{label}, second half of each step"}
            left.plot(xs, [100 * (h["share_within_slo"] or 0.0) for h in half], style, **faint)
            right.plot(xs, [h["goodput_tok_s"] or 0.0 for h in half], style, **faint)
        buckets = (focus["arms"].get(arm) or {}).get("timeline") or []
        if buckets:
            ts = [b["t"] for b in buckets]
            over_time.plot(ts, [100 * b["met"] / b["n"] if b["n"] else 0.0 for b in buckets], style,
                           color=color, label=f"{label}: within SLO")
            if arm == LADDER:
                over_time.plot(ts, [100 * b["shed"] / b["n"] if b["n"] else 0.0 for b in buckets], ":",
                               color="grey", label=f"{label}: shed")
    for ax in (left, right):
        ax.axvline(GOAL_MULTIPLE, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("offered load (x capacity)")
    for ax in (left, right, over_time):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    left.set_ylabel("requests within SLO (%)")
    left.set_ylim(0, 105)
    right.set_ylabel("goodput (output tokens/s within SLO)")
    right.set_ylim(bottom=0)
    over_time.set_xlabel(f"arrival within the {focus['multiple']:g}x step (s, buckets)")
    over_time.set_ylabel("share of the bucket's requests (%)")
    over_time.set_ylim(0, 105)
    over_time.set_title(f"the {focus['multiple']:g}x step over time")
    if h:
        left.set_title(f"share within SLO; at {h['multiple']:g}x: {_x(h['share_ratio'])}")
        right.set_title(f"goodput; at {h['multiple']:g}x: {_x(h['goodput_ratio'])}")
    s = report["setup"]
    fig.suptitle(f"P0 RAG, ladder on vs off: {s['workers']} simulated workers, SLO TTFT {s['slo']['ttft_s']:g} s, "
                 f"TPOT {s['slo']['tpot_s']:g} s ({cpu_label(report['machine'])})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m loadtests.ladder", description=doc.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="simulated workers per platform")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per worker (and the scheduler's per-worker cap)")
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="simulated time multiplier: a slower simulated GPU keeps the request rates (and so the "
                         "CPU the gateway and the load generator need) small")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="the engines' token budget per step")
    ap.add_argument("--stream-every", type=int, default=4, help="the engines stream every this many tokens")
    ap.add_argument("--question-chars", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8, help="chunks the gateways ask for (GOODPUT_GATEWAY_RAG__TOP_K)")
    ap.add_argument("--chunk-chars", type=int, default=400)
    ap.add_argument("--retrieval-base-s", type=float, default=0.080)
    ap.add_argument("--retrieval-per-chunk-s", type=float, default=0.010)
    ap.add_argument("--rerank-s", type=float, default=0.150)
    ap.add_argument("--slo-ttft-s", type=float, default=2.0, help="P0 SLO: time to first token")
    ap.add_argument("--slo-tpot-s", type=float, default=0.15, help="P0 SLO: time per output token")
    ap.add_argument("--retrieval-budget-s", type=float, default=0.5,
                    help="P0 retrieval budget (the hop's timeout; a search over it counts as a miss for the ladder)")
    ap.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0],
                    help="load steps, in multiples of the measured capacity")
    ap.add_argument("--step-s", type=float, default=40.0, help="seconds of arrivals per step and arm")
    ap.add_argument("--ramp", type=float, nargs="+", default=[0.5, 0.65, 0.8, 0.9, 1.0, 1.1],
                    help="the capacity ramp's rates, rising, in fractions of the measured throughput")
    ap.add_argument("--ramp-s", type=float, default=10.0, help="seconds of arrivals per rate of the ramp")
    ap.add_argument("--capacity-share", type=float, default=0.9,
                    help="capacity: the ramp's offered rate before the first with less than this share of requests "
                         "within SLO")
    ap.add_argument("--throughput-s", type=float, default=10.0)
    ap.add_argument("--throughput-warmup-s", type=float, default=5.0)
    ap.add_argument("--warmup-n", type=int, default=8, help="requests one at a time per arm before measuring")
    ap.add_argument("--pause-s", type=float, default=1.0, help="quiet time between runs")
    ap.add_argument("--port-offset", type=int, default=PORT_OFFSET,
                    help=f"the ladder arm's platform; the other's is {ARM_SHIFT} above")
    ap.add_argument("--redis-db", type=int, default=None, help="Redis database (default: the URL's, 0)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("loadtests/out/ladder"))
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (lines only)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 worker, one ramp rate, steps at 1x and 2x of a few seconds each (~1.5 min)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON", help="re-render a saved report")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.multiples, args.step_s, args.ramp, args.ramp_s = 1, [1.0, 2.0], 4.0, [0.8], 3.0
        args.throughput_s, args.throughput_warmup_s, args.warmup_n, args.pause_s = 4.0, 3.0, 2, 0.3
    return args


def served(report: dict[str, Any]) -> int:
    return sum(r["served"] for st in report["steps"] for r in st["arms"].values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = produce(args, benchmark, render_markdown, render_plot)
    print(f"CPU: {cpu_label(report['machine'])}")
    h = report.get("headline")
    if h:
        for what, ratio, ok in (("share within SLO", h["share_ratio"], h["share_met"]),
                                ("goodput", h["goodput_ratio"], h["goodput_met"])):
            verdict = "MET" if ok else "MISSED" if ok is not None else "?"
            print(f"  {verdict:6} {what}: ladder / no ladder = {_x(ratio)} at {h['multiple']:g}x capacity "
                  f"(goal >= {GOAL_RATIO:g}x)")
    return 0 if served(report) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
