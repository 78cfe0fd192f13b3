"""A setting against its default on the overhead benchmark: ``loadtests.overhead`` run again and again, the variants
taking turns, and what each variant's runs gave side by side.

One run of the overhead benchmark on shared cores differs from the next by more than most settings change (its
added TTFT p50 at 128 streams has varied by 2x between runs of the same code), so a setting is judged on several runs
per variant, interleaved (A, B, C, A, B, C, ...) so that a machine that gets busier hits every variant alike. Each run
is a whole ``python -m loadtests.overhead --start`` with its own platform and its own direct baseline, so every number
compared is already "gateway minus direct, same run"; this module only sets them side by side: per level and
variant the median over the runs and their range, of the added TTFT and ITL p50 (gRPC and REST) and of the gateway's
and the scheduler's CPU per request, and each variant against the first (the baseline).

Usage:
    python -m loadtests.overhead_ab --variant default --variant speculative:GOODPUT_GATEWAY_SPECULATIVE_START=true \\
        --rounds 3 --concurrency 32,128 --out loadtests/reports/worker-mux-ab
    python -m loadtests.overhead_ab --render loadtests/reports/worker-mux-ab.json   # rewrite the .md and .png

A variant is ``NAME`` or ``NAME:GOODPUT_X=1,GOODPUT_Y=2`` (the settings given to its platform with ``--set``; an item
``gateway-cores=1`` runs it with ``--gateway-cores 1``, the gateway on a core of its own; the first variant is the
baseline). Every run's own report (JSON, Markdown, plot) is kept under ``<out>-runs/`` (its JSON
alone renders the rest again: ``python -m loadtests.overhead --render``). Writes ``<out>.json``, ``<out>.md``
(``templates/overhead_ab.md``) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from loadtests import bench, overhead

__all__ = ["BENCHMARK", "Variant", "compare", "main", "parse_variant"]

# (label, path in a level of an overhead report)
METRICS: list[tuple[str, tuple[str, ...]]] = [
    ("gRPC ΔTTFT p50 ms", ("overhead", "gateway_grpc", "ttft", "p50_diff_ms")),
    ("REST ΔTTFT p50 ms", ("overhead", "gateway_rest", "ttft", "p50_diff_ms")),
    ("gRPC ΔITL p50 ms", ("overhead", "gateway_grpc", "itl", "p50_diff_ms")),
    ("REST ΔITL p50 ms", ("overhead", "gateway_rest", "itl", "p50_diff_ms")),
    ("gRPC ΔTTFT p99 ms", ("overhead", "gateway_grpc", "ttft", "p99_diff_ms")),  # the tails: pauses show here
    ("gRPC ΔITL p99 ms", ("overhead", "gateway_grpc", "itl", "p99_diff_ms")),
    ("gateway CPU ms/request", ("cpu_per_request", "gateway", "ms_per_request")),
    ("scheduler CPU ms/request", ("cpu_per_request", "scheduler", "ms_per_request")),
]


class Variant:
    """A name, the platform settings it runs with, the cores of the gateway's own (``--gateway-cores``) and the
    client's connections per gRPC path (``--grpc-channels``)."""

    def __init__(self, name: str, settings: dict[str, str], gateway_cores: str | None = None,
                 grpc_channels: int | None = None) -> None:
        self.name, self.settings, self.gateway_cores = name, settings, gateway_cores
        self.grpc_channels = grpc_channels

    def __repr__(self) -> str:
        cores = f", gateway_cores={self.gateway_cores!r}" if self.gateway_cores else ""
        channels = f", grpc_channels={self.grpc_channels}" if self.grpc_channels else ""
        return f"Variant({self.name!r}, {self.settings!r}{cores}{channels})"


def parse_variant(text: str) -> Variant:
    """``NAME`` or ``NAME:GOODPUT_X=1,GOODPUT_Y=2``, where an item ``gateway-cores=1`` gives the run
    ``--gateway-cores 1`` and ``grpc-channels=16`` gives it ``--grpc-channels 16`` instead of a setting.

    >>> parse_variant("speculative:GOODPUT_GATEWAY_SPECULATIVE_START=true")
    Variant('speculative', {'GOODPUT_GATEWAY_SPECULATIVE_START': 'true'})
    >>> parse_variant("default")
    Variant('default', {})
    >>> parse_variant("own-core:gateway-cores=1")
    Variant('own-core', {}, gateway_cores='1')
    >>> parse_variant("clients:gateway-cores=1,grpc-channels=16")
    Variant('clients', {}, gateway_cores='1', grpc_channels=16)
    >>> parse_variant("a b")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: a variant's name is letters, digits, '-' and '_', got 'a b'
    """
    name, _, rest = text.partition(":")
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise argparse.ArgumentTypeError(f"a variant's name is letters, digits, '-' and '_', got {name!r}")
    items = [item.strip() for item in rest.split(",") if item.strip()]
    options = ("gateway-cores", "grpc-channels")  # the benchmark's own options, not settings
    given: dict[str, list[str]] = {o: [i.partition("=")[2] for i in items if i.startswith(f"{o}=")] for o in options}
    settings = dict(overhead.parse_setting(i) for i in items if not i.startswith(tuple(f"{o}=" for o in options)))
    cores, channels = given["gateway-cores"], given["grpc-channels"]
    if len(cores) > 1 or (cores and not cores[0]):
        raise argparse.ArgumentTypeError(f"a variant takes one gateway-cores=CORES, got {text!r}")
    if len(channels) > 1 or (channels and not (channels[0].isdigit() and int(channels[0]) > 0)):
        raise argparse.ArgumentTypeError(f"a variant takes one grpc-channels=N (N > 0), got {text!r}")
    return Variant(name, settings, cores[0] if cores else None, int(channels[0]) if channels else None)


def _get(level: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = level
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level: each variant's median and range over its runs of every metric, and the median's difference from
    the first variant's (the baseline).

    >>> lv = lambda c, t: {"concurrency": c, "overhead": {"gateway_grpc": {"ttft": {"p50_diff_ms": t}}}}
    >>> rows = compare({"a": [{"levels": [lv(8, 3.0)]}, {"levels": [lv(8, 5.0)]}], "b": [{"levels": [lv(8, 2.0)]}]})
    >>> rows[0]["variants"]["a"]["gRPC ΔTTFT p50 ms"], rows[0]["variants"]["b"]["gRPC ΔTTFT p50 ms"]
    ({'median': 4.0, 'min': 3.0, 'max': 5.0, 'n': 2, 'vs_baseline': None}, \
{'median': 2.0, 'min': 2.0, 'max': 2.0, 'n': 1, 'vs_baseline': -2.0})
    """
    names = list(runs)
    levels = sorted({lv["concurrency"] for reports in runs.values() for r in reports for lv in r["levels"]})
    out = []
    for c in levels:
        per: dict[str, dict[str, Any]] = {}
        for name in names:
            cells: dict[str, Any] = {}
            for label, path in METRICS:
                values = [v for r in runs[name] for lv in r["levels"] if lv["concurrency"] == c
                          if (v := _get(lv, path)) is not None]
                cells[label] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                                "n": len(values), "vs_baseline": None} if values else None
            per[name] = cells
        base = per[names[0]]
        for name in names[1:]:
            for label, _ in METRICS:
                cell, ref = per[name][label], base[label]
                if cell is not None and ref is not None:
                    cell["vs_baseline"] = round(cell["median"] - ref["median"], 3)
        out.append({"concurrency": c, "variants": per})
    return out


GOAL_METRIC = "gRPC ΔTTFT p50 ms"  # the overhead benchmark's goal is on it


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """At every level, each variant's gRPC added TTFT p50 (the median over its runs) against the overhead
    benchmark's goal, the baseline variant's median beside it."""
    names = [v["name"] for v in report["variants"]]

    def median(i: int, name: str) -> Any:
        def measure(r: dict[str, Any]) -> tuple[float | None, float | None]:
            cells = r["levels"][i]["variants"]
            base = None if name == names[0] else cells[names[0]][GOAL_METRIC]["median"]
            return cells[name][GOAL_METRIC]["median"], base
        return measure

    return [bench.Goal(f"{name}, {row['concurrency']} stream{'s' if row['concurrency'] != 1 else ''}: gRPC TTFT "
                       f"p50 added ≤ {overhead.GOAL_TTFT_P50_MS:g} ms", median(i, name), overhead.GOAL_TTFT_P50_MS,
                       at_most=True)
            for i, row in enumerate(report["levels"]) for name in names]


def context(report: dict[str, Any]) -> dict[str, Any]:
    return {"names": [v["name"] for v in report["variants"]],  # an older report lacks the metrics added since:
            "measured": [[label for label, _ in METRICS if all(label in v for v in row["variants"].values())]
                         for row in report["levels"]]}


def figure(report: dict[str, Any]) -> bench.Figure:
    """Per panel, each variant's median over its runs with their range as a band."""
    names = [v["name"] for v in report["variants"]]
    rows, xs = report["levels"], list(range(len(report["levels"])))

    def series(label: str, name: str, key: str) -> list[float | None]:
        return [row["variants"][name][label][key] if row["variants"][name].get(label) else None for row in rows]

    return bench.Figure("", [bench.Panel(f"{label} (median, range over runs)", "concurrent streams", "", [
        bench.Series(name, xs, series(label, name, "median"), color=f"C{i}",  # the band in its line's colour
                     band=(series(label, name, "min"), series(label, name, "max"))) for i, name in enumerate(names)],
        lines=[(overhead.GOAL_TTFT_P50_MS, "goal", "--", "grey")] if label == GOAL_METRIC else [],
        xticks=[str(row["concurrency"]) for row in rows]) for label in (GOAL_METRIC, "gateway CPU ms/request")],
        panel_width=5.5)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--variant", dest="variants", type=parse_variant, action="append", default=[],
                    help="NAME or NAME:GOODPUT_X=1,...,gateway-cores=CORES (repeat; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per variant (default 3)")
    ap.add_argument("--requests-per-level", type=int, default=None, help="per path and level (overhead's default)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port-offset", type=int, default=700, help="port offset of every run's platform")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.render is None:
        if not args.variants:
            ap.error("name at least one --variant (the first is the baseline)")
        if len({v.name for v in args.variants}) != len(args.variants):
            ap.error("every --variant needs a name of its own")
        if args.rounds < 1:
            ap.error("--rounds must be at least 1")


async def run_overhead(argv: list[str]) -> dict[str, Any] | None:
    """One ``loadtests.overhead`` run in this event loop, its report written as that benchmark writes it; None where
    a path served no request."""
    args = bench.parse(overhead.BENCHMARK, argv)
    report = await bench.measure(overhead.BENCHMARK, args)
    bench.render(overhead.BENCHMARK, report, args.out)
    return report if overhead.served(report, args) else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant ``--rounds`` times, taking turns, each run a whole ``loadtests.overhead --start``."""
    console = Console()
    concurrency = [int(c) for c in args.levels]
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in args.variants}
    listed = []
    for rnd in range(1, args.rounds + 1):
        for v in args.variants:
            console.rule(f"{v.name}, run {rnd} of {args.rounds}")
            run_out = args.out.parent / f"{args.out.name}-runs" / f"{v.name}-{rnd}"
            argv_run = ["--start", "--engine", args.engine, "--concurrency", ",".join(map(str, concurrency)),
                        "--max-tokens", str(args.max_tokens), "--port-offset", str(args.port_offset),
                        "--out", str(run_out)]
            if args.requests_per_level:
                argv_run += ["--requests-per-level", str(args.requests_per_level)]
            for name, value in v.settings.items():
                argv_run += ["--set", f"{name}={value}"]
            if v.gateway_cores:
                argv_run += ["--gateway-cores", v.gateway_cores]
            if v.grpc_channels:
                argv_run += ["--grpc-channels", str(v.grpc_channels)]
            saved = await run_overhead(argv_run)
            if saved is None:
                console.print(f"[red]{v.name} run {rnd}: a path served no request; left out[/red]")
                continue
            # the run's platform folder (logs, certificates) is scratch once the run went well
            shutil.rmtree(run_out.parent / f"{run_out.name}-platform", ignore_errors=True)
            runs[v.name].append(saved)
            listed.append({"variant": v.name, "round": rnd, "report": str(run_out.with_suffix(".json")),
                           "loadavg": saved.get("machine", {}).get("loadavg_1_5_15")})
    if any(not r for r in runs.values()):
        raise SystemExit("a variant has no complete run: no comparison")
    return {"engine": args.engine, "rounds": args.rounds, "concurrency": concurrency, "max_tokens": args.max_tokens,
            "machine": next(iter(runs.values()))[0].get("machine"),
            "variants": [{"name": v.name, "settings": v.settings, "gateway_cores": v.gateway_cores,
                          "grpc_channels": v.grpc_channels} for v in args.variants],
            "levels": compare(runs), "runs": listed}


BENCHMARK = bench.Benchmark(
    name="overhead_ab", doc=__doc__ or "", run=run, arguments=add_arguments, prepare=prepare, goals=goals,
    context=context, figure=figure, engines=("sim", "vllm"), engine_help="every run's engine",
    levels=bench.Option("32,128", "the levels of every run (default 32,128)", aliases=("--concurrency",)),
    quick={"rounds": 1, "levels": [2.0], "requests_per_level": 4, "max_tokens": 4},
    quick_help="one run per variant at 2 streams, 4 requests, 4 tokens", out="loadtests/out/overhead-ab",
    reports=("worker-mux-ab", "worker-mux-ab-large", "gateway-core-ab", "gateway-core-calls-ab", "gc-freeze-ab",
             "token-gate-ab", "token-gate4-ab", "grpc-channels-ab", "grpc-client-ab"))


def main(argv: Sequence[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
