"""The workload trace (``TRACE__PATH``): a sample of finished answers written as JSON lines in the format of
:mod:`goodput_contracts.trace`, for capacity planning (``python -m loadtests.replay``) and simulator calibration
(``python -m loadtests.calibrate``). Not an OpenTelemetry trace: one line per request, no spans.

Off the response path: :meth:`TraceRecorder.offer` draws the sample and, for a sampled request only, builds its
record and puts it on a bounded queue (a full queue drops the record and counts it); one background thread writes the
lines. Bounded on disk: when the file would pass ``max_bytes`` it is renamed to ``<path>.1`` (replacing the previous
one) and a new file is begun, so the trace never takes more than twice ``max_bytes``.

Privacy: a record has no prompt or answer text (the format has no field for it) and the tenant only as a salted hash
(``TRACE__SALT``; empty = a random salt per process, so pseudonyms are not linkable across restarts).

Example::

    recorder = TraceRecorder.from_settings(settings, registry=registry)   # None when TRACE__PATH is empty
    recorder.offer(lambda tenant: TraceRecord(..., tenant=tenant), tenant="acme")
    recorder.close()   # writes what is queued, then stops the thread
"""

from __future__ import annotations

import logging
import os
import queue
import random
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from prometheus_client import CollectorRegistry, Counter

from goodput_contracts.trace import TraceRecord, tenant_hash
from goodput_core.priority import priority_name

from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd
from goodput_gateway.generation import Opened
from goodput_gateway.timing import Timeline

__all__ = ["TraceRecorder", "answer_record"]

log = logging.getLogger("goodput.gateway.trace")
_STOP = object()


class TraceRecorder:
    def __init__(self, path: str | Path, *, sample: float, max_bytes: int, salt: str = "",
                 registry: CollectorRegistry | None = None, rng: random.Random | None = None,
                 queue_size: int = 10_000) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be within 0..1, got {sample}")
        self.path = Path(path)
        self.sample = sample
        self.max_bytes = max_bytes
        self._salt = salt or secrets.token_hex(16)
        self._rng = rng or random.Random()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self.records = Counter("goodput_gateway_trace_records_total", "Answers offered to the workload trace "
                               "(TRACE__PATH), by what became of them: written, dropped (the writer's queue was "
                               "full, or it failed) or rotated (a file set aside at TRACE__MAX_BYTES).", ["result"],
                               registry=registry)
        self._thread = threading.Thread(target=self._write, name="goodput-trace-writer", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, settings: GatewaySettings, *,
                      registry: CollectorRegistry | None = None) -> TraceRecorder | None:
        """The gateway's recorder, or None when the trace is off (no path, or a sample of 0)."""
        if not settings.trace.path or settings.trace.sample <= 0:
            return None
        return cls(settings.trace.path, sample=settings.trace.sample, max_bytes=settings.trace.max_bytes,
                   salt=settings.trace.salt.get_secret_value(), registry=registry)

    def offer(self, build: Callable[[str], TraceRecord], *, tenant: str) -> bool:
        """Draws the sample; a sampled request's record (``build(tenant pseudonym)``) is queued for the writer.
        Never blocks and never raises into the request path; True when queued."""
        if self._rng.random() >= self.sample:
            return False
        try:
            self._queue.put_nowait(build(tenant_hash(tenant, salt=self._salt)))
        except queue.Full:
            self.records.labels("dropped").inc()
            return False
        except Exception:  # noqa: BLE001 - a record that cannot be built is lost, never the answer
            log.exception("could not build a trace record")
            self.records.labels("dropped").inc()
            return False
        return True

    def offer_answer(self, opened: Opened, timeline: Timeline, end: StreamEnd | None) -> bool:
        """A finished answer offered to the trace (:func:`answer_record`)."""
        return self.offer(lambda tenant: answer_record(opened, timeline, end, tenant=tenant, sample=self.sample),
                          tenant=opened.tenant)

    def close(self, timeout_s: float = 5.0) -> None:
        """Writes what is queued and stops the writer (idempotent)."""
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                return  # the writer is stuck (a hung disk): it is a daemon thread, left behind
            self._thread.join(timeout_s)

    # ---- the writer thread ---------------------------------------------------------------------------------------

    def _write(self) -> None:
        f: IO[str] | None = None
        size = 0
        stopping = False
        try:
            while not stopping:
                item = self._queue.get()
                if item is _STOP:
                    return
                batch = [item]
                while True:  # whatever else is queued goes out with it, then one flush
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stopping = True
                        break
                    batch.append(more)
                for rec in batch:
                    assert isinstance(rec, TraceRecord)
                    line = rec.to_json_line() + "\n"
                    try:
                        if f is None:
                            f, size = self._open()
                        if size and size + len(line) > self.max_bytes:
                            f.close()
                            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                            self.records.labels("rotated").inc()
                            f, size = self._open()
                        f.write(line)
                        size += len(line)
                        self.records.labels("written").inc()
                    except OSError:
                        log.exception("could not write the workload trace", extra={"path": str(self.path)})
                        self.records.labels("dropped").inc()
                        f = None
                if f is not None:
                    f.flush()
        finally:
            if f is not None:
                f.close()

    def _open(self) -> tuple[IO[str], int]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - the writer thread owns it
        return f, f.tell()


def answer_record(opened: Opened, timeline: Timeline, end: StreamEnd | None, *, tenant: str,
                  sample: float) -> TraceRecord:
    """A finished answer as a trace record: token counts as the worker reported them (its final event), latencies
    from the request's timeline, the arrival on the wall clock."""
    arrived_wall = time.time() - (time.monotonic() - timeline.arrived)
    completion = end.completion_tokens if end is not None else timeline.completion_tokens
    tpot = timeline.tpot() if completion > 1 else None
    return TraceRecord(
        arrival_s=round(arrived_wall, 6), priority=priority_name(opened.priority), model=opened.model,
        prompt_tokens=end.prompt_tokens if end is not None else 0, output_tokens=completion,
        max_tokens=opened.request.sampling.max_tokens, cached_tokens=end.cached_tokens if end is not None else None,
        outcome="cache_hit" if opened.worker_id == "cache" else (end.finish_reason if end is not None else "abort"),
        ttft_s=timeline.ttft(), tpot_s=tpot or None, e2e_s=timeline.total(), tenant=tenant, sample=sample)
