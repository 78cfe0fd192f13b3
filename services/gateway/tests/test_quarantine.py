"""Who is suspected of crashing a worker (goodput_gateway.quarantine), on a clock the test moves: a worker lost with
several requests suspects none of them, even as the others move on elsewhere (one incident is judged by the company
its first loss found); the same request lost with a second worker is suspected; the quarantine ends after its time;
0 turns it off. The pipeline's side (not retried, refused before any worker, REST 422 and gRPC FAILED_PRECONDITION)
is tests/integration/test_failover.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from goodput_gateway.config import QuarantineSettings
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.quarantine import INCIDENT_S, Quarantine, Quarantined

from .helpers import FakeClock


def quarantine(clock: FakeClock, **settings: float) -> tuple[Quarantine, CollectorRegistry]:
    registry = CollectorRegistry()
    return Quarantine(QuarantineSettings(**settings), GatewayMetrics(registry), clock=clock), registry


def counted(registry: CollectorRegistry, event: str) -> float:
    return registry.get_sample_value("goodput_gateway_poison_requests_total", {"event": event}) or 0.0


def test_a_worker_lost_with_several_requests_suspects_only_the_one_that_loses_a_second() -> None:
    clock = FakeClock(100.0)
    q, registry = quarantine(clock)
    # worker 1 dies with three requests in flight: none suspected, not even the last judged, when the others have
    # moved on by then (its company is the incident's)
    assert q.lost("a", worker="w1", address="10.0.0.1:1", here=3) is None
    assert q.lost("b", worker="w1", address="10.0.0.1:1", here=2) is None
    assert q.lost("c", worker="w1", address="10.0.0.1:1", here=1) is None
    # "a" goes on on worker 2, which dies too, busy as well: "a" it is
    crashed = q.lost("a", worker="w2", address="10.0.0.2:1", here=4)
    assert isinstance(crashed, Quarantined) and crashed.code == "request_quarantined"
    assert crashed.http_status == 422 and crashed.retry_after_s == 600.0
    with pytest.raises(Quarantined):
        q.check("a")
    q.check("b")  # the others are served
    q.check("c")
    # the same worker lost twice with a request (restarted at its address) is not two workers
    clock.advance(INCIDENT_S + 1)
    assert q.lost("b", worker="w1", address="10.0.0.1:1", here=2) is None
    assert (counted(registry, "crashed_again"), counted(registry, "refused")) == (1.0, 1.0)


def test_the_quarantine_ends_after_its_time_and_zero_turns_it_off() -> None:
    clock = FakeClock(100.0)
    q, registry = quarantine(clock, ttl_s=60.0)
    assert q.lost("a", worker="w1", address="10.0.0.1:1", here=1, listed=1) is not None  # alone
    clock.advance(45)
    with pytest.raises(Quarantined) as refused:
        q.check("a")
    assert refused.value.retry_after_s == pytest.approx(15.0)
    clock.advance(16)
    q.check("a")
    assert q.lost("b", worker="w3", address="10.0.0.3:1", here=1, listed=2) is None  # the scheduler knew of another
    assert counted(registry, "crashed_alone") == 1.0

    off, _ = quarantine(clock, ttl_s=0.0)
    assert off.lost("a", worker="w1", address="10.0.0.1:1", here=1) is None
    off.check("a")
