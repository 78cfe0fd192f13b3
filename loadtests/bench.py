"""The benchmark skeleton: a benchmark declares its workload, its goals and its report's template; one runner does
the rest.

A benchmark is a module with a :class:`Benchmark` and a ``main`` that hands it to :func:`main`::

    BENCHMARK = Benchmark(name="prefix", doc=__doc__, run=measure, arguments=add_arguments, goals=GOALS,
                          fleet=Fleet(workers=4, max_num_seqs=32, time_scale=1.0, base_port=26500), seed=11,
                          quick={"workers": 2, "requests": 120})

    def main(argv: list[str] | None = None) -> int:
        return bench.main(BENCHMARK, argv)

:func:`main` parses the common options once (``--out``, ``--render``, ``--quick``/``--smoke``, and where the
benchmark declares them ``--engine``, the fleet's ``--workers``/``--max-num-seqs``/``--time-scale``/``--base-port``,
``--seed``, ``--levels`` and ``--warmup-s``) beside the benchmark's own, runs it, writes ``<out>.json``, then
``<out>.md`` (the benchmark's Jinja template ``loadtests/templates/<name>.md`` rendered from that JSON, its goals
evaluated) and ``<out>.png`` (where it declares a figure), and prints each goal: the measured value, the same run's
baseline and their ratio, against the threshold. ``--render JSON`` writes the Markdown and the plot of a saved
report again, beside it, and keeps the hand-written section at its end (a heading naming notes): a report is its
JSON, and what the Markdown shows is what the JSON holds. Python computes; every sentence is in a template.

A benchmark reports numbers; a missed goal is printed, not an error (the exit status is 1 only where ``ok`` says
the run did not serve what it had to).

Example:
    >>> g = Goal("P0 p99 TTFT ≤ 1.5x unloaded", lambda r: (r["p99"], r["unloaded"]), 1.5, at_most=True,
    ...          judged="ratio", digits=0)
    >>> e = g.evaluate({"p99": 231.0, "unloaded": 181.0})
    >>> e["met"], fmt_goal(e, "value"), fmt_goal(e, "baseline"), fmt_goal(e, "judged"), fmt_goal(e, "threshold")
    (True, '231 ms', '181 ms', '1.28×', '≤ 1.50×')
    >>> g.evaluate({"p99": 231.0})["met"] is None  # a report from before the field: not judged
    True
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from loadtests.common import cpu_label, pyplot

__all__ = ["Benchmark", "Figure", "Fleet", "Goal", "Option", "Panel", "Series", "fmt_goal", "main", "markdown",
           "measure", "plot", "render", "unwrap"]

Report = dict[str, Any]
TEMPLATES = Path(__file__).with_name("templates")
Judged = Literal["value", "diff", "ratio", "speedup", "change"]


@dataclass(frozen=True)
class Goal:
    """What a benchmark promises. ``measure(report)`` gives the measured value and the same run's baseline (None
    where the goal has none); the goal is met when the judged quantity is at most (``at_most``) or at least
    ``threshold``: the ``value`` itself, the ``diff`` (value - baseline), the ``ratio`` (value / baseline), the
    ``speedup`` (baseline / value) or the ``change`` (value / baseline - 1). ``unit`` is the value's (``%``: a share
    0..1), ``digits`` how it is shown."""

    name: str
    measure: Callable[[Report], tuple[float | None, float | None]]
    threshold: float
    at_most: bool = False
    judged: Judged = "value"
    unit: str = "ms"
    digits: int = 2

    def evaluate(self, report: Report) -> dict[str, Any]:
        """The goal against a report; a report without the fields it reads leaves it unjudged (``met`` None)."""
        try:
            value, base = self.measure(report)
        except (KeyError, IndexError, TypeError, ValueError):  # a field or a row the report lacks
            value, base = None, None
        # a zero baseline (the baseline served nothing) against a positive value: an infinite ratio, judged
        ratio = None if value is None or base is None or base == value == 0 else (
            value / base if base else math.copysign(math.inf, value))
        judged = {"value": value, "ratio": ratio, "diff": None if value is None or base is None else value - base,
                  "speedup": base / value if base is not None and value else None,
                  "change": None if ratio is None else ratio - 1}[self.judged]
        met = None if judged is None else judged <= self.threshold if self.at_most else judged >= self.threshold
        return {"name": self.name, "value": value, "baseline": base, "ratio": ratio, "judged": judged,
                "threshold": self.threshold, "at_most": self.at_most, "kind": self.judged, "unit": self.unit,
                "digits": self.digits, "met": met}


def fmt_goal(goal: Mapping[str, Any], key: str) -> str:
    """One of an evaluated goal's ``value``, ``baseline``, ``judged`` or ``threshold`` as a report shows it."""
    v = goal[key]
    if v is None:
        return "—"
    kind, unit, digits = (goal["kind"] if key in ("judged", "threshold") else "value"), goal["unit"], goal["digits"]
    text = {"value": f"{v * 100:.{digits}f}%" if unit == "%" else f"{v:.{digits}f} {unit}".rstrip(),
            "diff": f"{v:+.{digits}f} {unit}".rstrip(), "ratio": "∞" if math.isinf(v) else f"{v:.2f}×",
            "speedup": "∞" if math.isinf(v) else f"{v:.2f}×",
            "change": f"{v * 100:+.1f}%"}[kind]
    return ("≤ " if goal["at_most"] else "≥ ") + text if key == "threshold" else text


@dataclass(frozen=True)
class Option:
    """A common option a benchmark takes: its default, what it means there, its earlier names (still accepted)."""

    default: Any
    help: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fleet:
    """The simulated fleet a benchmark starts (real scheduler and worker processes): its defaults for ``--workers``,
    ``--max-num-seqs``, ``--time-scale`` and ``--base-port`` (None: the benchmark's ``prepare`` fills it in, from
    the engine's preset)."""

    workers: int | None
    max_num_seqs: int | None
    time_scale: float
    base_port: int


@dataclass(frozen=True)
class Series:
    """One line of a panel; ``band`` a shaded interval around it (low, high)."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    style: str = "-"
    color: str | None = None
    band: tuple[Sequence[float | None], Sequence[float | None]] | None = None


@dataclass(frozen=True)
class Panel:
    """One plot: its series, horizontal reference lines ``(y, label, style, colour)`` and vertical ones
    (``vlines``, likewise with x), ``xscale`` ``linear`` or ``log2`` (ticks at the levels), ``yscale`` ``linear``,
    ``log`` or ``symlog``; ``xticks`` labels the positions 0, 1, ... (one slot per level, whatever its value)."""

    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    lines: Sequence[tuple[float, str, str, str]] = ()
    vlines: Sequence[tuple[float, str, str, str]] = ()
    xticks: Sequence[str] | None = None
    xscale: str = "linear"
    yscale: str = "linear"
    legend_size: float = 8


@dataclass(frozen=True)
class Figure:
    """A report's PNG: panels side by side."""

    title: str
    panels: Sequence[Panel]
    panel_width: float = 6.0


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's declaration: ``run(args)`` measures and returns the report (the JSON); ``arguments`` adds its
    own options, ``prepare`` checks and completes the parsed ones (``ap.error`` on a bad combination); ``goals``
    (or a function of the report giving them) are judged on every report; ``context(report)`` gives the template
    derived values (numbers and flags, no prose); ``figure(report)`` the plot; ``quick`` the options ``--quick``
    sets (where the command line left them at their defaults); ``ok(report, args)`` False makes the exit status 1;
    ``out`` the default report path; ``reports`` the committed reports it wrote (``loadtests/reports/<name>.json``),
    which ``loadtests/tests/test_reports.py`` renders again."""

    name: str
    doc: str
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, Report]]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    prepare: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None
    goals: Sequence[Goal] | Callable[[Report], Sequence[Goal]] = ()
    context: Callable[[Report], dict[str, Any]] | None = None
    figure: Callable[[Report], Figure | None] | None = None
    engines: tuple[str, ...] = ()  # --engine's choices, the default first; none: no --engine
    engine_help: str = ""
    fleet: Fleet | None = None
    seed: int | None = None
    levels: Option | None = None
    warmup: Option | None = None
    quick: Mapping[str, Any] = field(default_factory=dict)
    quick_help: str = "a small, fast run (a smoke test)"
    out: str = "loadtests/out/{name}"  # --out's default, formatted with the parsed options (``{engine}``)
    ok: Callable[[Report, argparse.Namespace], bool] | None = None
    reports: tuple[str, ...] = ()

    def evaluate(self, report: Report) -> list[dict[str, Any]]:
        goals = self.goals(report) if callable(self.goals) else self.goals
        return [g.evaluate(report) for g in goals]


def _levels(text: str) -> list[float]:
    levels = [float(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return levels


def parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The benchmark's command line: the common options, then its own."""
    ap = argparse.ArgumentParser(prog=f"python -m loadtests.{bench.name}", description=bench.doc.split("\n\n")[0])
    common = ap.add_argument_group("common options (loadtests.bench)")
    common.add_argument("--out", type=Path, default=None,
                        help=f"report path without suffix: <out>.json, <out>.md and <out>.png (default {bench.out})"
                             .replace("{name}", bench.name))
    common.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="only write the Markdown (and plot) of a saved report again, beside it; runs nothing")
    common.add_argument("--quick", "--smoke", dest="quick", action="store_true", help=bench.quick_help)
    if bench.engines:
        common.add_argument("--engine", choices=bench.engines, default=bench.engines[0], help=bench.engine_help)
    if bench.fleet is not None:
        f = bench.fleet
        preset = " (default: the engine's preset)"
        common.add_argument("--workers", type=int, default=f.workers,
                            help="workers" + (preset if f.workers is None else ""))
        common.add_argument("--max-num-seqs", type=int, default=f.max_num_seqs,
                            help="sequences per worker (and the scheduler's per-worker cap)"
                                 + (preset if f.max_num_seqs is None else ""))
        common.add_argument("--time-scale", type=float, default=f.time_scale,
                            help="the simulated GPU runs this many times slower than an A100 (so the CPU cores keep "
                                 "up); latencies are wall-clock")
        common.add_argument("--base-port", type=int, default=f.base_port,
                            help="the scheduler's port; the workers the next ones")
    if bench.seed is not None:
        common.add_argument("--seed", type=int, default=bench.seed)
    if bench.levels is not None:
        common.add_argument("--levels", *bench.levels.aliases, dest="levels", type=_levels,
                            default=bench.levels.default, help=bench.levels.help)
    if bench.warmup is not None:
        common.add_argument("--warmup-s", *bench.warmup.aliases, dest="warmup_s", type=float,
                            default=bench.warmup.default, help=bench.warmup.help)
    if bench.arguments is not None:
        bench.arguments(ap)
    return ap


def parse(bench: Benchmark, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line, ``--quick``'s settings applied where an option was left at its default."""
    ap = parser(bench)
    args = ap.parse_args(argv)
    if args.quick:
        defaults = vars(ap.parse_args([]))
        for k, v in bench.quick.items():
            if getattr(args, k) == defaults[k]:
                setattr(args, k, v)
    if bench.prepare is not None:
        bench.prepare(ap, args)
    if args.out is None:
        args.out = Path(bench.out.format(**{**vars(args), "name": bench.name}))
    return args


async def measure(bench: Benchmark, args: argparse.Namespace) -> Report:
    """Runs the benchmark in the running event loop (one benchmark may run another) and writes ``<args.out>.json``;
    returns the report."""
    report = {"generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "benchmark": bench.name,
              **await bench.run(args)}
    json_path = args.out.parent / f"{args.out.name}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return report


def main(bench: Benchmark, argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark (or re-renders a saved report), writes its report files and prints its goals."""
    args = parse(bench, argv)
    if args.render is not None:
        report: Report = json.loads(args.render.read_text(encoding="utf-8"))
        out = args.render.with_suffix("")
    else:
        report = asyncio.run(measure(bench, args))
        out = args.out
    md, png = render(bench, report, out, keep_notes=args.render is not None)
    for g in bench.evaluate(report):
        state = {True: "MET ", False: "MISS", None: "  ? "}[g["met"]]
        base = "" if g["baseline"] is None else (
            f" against {fmt_goal(g, 'baseline')} in the same run"
            + ("" if g["ratio"] is None else f" (ratio {g['ratio']:.3f})"))
        judged = "" if g["kind"] == "value" else f"; {fmt_goal(g, 'judged')}"
        print(f"  {state} {g['name']}: {fmt_goal(g, 'value')}{base}{judged}, goal {fmt_goal(g, 'threshold')}",
              flush=True)
    print(f"report: {md} {out.parent / f'{out.name}.json'} {png or ''}".rstrip(), flush=True)
    return 0 if bench.ok is None or bench.ok(report, args) else 1


# ---- the report's Markdown and plot ------------------------------------------------------------------------------

# A section a person added to a report after its run: "## Notes on this run", "## This run", "## ... (checked by
# hand)"; the templates name none of their sections so.
HAND_WRITTEN = re.compile(r"^## [^\n]*\b(notes|by hand|this run)\b", re.IGNORECASE | re.MULTILINE)


def _hand_notes(md: Path) -> str:
    """The hand-written sections at the end of a written report (from the first such heading on)."""
    if not md.exists():
        return ""
    text = md.read_text(encoding="utf-8")
    found = HAND_WRITTEN.search(text)
    return "" if found is None else "\n" + text[found.start():].rstrip() + "\n"


def render(bench: Benchmark, report: Report, out: Path, *, keep_notes: bool = False) -> tuple[Path, Path | None]:
    """Writes ``<out>.md`` (with ``keep_notes``, the hand-written notes of the file it replaces kept at its end)
    and, where the benchmark declares a figure, ``<out>.png`` (None without matplotlib); returns both paths."""
    md = out.parent / f"{out.name}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    notes = _hand_notes(md) if keep_notes else ""
    md.write_text(markdown(bench, report).strip() + "\n" + notes, encoding="utf-8")
    figure = bench.figure(report) if bench.figure is not None else None
    return md, None if figure is None else plot(figure, out.parent / f"{out.name}.png")


def markdown(bench: Benchmark, report: Report) -> str:
    """The report's Markdown: ``templates/<name>.md`` given the report's keys, ``report`` itself, ``goals``
    (evaluated) and the benchmark's ``context``."""
    context = {**report, "report": report, "goals": bench.evaluate(report),
               **(bench.context(report) if bench.context is not None else {})}
    text = _templates().get_template(f"{bench.name}.md").render(context)
    text = re.sub(r"\n{3,}", "\n\n", re.sub(r"[ \t]+\n", "\n", text))  # a section left out leaves no gap
    return unwrap(text)


_BLOCK = re.compile(r"\s*(?:[|#>]|[-*+] |\d+\. |```|<!--)")


def unwrap(text: str) -> str:
    r"""Each paragraph and list item on one line (what Markdown shows anyway): a template wraps its sentences where its
    source reads well, not where the numbers filled in end; tables, headings and code blocks are left as they are.

    >>> unwrap("A sentence\nwrapped.\n\n- an item\n  wrapped\n- next\n\n| a |\n|---|")
    'A sentence wrapped.\n\n- an item wrapped\n- next\n\n| a |\n|---|'
    """
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and out and out[-1].strip() and line.strip() and not _BLOCK.match(line) and not (
                out[-1].lstrip().startswith(("|", "#", "```"))):
            out[-1] = f"{out[-1]} {line.strip()}"
            continue
        out.append(line)
    return "\n".join(out)


def _missing(v: Any) -> bool:
    import jinja2

    return v is None or isinstance(v, jinja2.Undefined)


def _f(v: Any, spec: str = "{:.0f}") -> str:
    return "—" if _missing(v) else spec.format(v)


def _pct(v: Any, digits: int = 1, sign: str = "") -> str:
    return "—" if _missing(v) else f"{v * 100:{sign}.{digits}f}%"


def _signed(v: Any, digits: int = 2) -> str:
    return "—" if _missing(v) else f"{v:+.{digits}f}"


@functools.lru_cache(maxsize=1)
def _templates() -> Any:
    import jinja2  # lazy: only a report needs it

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.ChainableUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters.update({"f": _f, "pct": _pct, "signed": _signed, "cpu": cpu_label, "goal": fmt_goal,
                        "json": json.dumps})
    return env


def plot(figure: Figure, path: Path) -> Path | None:
    """Draws ``figure`` into ``path``; None (no plot, the report still written) where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None

    def nan(ys: Sequence[float | None]) -> list[float]:
        return [math.nan if y is None else y for y in ys]

    n = len(figure.panels)
    fig, axes = plt.subplots(1, n, figsize=(figure.panel_width * n, 4.5), squeeze=False)
    for ax, panel in zip(axes[0], figure.panels, strict=True):
        for s in panel.series:
            ax.plot(s.xs, nan(s.ys), s.style, marker="o", color=s.color, label=s.label)
            if s.band is not None:
                ax.fill_between(s.xs, nan(s.band[0]), nan(s.band[1]), color=s.color, alpha=0.12)
        for y, label, style, colour in panel.lines:
            ax.axhline(y, color=colour, linestyle=style, lw=0.9, label=label or None)
        for x, label, style, colour in panel.vlines:
            ax.axvline(x, color=colour, linestyle=style, lw=0.9, label=label or None)
        if panel.xticks is not None:
            ax.set_xticks(range(len(panel.xticks)), list(panel.xticks), fontsize=7)
        if panel.xscale == "log2":
            ticks = sorted({x for s in panel.series for x in s.xs})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        if panel.yscale == "symlog":
            ax.set_yscale("symlog", linthresh=1.0)
        elif panel.yscale != "linear":
            ax.set_yscale(panel.yscale)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=panel.legend_size)
    if figure.title:
        fig.suptitle(figure.title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
