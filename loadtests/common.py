"""Helpers every benchmark in ``loadtests`` shares: percentiles, differences with confidence intervals, machine
information, and the Markdown table and report files the chaos suite writes (benchmarks write theirs through
:mod:`loadtests.bench`).

Example:
    >>> s = summarize([0.010, 0.012, 0.011, 0.030])
    >>> round(s["p50_ms"], 2)
    11.5
    >>> markdown_table(["path", "p50"], [["direct", "11.50"]])
    '| path | p50 |\\n|---|---|\\n| direct | 11.50 |'
"""

from __future__ import annotations

import json
import os
import platform
import random
import socket
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from goodput_core.cpu import cpu_info

__all__ = [
    "PERCENTILES", "bootstrap_diff_ci", "cpu_label", "free_port_block", "machine_info", "markdown_table",
    "package_versions", "percentile", "pyplot", "summarize", "write_report",
]

PERCENTILES = (50, 95, 99)

# Below Linux's ephemeral range (32768-60999): an outgoing connection of another process never holds these.
PORT_RANGE = (20000, 32700)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(span: int = 100, *, rng: random.Random | None = None, tries: int = 200) -> int:
    """The first of ``span`` consecutive ports that are free now, below the ephemeral range: the base port for a
    benchmark's fleet (the scheduler at the base, workers and metrics above it), so that a test run never collides
    with a fixed port that another test or an outgoing connection holds.

    >>> base = free_port_block(10)
    >>> PORT_RANGE[0] <= base and base + 10 <= PORT_RANGE[1]
    True
    """
    rng = rng or random.Random()
    for _ in range(tries):
        base = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - span)
        if all(_port_free(base + i) for i in range(span)):
            return base
    raise RuntimeError(f"no {span} consecutive free ports in {PORT_RANGE}")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method);
    None for no values.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    >>> percentile([], 99) is None
    True
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(seconds: Sequence[float], percentiles: Iterable[int] = PERCENTILES) -> dict[str, Any]:
    """Count, mean and percentiles of durations given in seconds, reported in milliseconds (None when empty)."""
    out: dict[str, Any] = {"n": len(seconds),
                           "mean_ms": (sum(seconds) / len(seconds) * 1000) if seconds else None}
    for q in percentiles:
        v = percentile(seconds, q)
        out[f"p{q}_ms"] = None if v is None else v * 1000
    return out


def bootstrap_diff_ci(a: Sequence[float], b: Sequence[float], *, q: float = 50, resamples: int = 1000,
                      confidence: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Confidence interval of percentile(a, q) - percentile(b, q) by resampling both samples independently.

    Says how much of a measured difference could be noise; None when either sample is empty.

    >>> lo, hi = bootstrap_diff_ci([2.0] * 20, [1.0] * 20)
    >>> (lo, hi)
    (1.0, 1.0)
    """
    if not a or not b:
        return None
    import numpy as np  # lazy: only the benchmarks need it

    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ra = xa[rng.integers(0, len(xa), size=(resamples, len(xa)))]
    rb = xb[rng.integers(0, len(xb), size=(resamples, len(xb)))]
    diffs = np.percentile(ra, q, axis=1) - np.percentile(rb, q, axis=1)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(diffs, [tail, 100 - tail])
    return float(lo), float(hi)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (cells are str()-ed; pipes escaped)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed versions of the given distributions (None when not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_seconds(pids: Iterable[int]) -> float | None:
    """User + system CPU seconds these processes (and the processes below them) have used so far; Linux only (None
    elsewhere, or when one is gone). The difference of two reads is what they spent in between: steadier than any
    latency on shared cores, because time spent waiting for a core is not counted."""
    from goodput_cli.procs import descendants

    def ticks(pid: int) -> int:
        with open(f"/proc/{pid}/stat", "rb") as f:  # bytes: a process may name itself in any encoding
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))

    try:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in pids:
            total += ticks(pid)
            for child, _ in descendants(pid):
                try:
                    total += ticks(child)
                except OSError:  # a short-lived child that ended since it was listed (its parent collects its time)
                    continue
    except (OSError, ValueError, AttributeError, IndexError):
        return None
    return total / tick


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores usable by this process, memory, OS, Python, load average.

    Holds no host names or file-system paths, so it can be committed with a report.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = cpu_info()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_vendor": cpu["vendor"],
        "cpu_isa": cpu["isa"],
        "cpu_flags": {k: cpu[k] == "true" for k in ("amx", "avx512", "avx512_bf16", "avx2")},
        "cores_usable": cores,
        "cores_total": os.cpu_count(),
        "machine": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    return info


def cpu_label(machine: dict[str, Any]) -> str:
    """How a report names the CPU it ran on: model, vendor and the widest vector/matrix path, since vLLM's CPU
    kernels (and so a small model's answers in bf16) differ with them.

    >>> cpu_label({"cpu_model": "AMD EPYC 9R14", "cpu_vendor": "AMD", "cpu_isa": "avx512"})
    'AMD EPYC 9R14 (AMD, AVX-512, no AMX)'
    >>> cpu_label({"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_vendor": "Intel", "cpu_isa": "amx"})
    'Intel(R) Xeon(R) Processor (Intel, AMX + AVX-512)'
    """
    model = machine.get("cpu_model", "CPU")
    isa = {"amx": "AMX + AVX-512", "avx512": "AVX-512, no AMX", "avx2": "AVX2", "other": "no AVX2"}.get(
        machine.get("cpu_isa", ""))
    if not isa:
        return str(model)
    return f"{model} ({machine.get('cpu_vendor', '?')}, {isa})"


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (the Agg backend), or None where matplotlib is not installed: a report's
    plot is then left out, never the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(out: Path, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Writes ``<out>.json`` and ``<out>.md`` (``out`` has no suffix) (parent folders created); returns both paths.

    ``data`` gets a ``generated_at`` UTC timestamp if it has none.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **data}
    json_path, md_path = out.parent / f"{out.name}.json", out.parent / f"{out.name}.md"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
    return json_path, md_path
