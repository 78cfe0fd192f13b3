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
alone renders the rest again: ``python -m loadtests.overhead --render``). Writes ``<out>.json``, ``<out>.md`` and
``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtests import overhead
from loadtests.common import cpu_label, markdown_table, write_report

__all__ = ["Variant", "compare", "main", "parse_variant"]

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

    def describe(self) -> str:
        parts = [f"`{k}={v}`" for k, v in self.settings.items()]
        if self.gateway_cores:
            parts.append(f"`--gateway-cores {self.gateway_cores}` (the gateway on core(s) of its own)")
        if self.grpc_channels:
            parts.append(f"`--grpc-channels {self.grpc_channels}` (the client's connections per gRPC path)")
        return ", ".join(parts) or "the defaults"


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


def _cell(cell: dict[str, Any] | None, label: str, *, baseline: bool) -> str:
    if cell is None:
        return "—"
    sign = "+" if "Δ" in label else ""  # an added latency is signed, a CPU time is not
    text = f"{cell['median']:{sign}.2f} ({cell['min']:{sign}.2f} … {cell['max']:{sign}.2f})"
    if not baseline and cell["vs_baseline"] is not None:
        text += f", {cell['vs_baseline']:+.2f}"
    return text


def render_markdown(report: dict[str, Any]) -> str:
    variants: list[dict[str, Any]] = report["variants"]
    names = [v["name"] for v in variants]
    machine = report.get("machine") or {}
    lines = [f"# Overhead benchmark, setting against setting: {names[0]} (the baseline)"
             + "".join(f", {n}" for n in names[1:]), ""]
    lines += [f"Measured {report.get('generated_at', '?')} on {cpu_label(machine)}, {machine.get('cores_usable')} "
              f"usable cores; {report['rounds']} run{'s' if report['rounds'] != 1 else ''} per variant, "
              "the variants taking turns; each run "
              f"`python -m loadtests.overhead --start --engine {report['engine']}` at "
              f"{', '.join(str(c) for c in report['concurrency'])} streams, {report['max_tokens']} tokens per answer "
              "(its own platform and its own direct baseline: every number is that run's gateway minus direct).", ""]
    lines += ["| variant | settings |", "|---|---|"]
    lines += [f"| {v['name']}{' (baseline)' if i == 0 else ''} | "
              + Variant(v["name"], v["settings"], v.get("gateway_cores"), v.get("grpc_channels")).describe() + " |"
              for i, v in enumerate(variants)]
    lines += ["", "Each cell: the median over the runs (smallest … largest), and for the other variants the median's "
              f"difference from {names[0]}'s. Lower is better everywhere.", ""]
    for row in report["levels"]:
        lines += [f"## {row['concurrency']} stream{'s' if row['concurrency'] != 1 else ''}", ""]
        measured = [label for label, _ in METRICS if all(label in row["variants"][n] for n in names)]  # an older
        lines.append(markdown_table(["metric"] + names,  # report lacks the metrics added since
                                    [[label] + [_cell(row["variants"][n][label], label, baseline=i == 0)
                                                for i, n in enumerate(names)] for label in measured]))
        lines.append("")
    lines += ["## The runs", ""]
    lines.append(markdown_table(["variant", "run", "load average at start", "report"],
                                [[r["variant"], r["round"], " / ".join(str(x) for x in r.get("loadavg") or []),
                                  f"`{Path(r['report']).with_suffix('.json')}`"] for r in report["runs"]]))
    lines += ["", "A run's own report (Markdown and plot) from its JSON: `python -m loadtests.overhead --render JSON`."]
    return "\n".join(lines) + "\n"


def render_plot(report: dict[str, Any], path: Path) -> Path | None:
    from loadtests.common import pyplot

    plt = pyplot()
    if plt is None:
        return None
    names = [v["name"] for v in report["variants"]]
    levels = [row["concurrency"] for row in report["levels"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, label in zip(axes, ("gRPC ΔTTFT p50 ms", "gateway CPU ms/request"), strict=True):
        for i, name in enumerate(names):
            cells = [row["variants"][name][label] for row in report["levels"]]
            xs = [x + (i - (len(names) - 1) / 2) * 0.12 for x in range(len(levels))]
            med = [c["median"] if c else float("nan") for c in cells]
            err = [[(c["median"] - c["min"]) if c else 0 for c in cells], [(c["max"] - c["median"]) if c else 0
                                                                            for c in cells]]
            ax.errorbar(xs, med, yerr=err, fmt="o-", capsize=4, label=name)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(label + " (median, range over runs)")
        ax.grid(alpha=0.3)
    axes[0].axhline(overhead.GOAL_TTFT_P50_MS, color="grey", ls="--", lw=1, label="goal")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.overhead_ab", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", dest="variants", type=parse_variant, action="append", default=[],
                    help="NAME or NAME:GOODPUT_X=1,...,gateway-cores=CORES (repeat; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per variant (default 3)")
    ap.add_argument("--concurrency", default="32,128", help="the levels of every run (default 32,128)")
    ap.add_argument("--requests-per-level", type=int, default=None, help="per path and level (overhead's default)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engine", default="sim", choices=["sim", "vllm"])
    ap.add_argument("--port-offset", type=int, default=700, help="port offset of every run's platform")
    ap.add_argument("--out", type=Path, default=Path("loadtests/out/overhead-ab"))
    ap.add_argument("--render", type=Path, default=None, metavar="JSON", help="only rewrite the .md and .png")
    args = ap.parse_args(argv)
    if args.render is None:
        if not args.variants:
            ap.error("name at least one --variant (the first is the baseline)")
        if len({v.name for v in args.variants}) != len(args.variants):
            ap.error("every --variant needs a name of its own")
        if args.rounds < 1:
            ap.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if args.render is not None:
        report = json.loads(args.render.read_text(encoding="utf-8"))
        out = args.render.with_suffix("")
    else:
        runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in args.variants}
        listed = []
        runs_dir = args.out.parent / f"{args.out.name}-runs"
        for rnd in range(1, args.rounds + 1):
            for v in args.variants:
                console.rule(f"{v.name}, run {rnd} of {args.rounds}")
                run_out = runs_dir / f"{v.name}-{rnd}"
                argv_run = ["--start", "--engine", args.engine, "--concurrency", args.concurrency,
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
                if overhead.main(argv_run) != 0:
                    console.print(f"[red]{v.name} run {rnd}: a path served no request; left out[/red]")
                    continue
                # the run's platform folder (logs, certificates) is scratch once the run went well
                shutil.rmtree(run_out.parent / f"{run_out.name}-platform", ignore_errors=True)
                saved = json.loads(run_out.with_suffix(".json").read_text(encoding="utf-8"))
                runs[v.name].append(saved)
                listed.append({"variant": v.name, "round": rnd, "report": str(run_out.with_suffix(".json")),
                               "loadavg": saved.get("machine", {}).get("loadavg_1_5_15")})
        if any(not r for r in runs.values()):
            console.print("[red]a variant has no complete run: no comparison[/red]")
            return 1
        first = next(iter(runs.values()))[0]
        report = {"benchmark": "overhead_ab", "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "engine": args.engine, "rounds": args.rounds,
                  "concurrency": [int(c) for c in args.concurrency.split(",")], "max_tokens": args.max_tokens,
                  "machine": first.get("machine"),
                  "variants": [{"name": v.name, "settings": v.settings, "gateway_cores": v.gateway_cores,
                                "grpc_channels": v.grpc_channels}
                               for v in args.variants],
                  "levels": compare(runs), "runs": listed}
        out = args.out
    json_path, md_path = write_report(out, report, render_markdown(report))
    png = render_plot(report, out.parent / f"{out.name}.png")
    console.print(md_path.read_text(encoding="utf-8"))
    console.print(f"report: {json_path}, {md_path}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
