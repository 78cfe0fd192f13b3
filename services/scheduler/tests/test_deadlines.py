"""Seed 002's backpressure: a request predicted not to finish before its deadline is refused at once (504), or told
when to come back (429 + retry-after) when only the queue ahead of it is in the way; it never reaches a worker.
Its class's queue-wait budget (Admit.max_queue_wait_s) bounds how long it may wait."""

from __future__ import annotations

import grpc
import pytest
from goodput.common.v1 import types_pb2

from goodput_core.errors import GoodputError

from goodput_scheduler.predict import ServiceTimePredictor

from .conftest import SchedulerHarness, open_lease, scheduler_settings

P0 = types_pb2.PRIORITY_P0


async def test_a_request_that_cannot_finish_in_time_is_refused_at_once(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        with pytest.raises(GoodputError) as err:  # 400 tokens at >= 1 ms each, 100 ms to go
            await open_lease(h, "late", timeout=0.1, max_tokens=400, prompt_tokens_estimate=20)
        assert err.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.code == "deadline_unreachable"
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "predicted_late"}) == 1
        assert h.metric("goodput_scheduler_admissions_total", {"priority": "P0"}) == 0
        ok, event = await open_lease(h, "fits", timeout=10, max_tokens=400)  # the same, with time: granted
        assert event.HasField("granted")
        ok.cancel()


async def test_a_request_that_would_fit_later_is_told_when(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, shed_p2_at=100, shed_p1_at=100)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, _ = await open_lease(h, "hold", timeout=60, max_tokens=10)
        queued, event = await open_lease(h, "queued", timeout=60, max_tokens=10, skip_queued=False)
        assert event.HasField("queued")
        with pytest.raises(GoodputError) as err:  # it alone takes ~10 ms; behind the queue, ~2 s
            await open_lease(h, "later", timeout=1.5, max_tokens=10)
        assert err.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.code == "deadline_unreachable_now" and (err.value.retry_after_s or 0) >= 1
        for c in (holder, queued):
            c.cancel()


async def test_the_queue_wait_budget_bounds_the_wait(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, shed_p2_at=100, shed_p1_at=100)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, _ = await open_lease(h, "hold", timeout=60, max_tokens=10)
        waiting, event = await open_lease(h, "budgeted", timeout=60, max_tokens=10, max_queue_wait_s=2.0,
                                          skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(2.5)  # its budget (not its 60 s deadline) passes while it waits
        with pytest.raises(GoodputError) as err:
            await waiting.read()
        assert err.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED and "queue-wait budget" in err.value.message
        assert h.metric("goodput_scheduler_admissions_total", {"priority": "P0"}) == 1  # only the holder
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "queue_budget"}) == 1
        holder.cancel()
        await h.until(lambda: h.workers.all()[0].inflight == 0)
        # the budget bounds the wait only: a request whose service outlasts it (not its deadline) is granted
        ok, event = await open_lease(h, "long", timeout=10, max_tokens=400, max_queue_wait_s=0.05)
        assert event.HasField("granted")
        ok.cancel()


def test_the_predictor_learns_from_finished_requests() -> None:
    p = ServiceTimePredictor(prefill_s_per_token=0.0001, tpot_s=0.001)
    assert p.expected_tokens(400) == 400  # nothing seen yet: the caller's bound
    for _ in range(30):  # 20-token answers at 50 ms a token
        p.observe(prompt_tokens=50, completion_tokens=20, ttft_s=0.1, duration_s=0.1 + 19 * 0.05)
    assert p.tpot_s == pytest.approx(0.05, rel=0.01) and p.expected_tokens(400) == 40
    assert p.service_s(prompt_tokens=50, max_tokens=400) == pytest.approx(0.1 + 40 * 0.05, rel=0.02)
    # an answer that runs to max_tokens (ignore_eos: Admit.fixed_output) is predicted whole, whatever was seen
    assert p.expected_tokens(400, fixed=True) == 400
    assert p.service_s(prompt_tokens=50, max_tokens=400, fixed=True) == pytest.approx(0.1 + 400 * 0.05, rel=0.02)
    p.observe(prompt_tokens=50, completion_tokens=20, ttft_s=0, duration_s=1)  # no first token: ignored
    assert p.observed == 30
