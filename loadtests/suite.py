"""What the load suite's four benchmarks (``stairstep``, ``long_context``, ``multiturn``, ``shared_prefix``) share:
the engine they run on, the P0 SLO they judge by, latencies in engine time, goodput, the client loops (closed-loop
streams, open-loop Poisson arrivals), the declaration on the skeleton (:func:`declare`) and the plot's title;
the report's opening paragraph is ``templates/_suite.md``.

Each benchmark runs on one of two engines, both behind the real worker and scheduler processes
(:class:`loadtests.simfleet.SimFleet`; the client does per request what the gateway does: lease -> stream ->
release):

* ``sim`` (default): simulated A100-80GB / 7B workers (``goodput_inference.sim_engine``) *at scale* (several
  workers, hundreds of streams). The simulated GPU runs ``time_scale`` times slower than an A100 so that two CPU
  cores keep up with the gRPC traffic; every latency the reports give is wall-clock / ``time_scale`` (engine time,
  the platform's own overhead divided likewise) and every rate is per engine-time second.
* ``vllm``: the real CPU engine (vLLM's CPU build) with the dev model SmolLM2-135M-Instruct (float32), *at small
  scale*: one worker, few streams, short answers; wall-clock as measured.

The P0 SLO is the gateway's: its default latency profile for ``sim`` (an A100-class fleet), the local CPU profile
(``goodput_cli.plan.LOCAL_LATENCY_PROFILE``, what ``goodput up`` gives the gateway) for ``vllm``.

Example:
    >>> slo = p0_slo("sim")
    >>> (slo.ttft_s, slo.tpot_s)
    (2.0, 0.1)
    >>> s = Sample(arrival=0.0, ttft_s=0.5, tpot_s=0.05, tokens=64, prompt_tokens=512, cached_tokens=0)
    >>> slo.met(s), slo.met(Sample(0.0, 2.5, 0.05, 64, 512, 0))
    (True, False)
    >>> stats = latency_stats([s, Sample(0.0, 2.5, 0.05, 64, 512, 0)], slo, window_s=10.0)
    >>> stats["attainment"], stats["goodput_rps"], stats["goodput_tokens_per_s"]
    (0.5, 0.1, 6.4)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio

from loadtests import bench
from loadtests.common import summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result, SimFleet, random_text

__all__ = ["CHARS_PER_TOKEN", "ENGINES", "LOGS", "Engine", "Sample", "Slo", "closed_loop", "declare", "engine_for",
           "figure_title", "fleet", "latency_stats", "open_loop", "p0_slo", "prompt_of", "samples", "worker_info"]

LOGS = Path("loadtests/out/logs")  # the fleet processes' logs (not committed), a folder per benchmark
DEV_MODEL = "SmolLM2-135M-Instruct (the dev model, float32)"
# Characters per prompt token: the sim engine counts 4; the dev model's tokenizer makes ~3.4 of random_text's words
# (measured), so 3.3 keeps a prompt meant to fill the window inside it.
CHARS_PER_TOKEN = {"sim": 4.0, "vllm": 3.3}


@dataclass(frozen=True)
class Slo:
    """A class's SLO: TTFT and mean time per output token after the first (engine time)."""

    ttft_s: float
    tpot_s: float
    source: str

    def met(self, s: Sample) -> bool:
        return s.ttft_s <= self.ttft_s and (s.tpot_s is None or s.tpot_s <= self.tpot_s)


def p0_slo(engine: str) -> Slo:
    """The P0 SLO the benchmarks judge by: the gateway's default latency profile (sim), the local CPU profile
    that ``goodput up`` gives the gateway (vllm)."""
    from goodput_gateway.profile import LatencyProfile

    if engine == "vllm":
        from goodput_cli.plan import LOCAL_LATENCY_PROFILE

        slo = LatencyProfile.model_validate(LOCAL_LATENCY_PROFILE).P0.slo
        return Slo(slo.ttft_s, slo.tpot_s, "the local CPU profile (`goodput_cli.plan.LOCAL_LATENCY_PROFILE`)")
    slo = LatencyProfile().P0.slo
    return Slo(slo.ttft_s, slo.tpot_s, "the gateway's default latency profile (`goodput_gateway.profile`)")


@dataclass(frozen=True)
class Sample:
    """One served request in engine time (wall-clock / time scale): TTFT, TPOT (None with fewer than 2 tokens),
    output and prompt tokens, and the prompt tokens the prefix cache served."""

    arrival: float  # the client's monotonic clock (wall), to place it in a window
    ttft_s: float
    tpot_s: float | None
    tokens: int
    prompt_tokens: int
    cached_tokens: int


def samples(results: Sequence[Result], scale: float) -> list[Sample]:
    """The served requests (outcome ok, a first token) as :class:`Sample`; TPOT from the first to the last streamed
    token (``Result.deltas``).

    >>> spec = RequestSpec("r", "P0", "t", "x", 9, 1)
    >>> r = Result(spec, 5.0, "ok", ttft_s=0.2, e2e_s=1.05, deltas=[(0.2, 1), (0.6, 5), (1.0, 9)])
    >>> s = samples([r], scale=2.0)[0]
    >>> s.ttft_s, s.tpot_s, s.tokens
    (0.1, 0.05, 9)
    """
    out = []
    for r in results:
        if r.outcome != "ok" or r.ttft_s is None or not r.deltas:
            continue
        (t0, _), (t1, n) = r.deltas[0], r.deltas[-1]
        out.append(Sample(arrival=r.arrival, ttft_s=r.ttft_s / scale,
                          tpot_s=(t1 - t0) / (n - 1) / scale if n > 1 else None, tokens=n,
                          prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens))
    return out


def latency_stats(served: Sequence[Sample], slo: Slo, *, window_s: float, offered: int | None = None) -> dict[str, Any]:
    """TTFT and TPOT percentiles (ms), the share within the SLO (of ``offered``, default the served), goodput
    (requests and output tokens within the SLO per second of ``window_s``, engine time) and throughput."""
    good = [s for s in served if slo.met(s)]
    n = len(served) if offered is None else offered
    prompt = sum(s.prompt_tokens for s in served)
    return {
        "offered": n, "served": len(served), "ttft": summarize([s.ttft_s for s in served]),
        "tpot": summarize([s.tpot_s for s in served if s.tpot_s is not None]),
        "attainment": len(good) / n if n else None,
        "goodput_rps": len(good) / window_s if window_s > 0 else None,
        "goodput_tokens_per_s": sum(s.tokens for s in good) / window_s if window_s > 0 else None,
        "throughput_rps": len(served) / window_s if window_s > 0 else None,
        "output_tokens_per_s": sum(s.tokens for s in served) / window_s if window_s > 0 else None,
        "cached_share": sum(s.cached_tokens for s in served) / prompt if prompt else None,
    }


# ---- the engine --------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """What the fleet runs on and at which scale: ``scale`` divides every wall-clock duration into engine time."""

    name: str  # "sim" or "vllm"
    workers: int
    max_num_seqs: int
    max_model_len: int
    sim: dict[str, Any]
    worker_env: dict[str, str]

    @property
    def scale(self) -> float:
        return float(self.sim.get("time_scale", 1.0)) if self.name == "sim" else 1.0

    @property
    def chars_per_token(self) -> float:
        return CHARS_PER_TOKEN[self.name]

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"engine": self.name, "workers": self.workers, "max_num_seqs": self.max_num_seqs,
                             "max_model_len": self.max_model_len, "scale": self.scale}
        if self.name == "sim":
            d["sim"] = self.sim
        d["worker_env"] = self.worker_env
        return d


ENGINES = ("sim", "vllm")


def engine_for(args: argparse.Namespace, *, max_batched_tokens: int | None = None, stream_every: int = 8,
               worker_env: dict[str, str] | None = None) -> Engine:
    """The :class:`Engine` of the parsed arguments (``--engine``, ``--workers``, ``--max-num-seqs``,
    ``--max-model-len``, ``--time-scale``); ``max_batched_tokens`` is the sim's step budget or vLLM's
    max_num_batched_tokens (None: the engine's default)."""
    env = dict(worker_env or {})
    if args.engine == "vllm":
        env.setdefault("GOODPUT_INFERENCE_KV_CACHE_SPACE_GB", "1")
        if max_batched_tokens:
            env["GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS"] = str(max_batched_tokens)
        sim: dict[str, Any] = {}
    else:
        sim = {"time_scale": args.time_scale, "stream_every": stream_every}
        if max_batched_tokens:
            sim["max_batched_tokens"] = max_batched_tokens
    return Engine(args.engine, args.workers, args.max_num_seqs, args.max_model_len, sim, env)


@asynccontextmanager
async def fleet(engine: Engine, *, base_port: int, logdir: Path, scheduler_env: dict[str, str] | None = None,
                name: str = "scheduler") -> Any:
    """The engine's workers and a scheduler in front of them (``scheduler_env`` overrides, without the
    ``GOODPUT_SCHEDULER_`` prefix), ready; stopped on exit."""
    with SimFleet(workers=engine.workers, base_port=base_port, sim=engine.sim, max_num_seqs=engine.max_num_seqs,
                  max_model_len=engine.max_model_len, logdir=logdir, engine=engine.name,
                  worker_env=engine.worker_env) as f:
        f.start_scheduler(dict(scheduler_env or {}), name=name)
        await f.wait_ready(timeout_s=900 if engine.name == "vllm" else 60)
        yield f


async def worker_info(f: SimFleet) -> list[dict[str, Any]]:
    """Each worker's model, engine and step budget as it reports them (no file-system paths)."""
    out = []
    for addr in f.worker_addrs:
        async with aio.insecure_channel(addr) as channel:
            info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest(),
                                                                                 timeout=10)
        out.append({"served_model_name": info.served_model_name, "engine": info.engine,
                    "max_model_len": info.max_model_len, "max_num_batched_tokens": info.max_num_batched_tokens})
    return out


def prompt_of(rng: random.Random, tokens: int, engine: Engine, *, head: str = "") -> str:
    """A prompt of about ``tokens`` tokens on the engine: ``head`` (counted) then random words."""
    chars = int(tokens * engine.chars_per_token)
    return head + random_text(rng, max(chars - len(head), 1))


# ---- client loops ------------------------------------------------------------------------------------------------


async def closed_loop(client: LeaseClient, make: Callable[[int], RequestSpec], *, until: Callable[[], bool],
                      sink: list[Result], retry_s: float = 0.5) -> None:
    """One stream: requests back to back (``make(i)`` the i-th) until ``until()``, each result appended to ``sink``
    as it finishes; a request not served is followed by the next after the scheduler's Retry-After, else
    ``retry_s`` (a closed loop must not spin on refusals)."""
    i = 0
    while not until():
        r = await client.run(make(i))
        sink.append(r)
        i += 1
        if r.outcome != "ok":
            await asyncio.sleep(r.retry_after_s[-1] if r.retry_after_s else retry_s)


async def open_loop(client: LeaseClient, specs: Iterator[RequestSpec], *, rate: float, duration_s: float,
                    rng: random.Random, drain_timeout_s: float = 600.0) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate`` per (wall) second for ``duration_s``, each the next of ``specs``; waits for
    them (up to ``drain_timeout_s``, the rest counted ``unfinished``). Returns the results and the first arrival."""
    tasks: list[asyncio.Task[Result]] = []
    start = time.monotonic()
    t = start
    while True:
        t += rng.expovariate(rate)
        if t - start > duration_s:
            break
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.run(next(specs))))
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (set(), set())
    for p in pending:
        p.cancel()
    results = [t.result() for t in tasks if t in done]
    results += [Result(spec=RequestSpec("?", "P0", "?", "", 0, 0), arrival=start, outcome="unfinished")
                for _ in pending]
    return results, start


# ---- arguments and report ----------------------------------------------------------------------------------------


def declare(name: str, doc: str, run: Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]], *,
            presets: dict[str, dict[str, Any]], base_port: int, arguments: Callable[[argparse.ArgumentParser], None],
            figure: Callable[[dict[str, Any]], bench.Figure | None], ok: Callable[[dict[str, Any]], bool],
            context: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
            prepare: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
            goals: Sequence[bench.Goal] | Callable[[dict[str, Any]], Sequence[bench.Goal]] = ()) -> bench.Benchmark:
    """A load-suite benchmark on the skeleton: ``--engine sim|vllm``, the fleet's options (None: the engine's preset,
    ``presets["sim"]`` or ``["vllm"]``), ``--max-model-len``, ``--smoke`` (``presets["smoke"]`` where the command
    line left an option unset) and the report at ``loadtests/out/<name>-<engine>``; its template includes
    ``_suite.md``, the opening paragraph."""
    def arguments_(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--max-model-len", type=int, default=None, help="the context window (default: the preset)")
        arguments(ap)

    def prepare_(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        for k, v in presets[args.engine].items():
            if getattr(args, k, None) is None:
                setattr(args, k, v)
        if prepare is not None:
            prepare(ap, args)

    return bench.Benchmark(
        name=name, doc=doc, run=run, arguments=arguments_, prepare=prepare_, goals=goals, figure=figure,
        context=lambda report: {"dev_model": DEV_MODEL, **(context(report) if context is not None else {})},
        engines=ENGINES, engine_help="sim: simulated A100 / 7B workers at scale (default); vllm: the real CPU "
                                     "engine with the dev model at small scale (one worker; starting it takes a minute "
                                     "or two)",
        fleet=bench.Fleet(workers=None, max_num_seqs=None, time_scale=2.0, base_port=base_port), seed=20,
        quick={"engine": "sim", **presets["smoke"]}, quick_help="tiny and fast, on the sim engine (the test)",
        out="loadtests/out/{name}-{engine}", ok=lambda report, args: ok(report),
        reports=tuple(f"{name}-{engine}" for engine in ENGINES))


def figure_title(report: dict[str, Any], title: str) -> str:
    """A suite plot's title: what ran (the simulated fleet in A100 time, or the CPU engine)."""
    e = report["engine"]
    return (f"{title}: {e['workers']} simulated A100/7B worker(s) (A100 time)" if e["engine"] == "sim"
            else f"{title}: {e['workers']} vLLM CPU worker(s), the dev model")
