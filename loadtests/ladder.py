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
``goodput_worker_engine_busy_seconds_total``). The goals: ladder / no ladder of both at 2x capacity >= 1.5x,
over every request of the step: the ladder's reaction time counts (it moves one step per
``ladder_interval_s`` on finished requests, and starts a step at the level the previous one left); the requests of
each step's second half are reported beside it.

    python -m loadtests.ladder                                  # 2 workers, ~10 min on 2 cores, ports +4100/+4140
    python -m loadtests.ladder --out loadtests/reports/ladder   # the reference run
    python -m loadtests.ladder --quick                          # a smoke run (1 worker, 2 short steps)
    python -m loadtests.ladder --render loadtests/reports/ladder.json   # the report again (templates/ladder.md)

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
from pathlib import Path
from typing import Any

import httpx

from loadtests import bench
from loadtests.common import cpu_label, machine_info, percentile, summarize
from loadtests.simfleet import random_text

__all__ = ["ARMS", "BENCHMARK", "Outcome", "RetrievalCost", "Slo", "analyse_run", "capacity_from_ramp", "focus",
           "goals", "main", "settled", "stand_in_hits", "timeline"]

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


def focus(report: dict[str, Any]) -> dict[str, Any] | None:
    """The step the goals judge: the one nearest the goal's load multiple (2x capacity), None without steps.

    >>> focus({"steps": [{"multiple": 1.0}, {"multiple": 1.5}, {"multiple": 3.0}]})
    {'multiple': 1.5}
    """
    multiple = ((report.get("setup") or {}).get("goal") or {}).get("multiple", GOAL_MULTIPLE)
    return min(report.get("steps") or (), key=lambda st: abs(st["multiple"] - multiple), default=None)


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """Ladder / no ladder at the focus step, every request of it: share within SLO and goodput, each against the
    ratio the report's run was held to (>= 1.5x)."""
    goal = {"ratio": GOAL_RATIO, "multiple": GOAL_MULTIPLE, **((report.get("setup") or {}).get("goal") or {})}

    def at(key: str) -> Any:
        def measure(r: dict[str, Any]) -> tuple[float | None, float | None]:
            arms = (focus(r) or {})["arms"]  # no step: a KeyError, the goal unjudged
            return arms[LADDER][key], arms[NO_LADDER][key]
        return measure

    where = f"at {goal['multiple']:g}x capacity: ladder ≥ {goal['ratio']:g}x no ladder"
    return [bench.Goal(f"share of requests within SLO {where}", at("share_within_slo"), goal["ratio"],
                       judged="ratio", unit="%", digits=1),
            bench.Goal(f"goodput (output tokens/s of requests within SLO) {where}", at("goodput_tok_s"),
                       goal["ratio"], judged="ratio", unit="tok/s", digits=1)]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """The focus step, and its second half's ratios ladder / no ladder (inf: the arm without the ladder had none)."""
    step = focus(report)
    half = [((step or {}).get("arms", {}).get(arm) or {}).get("settled") or {} for arm in ARMS]
    return {"arms": ARMS, "focus": step,
            "half_ratio": {k: _ratio(half[0].get(k), half[1].get(k)) for k in ("share_within_slo", "goodput_tok_s")}}


def figure(report: dict[str, Any]) -> bench.Figure | None:
    """Share within SLO and goodput of both arms against the load multiple (the steps' second halves dotted; the
    titles: the ratio at the focus step), and the focus step over time."""
    steps, step = report["steps"], focus(report)
    if step is None:
        return None
    m, s = step["multiple"], report["setup"]
    panels = []
    for key, scale, title, ylabel in (("share_within_slo", 100, "share within SLO", "requests within SLO (%)"),
                                      ("goodput_tok_s", 1, "goodput", "goodput (output tokens/s within SLO)")):
        series = []
        for arm, style, color, light in ((LADDER, "-", "tab:blue", "#9ecae1"), (NO_LADDER, "--", "tab:green",
                                                                               "#a1d99b")):
            runs = [(st["multiple"], st["arms"][arm]) for st in steps if arm in st["arms"]]
            xs, label = [x for x, _ in runs], arm.replace("_", " ")
            series.append(bench.Series(label, xs, [scale * (r[key] or 0.0) for _, r in runs], style, color))
            if all(r.get("settled") for _, r in runs):
                series.append(bench.Series(f"{label}, second half of each step", xs,
                                           [scale * (r["settled"][key] or 0.0) for _, r in runs], ":", light))
        v = _ratio((step["arms"].get(LADDER) or {}).get(key), (step["arms"].get(NO_LADDER) or {}).get(key))
        ratio = "—" if v is None else "∞" if v == float("inf") else f"{v:.2f}x"
        panels.append(bench.Panel(f"{title}; at {m:g}x: {ratio}", "offered load (x capacity)", ylabel, series,
                                  vlines=[(m, "", ":", "grey")]))
    over_time = []
    for arm, what, style, color in ((LADDER, "met", "-", "tab:blue"), (LADDER, "shed", ":", "grey"),
                                    (NO_LADDER, "met", "--", "tab:green")):
        buckets = (step["arms"].get(arm) or {}).get("timeline") or []
        over_time.append(bench.Series(f"{arm.replace('_', ' ')}: {'within SLO' if what == 'met' else what}",
                                      [b["t"] for b in buckets], [100 * b[what] / b["n"] if b["n"] else 0.0
                                                                  for b in buckets], style, color))
    panels.append(bench.Panel(f"the {m:g}x step over time", f"arrival within the {m:g}x step (s, buckets)",
                              "share of the bucket's requests (%)", over_time))
    return bench.Figure(f"P0 RAG, ladder on vs off: {s['workers']} simulated workers, SLO TTFT "
                        f"{s['slo']['ttft_s']:g} s, TPOT {s['slo']['tpot_s']:g} s ({cpu_label(report['machine'])})",
                        panels, panel_width=5.7)


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


async def gateway_metrics(metrics_url: str) -> dict[str, float]:
    """The gateway's ladder, SLO and deadline metrics, by name and labels (the tenant and model labels left out):
    counters (``*_total``) and gauges (the ladder's level and shed share)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(metrics_url)).text
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
    metrics_before = await gateway_metrics(platform.gateway_metrics)
    t0 = time.monotonic() + 0.3
    traffic = Traffic(platform.gateway_http, key, tag, arrivals, t0, args.question_chars, args.max_tokens)
    outcomes = await drive(traffic, progress.task(label, len(arrivals)))
    drain_s = time.monotonic() - (t0 + duration_s)
    await asyncio.sleep(0.3)  # the last searches' reports reach the queue
    searches = [s for s in stand_in.drain() if s[0] == arm]
    busy_after = await engine_busy(platform)
    metrics_after = await gateway_metrics(platform.gateway_metrics)
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
        "machine": machine_info(), "source": source_version(),
        "setup": {"workers": args.workers, "max_num_seqs": args.max_num_seqs, "sim": sim_config(args),
                  "question_chars": args.question_chars, "max_tokens": args.max_tokens, "top_k": args.top_k,
                  "retriever": {"stand_in": True, "base_s": cost.base_s, "per_chunk_s": cost.per_chunk_s,
                                "rerank_s": cost.rerank_s, "chunk_chars": cost.chunk_chars},
                  "latency_profile": latency_profile(args), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                  "multiples": args.levels, "step_s": args.step_s, "ramp": args.ramp,
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
            tp = await throughput(base.gateway_http, key, concurrency=slots + 2, warmup_s=args.warmup_s,
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
            for k, multiple in enumerate(args.levels):
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
    return report


# ---- the command line (the report's prose: templates/ladder.md) ----------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
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
    ap.add_argument("--step-s", type=float, default=40.0, help="seconds of arrivals per step and arm")
    ap.add_argument("--ramp", type=float, nargs="+", default=[0.5, 0.65, 0.8, 0.9, 1.0, 1.1],
                    help="the capacity ramp's rates, rising, in fractions of the measured throughput")
    ap.add_argument("--ramp-s", type=float, default=10.0, help="seconds of arrivals per rate of the ramp")
    ap.add_argument("--capacity-share", type=float, default=0.9,
                    help="capacity: the ramp's offered rate before the first with less than this share of requests "
                         "within SLO")
    ap.add_argument("--throughput-s", type=float, default=10.0)
    ap.add_argument("--warmup-n", type=int, default=8, help="requests one at a time per arm before measuring")
    ap.add_argument("--pause-s", type=float, default=1.0, help="quiet time between runs")
    ap.add_argument("--port-offset", type=int, default=PORT_OFFSET,
                    help=f"the ladder arm's platform; the other's is {ARM_SHIFT} above")
    ap.add_argument("--redis-db", type=int, default=None, help="Redis database (default: the URL's, 0)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (lines only)")


BENCHMARK = bench.Benchmark(
    name="ladder", doc=__doc__ or "", run=benchmark, arguments=add_arguments, goals=goals, context=context,
    figure=figure, seed=7,
    levels=bench.Option("0.5,1,1.5,2,3", "load steps, in multiples of the measured capacity",
                        aliases=("--multiples",)),
    warmup=bench.Option(5.0, "seconds of the throughput's closed loop before it is measured (not counted)",
                        aliases=("--throughput-warmup-s",)),
    quick={"workers": 1, "levels": [1.0, 2.0], "step_s": 4.0, "ramp": [0.8], "ramp_s": 3.0, "throughput_s": 4.0,
           "warmup_s": 3.0, "warmup_n": 2, "pause_s": 0.3},
    quick_help="a smoke run: 1 worker, one ramp rate, steps at 1x and 2x of a few seconds each (~1.5 min)",
    ok=lambda report, args: sum(r["served"] for st in report["steps"] for r in st["arms"].values()) > 0,
    reports=("ladder",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
