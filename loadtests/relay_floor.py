"""The floor under the gateway's added latency: a bare grpc.aio relay, the least any Python gRPC gateway does per token,
against calling its upstream directly, in the same run.

The upstream streams every request's tokens on an engine's cadence: a ``started`` message, then one delta per stream
at each step boundary (all open streams' tokens together, as a batched engine's step emits them), the step as long as
the simulated engine's with that many sequences in its batch (``goodput_inference.sim_engine``: 12 ms + 0.3 ms per
sequence, so the overhead benchmark's levels relay as many tokens per second as here).
The relay is one grpc.aio process with no auth, no lease and no logic: for each call it opens a ``Generate`` call to
the upstream on one shared channel and yields every message it reads, unchanged. Both speak the gateway's own
``Inference`` protocol in plaintext, on uvloop, as the services do. Where there are two cores or more, the relay runs
alone on the last one (as ``overhead --gateway-cores`` places the gateway) and the client and the upstream on the
others. Each round measures the direct path, then the relay, at every level; the report gives per level the relay's
added TTFT and ITL p50 (relay minus direct, per round and their median) and the relay's CPU per relayed message.

What the gateway adds beyond this floor is its own work; what the floor adds is grpc.aio's: every message read and
written is a completion that grpc's poller thread hands to the event loop, and one core relays a step's tokens for
every stream one after another.

    python -m loadtests.relay_floor --out loadtests/reports/relay-floor      # 1, 8, 32, 128 streams, ~2 min
    python -m loadtests.relay_floor --smoke                                  # the test: 1 and 2 streams
    python -m loadtests.relay_floor --render loadtests/reports/relay-floor.json  # templates/relay_floor.md
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc

from goodput_core.clients import GRPC_EXPERIMENTS

from loadtests import bench
from loadtests.common import cpu_label, cpu_seconds, free_port_block, machine_info, package_versions

__all__ = ["BENCHMARK", "main"]

GOAL_TTFT_MS, GOAL_ITL_MS = 2.0, 0.2  # the gateway's goals (issue: a gateway fast path)


def _serve(servicer: inference_pb2_grpc.InferenceServicer, port: int) -> None:
    """Serves ``servicer`` in plaintext on ``port`` until the process is killed, on uvloop (as the services run)."""
    import uvloop
    from grpc import aio

    async def serve() -> None:
        server = aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


def _serve_upstream(port: int, step_base_s: float, step_per_stream_s: float, tokens: int, cores: list[int]) -> None:
    """The engine stand-in: each call's tokens at the step boundaries shared by every call, the step as long as the
    calls open make it."""
    from grpc import aio

    if cores:
        os.sched_setaffinity(0, cores)

    class Upstream(inference_pb2_grpc.InferenceServicer):
        open = 0

        async def Generate(self, request: inference_pb2.GenerateRequest,  # noqa: N802 (gRPC's name)
                           context: aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateChunk]:
            yield inference_pb2.GenerateChunk(started=inference_pb2.Started(prompt_tokens=8, worker_id="upstream"))
            Upstream.open += 1
            try:
                for i in range(request.sampling.max_tokens or tokens):
                    step = step_base_s + step_per_stream_s * Upstream.open
                    await asyncio.sleep(step - time.monotonic() % step)  # the next step, the same for every stream
                    yield inference_pb2.GenerateChunk(delta=inference_pb2.Delta(text=" tok", completion_tokens=i + 1))
            finally:
                Upstream.open -= 1

    _serve(Upstream(), port)  # type: ignore[abstract]


def _serve_relay(port: int, upstream: int, cores: list[int]) -> None:
    """The bare relay: every message of the upstream's call forwarded as it comes."""
    from grpc import aio

    if cores:
        os.sched_setaffinity(0, cores)

    class Relay(inference_pb2_grpc.InferenceServicer):
        stub: inference_pb2_grpc.InferenceStub | None = None

        async def Generate(self, request: inference_pb2.GenerateRequest,  # noqa: N802 (gRPC's name)
                           context: aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateChunk]:
            if self.stub is None:  # one channel for every call, made on the serving loop
                self.stub = inference_pb2_grpc.InferenceStub(aio.insecure_channel(f"127.0.0.1:{upstream}"))
            call = self.stub.Generate(request)
            while (message := await call.read()) is not aio.EOF:
                yield message

    _serve(Relay(), port)  # type: ignore[abstract]


async def _load(port: int, streams: int, requests: int, tokens: int) -> dict[str, Any]:
    """``streams`` closed-loop streams sending ``requests`` requests in all; TTFT and ITL of every request."""
    from grpc import aio

    ttft: list[float] = []
    itl: list[float] = []
    left = requests
    messages = 0
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def stream() -> None:
            nonlocal left, messages
            while left > 0:
                left -= 1
                sent, last = time.perf_counter(), None
                request = inference_pb2.GenerateRequest(prompt="x", sampling=types_pb2.SamplingParams(
                    max_tokens=tokens))
                async for chunk in stub.Generate(request, timeout=60):
                    messages += 1
                    if chunk.HasField("delta"):
                        now = time.perf_counter()
                        (ttft if last is None else itl).append((now - (sent if last is None else last)) * 1e3)
                        last = now

        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        wall = time.perf_counter() - started
    return {"ttft_p50_ms": statistics.median(ttft), "itl_p50_ms": statistics.median(itl) if itl else None,
            "requests": len(ttft), "messages": messages, "wall_s": wall}


def _placement() -> tuple[list[int], list[int]]:
    """(the relay's cores, everyone else's): the last usable core alone for the relay where there are two or more."""
    usable = sorted(os.sched_getaffinity(0))
    return (usable[-1:], usable[:-1]) if len(usable) > 1 else ([], [])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()
    levels = [int(c) for c in args.levels]
    base = free_port_block(2)
    relay_cores, other_cores = _placement()
    mine = os.sched_getaffinity(0)
    # The relay and the upstream start with the transport the services start with (their launchers set
    # GRPC_EXPERIMENTS; an environment that sets it wins), read by gRPC once, in each new process.
    inherited = os.environ.get("GRPC_EXPERIMENTS")
    experiments = GRPC_EXPERIMENTS if inherited is None else inherited
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds grpc and an event loop
    upstream = spawn.Process(target=_serve_upstream, args=(base, args.step_base_ms / 1e3,
                                                           args.step_per_stream_ms / 1e3, args.tokens, other_cores),
                             daemon=True)
    relay = spawn.Process(target=_serve_relay, args=(base + 1, base, relay_cores), daemon=True)
    os.environ["GRPC_EXPERIMENTS"] = experiments  # a spawned process takes the environment of its start
    try:
        upstream.start()
        relay.start()
    finally:
        if inherited is None:
            del os.environ["GRPC_EXPERIMENTS"]
    if other_cores:
        os.sched_setaffinity(0, other_cores)
    results: list[dict[str, Any]] = []
    try:
        for port in (base, base + 1):  # both up, and warm: a channel and a call each
            for _ in range(200):
                try:
                    await _load(port, 1, 1, 1)
                    break
                except Exception:  # not listening yet
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"the {'relay' if port == base + 1 else 'upstream'} did not start")
        for c in levels:
            rounds = []
            for r in range(args.rounds):
                direct = await _load(base, c, c * args.requests_per_stream, args.tokens)
                before = cpu_seconds([relay.pid or 0])
                relayed = await _load(base + 1, c, c * args.requests_per_stream, args.tokens)
                after = cpu_seconds([relay.pid or 0])
                cpu = (after - before) if before is not None and after is not None else None
                rounds.append({
                    "round": r + 1, "direct": direct, "relay": relayed,
                    "ttft_p50_diff_ms": relayed["ttft_p50_ms"] - direct["ttft_p50_ms"],
                    "itl_p50_diff_ms": (relayed["itl_p50_ms"] - direct["itl_p50_ms"])
                    if relayed["itl_p50_ms"] is not None and direct["itl_p50_ms"] is not None else None,
                    "relay_cpu_us_per_message": cpu / relayed["messages"] * 1e6 if cpu is not None else None,
                    "relay_busy_share": cpu / relayed["wall_s"] if cpu is not None else None,
                })
                print(f"{c} streams, round {r + 1}: relay minus direct TTFT p50 "
                      f"{rounds[-1]['ttft_p50_diff_ms']:+.2f} ms", file=sys.stderr)

            def median(key: str, rows: list[dict[str, Any]] = rounds) -> float | None:
                values = [row[key] for row in rows if row[key] is not None]
                return statistics.median(values) if values else None

            results.append({"concurrency": c, "rounds": rounds, "ttft_p50_diff_ms": median("ttft_p50_diff_ms"),
                            "itl_p50_diff_ms": median("itl_p50_diff_ms"),
                            "relay_cpu_us_per_message": median("relay_cpu_us_per_message"),
                            "relay_busy_share": median("relay_busy_share")})
    finally:
        os.sched_setaffinity(0, mine)
        for process in (relay, upstream):
            process.kill()
            process.join(5)
    return {"machine": machine,
            "config": {"concurrency": levels, "rounds": args.rounds, "requests_per_stream": args.requests_per_stream,
                       "tokens": args.tokens, "step_base_ms": args.step_base_ms,
                       "step_per_stream_ms": args.step_per_stream_ms, "relay_cores": relay_cores,
                       "other_cores": other_cores, "smoke": args.quick, "grpc_experiments": experiments},
            "packages": package_versions(["grpcio", "protobuf", "uvloop"]), "levels": results}


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """At every level, the bare relay's added TTFT and ITL p50 (relay minus direct, the median over the rounds)
    against the gateway's goals: what the floor leaves of them."""
    def added(i: int, key: str) -> Any:
        return lambda r: (r["levels"][i][key], None)

    return [bench.Goal(f"{lv['concurrency']} stream{'s' if lv['concurrency'] != 1 else ''}: the relay adds "
                       f"≤ {goal:g} ms to {metric.upper()} p50", added(i, f"{metric}_p50_diff_ms"), goal,
                       at_most=True, digits=2 if metric == "ttft" else 3)
            for i, lv in enumerate(report["levels"]) for metric, goal in (("ttft", GOAL_TTFT_MS), ("itl", GOAL_ITL_MS))]


def context(report: dict[str, Any]) -> dict[str, Any]:
    return {"goal_ttft_ms": GOAL_TTFT_MS, "goal_itl_ms": GOAL_ITL_MS,
            "direct_ttft_ms": [statistics.median(r["direct"]["ttft_p50_ms"] for r in lv["rounds"])
                               for lv in report["levels"]]}


def figure(report: dict[str, Any]) -> bench.Figure | None:
    levels = report["levels"]
    xs = [lv["concurrency"] for lv in levels]
    return None if not levels else bench.Figure(f"grpc.aio relay floor ({cpu_label(report.get('machine') or {})})", [
        bench.Panel("relay minus direct", "streams", "added TTFT p50 (ms)",
                    [bench.Series("bare relay", xs, [lv["ttft_p50_diff_ms"] for lv in levels])],
                    lines=[(GOAL_TTFT_MS, f"gateway goal {GOAL_TTFT_MS:g} ms", "--", "grey")], xscale="log2"),
        bench.Panel("relay CPU per relayed message", "streams", "µs",
                    [bench.Series("bare relay", xs, [lv["relay_cpu_us_per_message"] for lv in levels])],
                    xscale="log2")], panel_width=5.0)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=3, help="rounds per level (each: direct, then the relay)")
    ap.add_argument("--requests-per-stream", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--step-base-ms", type=float, default=12.0, help="the engine step with an empty batch (the "
                    "simulated engine's)")
    ap.add_argument("--step-per-stream-ms", type=float, default=0.3, help="what each open stream adds to the step")


BENCHMARK = bench.Benchmark(
    name="relay_floor", doc=__doc__ or "", run=run, arguments=add_arguments, goals=goals, context=context,
    figure=figure, levels=bench.Option("1,8,32,128", "comma-separated stream counts", aliases=("--concurrency",)),
    quick={"levels": [1.0, 2.0], "rounds": 1, "requests_per_stream": 2, "tokens": 4},
    quick_help="the test: 1 and 2 streams, 1 round, 2 requests, 4 tokens", out="loadtests/out/relay-floor",
    reports=("relay-floor",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
