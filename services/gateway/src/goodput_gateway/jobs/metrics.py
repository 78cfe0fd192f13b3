"""The deferred jobs' metrics (:class:`JobsMetrics`): transitions counted in this process, and what every process
shares read from Redis off the scrape path."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_core.metrics import SharedCounter, StoreReadings

from goodput_gateway.jobs.records import OUTCOMES, RECOVERIES, STATES, VERDICTS

__all__ = ["JobCounts", "JobsMetrics"]


class JobCounts(Protocol):
    """What the metrics read from Redis (:class:`~goodput_gateway.jobs.store.JobQueue` answers them)."""

    def count(self, state: str) -> int: ...

    def tally(self, name: str) -> dict[str, int]: ...


class JobsMetrics:
    """Transitions counted in this process; jobs by state, attempts by outcome, messages by verdict and recoveries
    by reason read from Redis off the scrape path (``readings``: the gateway starts them on its event loop; a
    worker's metrics thread reads on a scrape, waiting ``scrape_wait_s`` at most), so that a scrape never waits on
    Redis."""

    def __init__(self, registry: CollectorRegistry | None, queue: JobCounts | None = None, *,
                 scrape_wait_s: float = 0.0) -> None:
        self.transitions = Counter("goodput_gateway_deferred_job_transitions_total",
                                   "Deferred jobs entering a state (in this process).", ["state"], registry=registry)
        self.readings: StoreReadings | None = None
        if registry is not None and queue is not None:
            self.readings = StoreReadings("gateway_jobs", registry, scrape_wait_s=scrape_wait_s)
            jobs = Gauge("goodput_gateway_deferred_jobs", "Deferred jobs by state (from Redis, all processes; "
                         "NaN until first read).", ["state"], registry=registry)
            for state in STATES:
                jobs.labels(state).set_function(_last_count(self.readings.add(state, partial(queue.count, state))))
            for name, label, known, doc in (
                    ("attempts", "outcome", OUTCOMES, "Attempts of deferred jobs by outcome (lost: its worker died "
                     "and its claim lapsed)"),
                    ("messages", "verdict", VERDICTS, "Deferred jobs' messages by what they did (duplicate, stale: "
                     "nothing, the job had run or was running)"),
                    ("recoveries", "reason", RECOVERIES, "Deferred jobs the sweeper sent again (lost_message), "
                     "requeued after their worker died (lease_expired) or expired (deadline)")):
                read = self.readings.add(name, partial(queue.tally, name))
                registry.register(SharedCounter(f"goodput_gateway_deferred_job_{name}",
                                                f"{doc} (from Redis, all processes).", label, read=read, known=known))


def _last_count(last: Callable[[], Any]) -> Callable[[], float]:
    def read() -> float:
        value = last()
        return float("nan") if value is None else float(value)
    return read
