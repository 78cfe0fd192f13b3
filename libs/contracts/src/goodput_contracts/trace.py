"""The workload trace: one finished request per JSON line, as the gateway records it (``GOODPUT_GATEWAY_TRACE__PATH``)
and as ``loadtests.replay`` and ``loadtests.calibrate`` read it. Defined once, here, so the two sides cannot drift.

A record says what a capacity plan needs and nothing a tenant would mind: when the request arrived, its class and
model, how long its prompt and answer were (in tokens, as the worker counted them), how much of the prompt the
engine's prefix cache held, what it asked for as ``max_tokens``, how it ended, and the latency it was served with
(TTFT, TPOT, end to end), so that a replay can be compared with the original. It has **no prompt or answer text**
(the schema has no field that could hold one) and no tenant name: at most a salted hash of it
(:func:`tenant_hash`), which groups a tenant's requests without naming the tenant.

``sample`` is the fraction of requests the recorder kept (``TRACE__SAMPLE``): a trace recorded at 0.01 holds about one
request in a hundred, so replaying it at ``--speed 100`` approximates the full arrival rate.

Example:
    >>> r = TraceRecord(arrival_s=1700000000.25, priority="P1", model="smollm2", prompt_tokens=812, output_tokens=64,
    ...                 max_tokens=64, cached_tokens=512, outcome="length", ttft_s=0.1234567, tpot_s=0.0151)
    >>> line = r.to_json_line()
    >>> line[:60]
    '{"v": 1, "arrival_s": 1700000000.25, "priority": "P1", "prom'
    >>> TraceRecord.from_json_line(line) == replace(r, ttft_s=0.123457)   # latencies kept to the microsecond
    True
    >>> tenant_hash("acme", salt="s3cret") == tenant_hash("acme", salt="s3cret") != tenant_hash("acme", salt="other")
    True
    >>> relative([r, replace(r, arrival_s=1700000001.0)])[1].arrival_s
    0.75
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["OUTCOMES", "PRIORITIES", "TRACE_VERSION", "TraceRecord", "read_trace", "relative", "tenant_hash"]

TRACE_VERSION = 1
PRIORITIES = ("P0", "P1", "P2")
# How a recorded answer ended: the engine's finish reason, or answered from the gateway's response cache (no engine
# work: a replay skips it unless asked to send it).
OUTCOMES = ("stop", "length", "abort", "cache_hit")
_REQUIRED = ("arrival_s", "priority", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class TraceRecord:
    """One finished request. Times in seconds; ``None`` where unknown."""

    arrival_s: float  # as recorded: seconds since the epoch; after relative(): since the trace's first arrival
    priority: str  # its class: "P0", "P1" or "P2"
    prompt_tokens: int  # as the worker counted them (chat template included)
    output_tokens: int  # generated
    model: str = ""  # the served model that answered
    max_tokens: int = 0  # as asked; 0 = not set (the gateway's default applied)
    cached_tokens: int | None = None  # of prompt_tokens, from the engine's prefix cache
    outcome: str = "stop"  # one of OUTCOMES
    ttft_s: float | None = None  # arrival at the gateway to the first token (None: a cache hit)
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None  # arrival to the answer's end
    tenant: str = ""  # tenant_hash() of the tenant, or empty
    sample: float = 1.0  # the fraction of requests recorded when this one was

    def to_json_line(self) -> str:
        """One line of JSON (no newline), latencies rounded to the microsecond."""
        doc: dict[str, Any] = {"v": TRACE_VERSION}
        for name, value in asdict(self).items():
            if isinstance(value, float) and name != "arrival_s":
                value = round(value, 6)
            doc[name] = value
        return json.dumps(doc, separators=(", ", ": "))

    @classmethod
    def from_json_line(cls, line: str) -> TraceRecord:
        """A record from one line; keys this version does not know are ignored (a newer writer's additions)."""
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ValueError("a trace line must be a JSON object")
        missing = [k for k in _REQUIRED if k not in doc]
        if missing:
            raise ValueError(f"a trace line lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        rec = cls(**{k: v for k, v in doc.items() if k in known})
        if rec.priority not in PRIORITIES:
            raise ValueError(f"unknown class {rec.priority!r}; expected one of {', '.join(PRIORITIES)}")
        return rec


def tenant_hash(tenant: str, *, salt: str) -> str:
    """A tenant's pseudonym in a trace: 12 hex digits of an HMAC under ``salt`` (the same tenant, the same salt: the
    same pseudonym; without the salt it cannot be tied back to the name)."""
    return hmac.new(salt.encode(), tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:12]


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a trace file (blank lines skipped), in arrival order. A malformed line raises ValueError with
    its line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRecord.from_json_line(line))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{n}: {err}") from None
    return sorted(out, key=lambda r: r.arrival_s)


def relative(records: Iterable[TraceRecord]) -> list[TraceRecord]:
    """The records in arrival order with arrivals counted from the first one (seconds since the trace's start)."""
    ordered = sorted(records, key=lambda r: r.arrival_s)
    if not ordered:
        return []
    t0 = ordered[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in ordered]
