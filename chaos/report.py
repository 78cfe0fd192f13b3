"""From what became of every request to the report: counts, losses and recovery time per scenario, JSON and Markdown.

A request belongs to the window it *arrived* in, unless a later fault hit it while it was in flight: then it is that
fault's (``owner``), so that a slow answer that arrived before a scenario began is not blamed on the one before. The
baseline window (steady traffic, no fault) sets, per kind of
request, how long a normal answer takes: ``slow_after = max(3 x p50, p99 + 1 s, 1 s)``. A request is *good* when it
completed within that. Recovery is measured on arrivals after the fault, in one-second buckets: a bucket is good when
the share of good requests in it is at least the baseline's share minus 0.15; the recovery time is the end of the
last bad bucket after the fault (0 when none was bad), or none when the window ended still bad. It counts the
requests that came while the fault lasted and were refused, failed or served late, until the platform answered new
requests as before; requests already in flight at the fault are counted apart (``in_flight_at_fault``). Buckets
are ``bucket_s`` long: one second, or as long as it takes the traffic to bring about eight requests, so that one
slow answer does not make a bucket bad on its own.

Example:
    >>> from chaos.traffic import Outcome
    >>> base = [Outcome("chat", arrival=t / 10, status="completed", end=t / 10 + 1.0) for t in range(50)]
    >>> bounds = latency_bounds(base)
    >>> round(bounds["chat"], 2)
    3.0
    >>> after = [Outcome("chat", arrival=10 + t / 10, status="failed" if t < 15 else "completed",
    ...                  end=10 + t / 10 + 1.0) for t in range(60)]
    >>> recovery(after, fault=10.0, end=16.0, bounds=bounds, baseline_good=1.0)
    (2.0, True)
    >>> bucket_seconds(5.25), bucket_seconds(2.0)
    (2.0, 4.0)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from chaos.traffic import KINDS, Outcome
from loadtests.common import cpu_label, markdown_table, percentile

__all__ = ["bucket_seconds", "latency_bounds", "markdown", "owner", "recovery", "summarize_window"]

BUCKET_S = 1.0
BUCKET_REQUESTS = 8  # a bucket lasts long enough for about this many arrivals
TOLERANCE = 0.15  # a bucket is good at the baseline's share of good requests minus this (one slow answer in 8)


def latency_bounds(baseline: Iterable[Outcome], *, default_s: float = 30.0) -> dict[str, float]:
    """Per kind, the latency past which a completed request counts as served late (``default_s`` for a kind the
    baseline saw fewer than 3 completions of)."""
    by_kind: dict[str, list[float]] = {}
    for o in baseline:
        if o.status == "completed" and o.latency is not None:
            by_kind.setdefault(o.kind, []).append(o.latency)
    bounds = {}
    for kind in KINDS:
        values = by_kind.get(kind, [])
        if len(values) < 3:
            bounds[kind] = default_s
            continue
        p50, p99 = percentile(values, 50) or 0.0, percentile(values, 99) or 0.0
        bounds[kind] = max(3 * p50, p99 + 1.0, 1.0)
    return bounds


def good(o: Outcome, bounds: dict[str, float]) -> bool:
    return o.status == "completed" and o.latency is not None and o.latency <= bounds.get(o.kind, math.inf)


def good_share(outcomes: Sequence[Outcome], bounds: dict[str, float]) -> float:
    return sum(good(o, bounds) for o in outcomes) / len(outcomes) if outcomes else 1.0


def bucket_seconds(rate: float) -> float:
    """A bucket's length for traffic arriving at ``rate`` per second: whole seconds, at least one."""
    return max(BUCKET_S, float(math.ceil(BUCKET_REQUESTS / rate))) if rate > 0 else BUCKET_S


def owner(o: Outcome, windows: Sequence[tuple[float, float, float | None]]) -> int:
    """The index of the window ``o`` belongs to: the first whose fault hit it in flight, else the one it arrived in
    (-1: none). ``windows``: (start, end, fault), in time order.

    >>> w = [(0.0, 10.0, None), (10.0, 20.0, 12.0)]
    >>> owner(Outcome("chat", arrival=9.0, status="completed", end=13.0), w), owner(Outcome("chat", arrival=9.0), w)
    (1, 1)
    >>> owner(Outcome("chat", arrival=9.0, status="completed", end=11.0), w)
    0
    """
    for i, (_, _, fault) in enumerate(windows):
        if fault is not None and o.arrival < fault and (o.end is None or o.end > fault):
            return i
    for i, (start, end, _) in enumerate(windows):
        if start <= o.arrival < end:
            return i
    return -1


def recovery(outcomes: Sequence[Outcome], *, fault: float, end: float, bounds: dict[str, float],
             baseline_good: float, bucket_s: float = BUCKET_S) -> tuple[float | None, bool]:
    """(seconds from the fault to the end of the last bad bucket, whether any bucket was bad); None when the last
    bucket of the window is still bad."""
    threshold = max(0.0, baseline_good - TOLERANCE)
    buckets = max(1, math.ceil((end - fault) / bucket_s))
    last_bad = -1
    for b in range(buckets):
        lo, hi = fault + b * bucket_s, fault + (b + 1) * bucket_s
        inside = [o for o in outcomes if lo <= o.arrival < hi]
        if inside and good_share(inside, bounds) < threshold:
            last_bad = b
    if last_bad < 0:
        return 0.0, False
    if last_bad == buckets - 1:
        return None, True
    return min((last_bad + 1) * bucket_s, end - fault), True


def _counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    c = Counter(o.status for o in outcomes)
    return {"requests": len(outcomes), "completed": c["completed"], "failed": c["failed"], "lost": c["lost"]}


def _reasons(outcomes: Iterable[Outcome], status: str, top: int = 6) -> list[dict[str, Any]]:
    c = Counter((o.kind, o.reason) for o in outcomes if o.status == status)
    examples: dict[tuple[str, str], str] = {}
    for o in outcomes:
        if o.status == status:
            examples.setdefault((o.kind, o.reason), o.detail)
    return [{"kind": k, "reason": r, "count": n, "example": examples[(k, r)][:200]}
            for (k, r), n in c.most_common(top)]


def summarize_window(outcomes: Sequence[Outcome], *, start: float, end: float, fault: float | None,
                     bounds: dict[str, float], baseline_good: float, bucket_s: float = BUCKET_S) -> dict[str, Any]:
    """Counts, reasons and recovery of ``outcomes``: the requests of the window ``[start, end)`` (see :func:`owner`)."""
    inside = list(outcomes)
    out: dict[str, Any] = _counts(inside)
    out["by_kind"] = {k: _counts([o for o in inside if o.kind == k]) for k in KINDS}
    out["failed_reasons"] = _reasons(inside, "failed")
    out["lost_reasons"] = _reasons(inside, "lost")
    out["failovers"] = sum(o.failovers for o in inside)
    out["resumed"] = sum(o.resumed for o in inside)
    out["late"] = sum(1 for o in inside if o.status == "completed" and not good(o, bounds))
    out["cache_hits"] = sum(1 for o in inside if o.cache == "hit")
    out["degraded"] = sum(1 for o in inside if o.degraded)
    out["jobs_retried"] = sum(1 for o in inside if o.kind == "batch" and o.attempts > 1)
    # by arrival second from the window's start: [second, requests, good, failed, lost]
    out["timeline"] = [[b, len(got), sum(good(o, bounds) for o in got), sum(o.status == "failed" for o in got),
                        sum(o.status == "lost" for o in got)]
                       for b in range(math.ceil(end - start))
                       if (got := [o for o in inside if start + b <= o.arrival < start + b + 1])]
    if fault is not None:
        after = [o for o in inside if o.arrival >= fault]
        seconds, hit = recovery(after, fault=fault, end=end, bounds=bounds, baseline_good=baseline_good,
                                bucket_s=bucket_s)
        out["recovery_s"] = seconds
        out["impact_seen"] = hit
        flying = [o for o in inside if o.arrival < fault]  # hit in flight (it is this window's: see owner)
        out["in_flight_at_fault"] = {**_counts(flying), "late": sum(1 for o in flying if o.status == "completed"
                                                                     and not good(o, bounds))}
        before = [o for o in inside if o.arrival < fault]
        out["good_share_before"] = round(good_share(before, bounds), 3)
        out["good_share_after"] = round(good_share(after, bounds), 3)
    return out


# --- Markdown --------------------------------------------------------------------------------------------------------
def _s(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _recovery_cell(row: dict[str, Any]) -> str:
    if row.get("status") != "ran":
        return "—"
    if row.get("fault_lasts_window"):
        return "— (lasts the window)"
    if row["recovery_s"] is None:
        return f"not within {row['observed_s']:.0f} s"
    return _s(row["recovery_s"])


def markdown(report: dict[str, Any]) -> str:
    machine, mode = report["machine"], report["mode"]
    lines = [
        f"# Chaos suite ({mode['name']} mode)",
        "",
        f"Run on {cpu_label(machine)}, {machine.get('cores_usable')} usable cores, "
        f"{mode['engine_label']}; {report['platform']['summary']}. "
        f"Generated {report.get('generated_at', '')} by `python -m chaos --mode {mode['name']}` "
        f"in {report['runtime_s']:.0f} s (platform start {report['platform']['start_s']:.1f} s).",
        "",
        f"Traffic (open loop, through both gateways' REST API): {report['traffic']['summary']}.",
        "",
        "Outcomes: **completed** (a whole answer), **failed** (a clear error: OpenAI-shaped HTTP error, an SSE error "
        "event, a job that ended failed/expired), **lost** (hung past its deadline, connection reset with no "
        "error, a stream truncated without an error, a job the gateway forgot). Goal: lost = 0. **Recovery**: "
        f"from the fault until requests arriving are answered as in the baseline again (buckets of "
        f"{report.get('recovery_bucket_s', 1):g} s, within the baseline's latency and share of good answers; a "
        "request in flight at a fault counts in that fault's scenario); **detected**: until the platform noticed "
        "by itself (a new leader, the worker ejected); **back**: until the faulty component served again "
        "after its restart / thaw.",
        "",
    ]
    rows = []
    for row in report["scenarios"]:
        if row["status"] != "ran":
            rows.append([row["name"], row["title"], "—", "—", "—", "—", "—", "—", "—",
                         f"**{row['status']}**: {row.get('why', '')}"])
            continue
        s = row["summary"]
        verdict = "holds" if s["lost"] == 0 else ("expected: " + row["why_loss"][:60] + "…" if row["why_loss"]
                                                  else "**LOSS**")
        rows.append([row["name"], row["title"], s["requests"], s["completed"], s["failed"], s["lost"],
                     _recovery_cell({**row, **s, "observed_s": row["observed_s"]}), _s(row.get("detected_s")),
                     _s(row.get("back_s")), verdict])
    base = report["baseline"]
    rows.insert(0, ["baseline", "steady traffic, no fault", base["requests"], base["completed"], base["failed"],
                    base["lost"], "—", "—", "—", "holds" if base["lost"] == 0 else "**LOSS**"])
    lines.append(markdown_table(["scenario", "fault", "requests", "completed", "failed (clear)", "lost",
                                 "recovery s", "detected s", "back s", "verdict"], rows))
    lines += ["", "## Per scenario", ""]
    for row in report["scenarios"]:
        lines.append(f"### {row['name']}")
        lines.append("")
        if row["status"] != "ran":
            lines += [f"{row['status']}: {row.get('why', '')}", ""]
            continue
        s = row["summary"]
        notes = ", ".join(f"{k}={v}" for k, v in row["notes"].items())
        flying = s["in_flight_at_fault"]
        lines.append(f"{row['title']} ({notes}). Fault at +{row['fault_at_s']:.1f} s of the window, undone at "
                     f"+{row['restored_at_s']:.1f} s after it, observed {row['observed_s']:.0f} s. "
                     f"In flight at the fault: {flying['requests']} ({flying['completed']} completed, "
                     f"{flying['late']} of them late; {flying['failed']} failed, {flying['lost']} lost). "
                     f"Good share of answers before the fault {s['good_share_before']:.0%}, after it "
                     f"{s['good_share_after']:.0%}; served late {s['late']}; client failovers {s['failovers']}; "
                     f"streams resumed {s['resumed']}; jobs that took more than one attempt {s['jobs_retried']}; cache "
                     f"hits {s['cache_hits']}; degraded answers {s['degraded']}.")
        if row.get("health_after"):
            lines.append(f"Platform after the scenario: {row['health_after']}.")
        lines.append("")
        kinds = [[k, c["requests"], c["completed"], c["failed"], c["lost"]] for k, c in s["by_kind"].items()
                 if c["requests"]]
        lines.append(markdown_table(["kind", "requests", "completed", "failed", "lost"], kinds))
        for status in ("failed", "lost"):
            reasons = s[f"{status}_reasons"]
            if reasons:
                lines += ["", f"{status.capitalize()}:", ""]
                lines += [f"- {r['count']} × {r['kind']}: `{r['reason']}` — {r['example']}" for r in reasons]
        lines.append("")
    if report.get("findings"):
        lines += ["## Findings", ""] + [f"- {f}" for f in report["findings"]] + [""]
    return "\n".join(lines)
