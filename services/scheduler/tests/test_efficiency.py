"""Scheduling-level waste: worker-seconds in which a healthy worker had room while a request it could serve waited
(goodput_scheduler_idle_while_queued_seconds_total{priority}, goodput_scheduler_queued_with_idle_workers), driven
over the scheduler's gRPC API against stand-in workers; time is the harness's manual clock."""

from __future__ import annotations

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2

from .conftest import SchedulerHarness, open_lease, scheduler_settings

P0, P1, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P1, types_pb2.PRIORITY_P2
IDLE = "goodput_scheduler_idle_while_queued_seconds_total"
NOW = "goodput_scheduler_queued_with_idle_workers"
LONG = 300  # call timeout (s): longer than any time the tests advance, so no request expires


def settings(addresses: list[str], **overrides: object):  # type: ignore[no-untyped-def]
    # A cap of 4 leases per worker; P1 and P2 are granted only below half of it (headroom kept for P0). No shedding,
    # and a request outlives any time its worker is ejected.
    base: dict[str, object] = dict(max_inflight_per_worker=4, p1_max_share=0.5, p2_max_share=0.5, shed_p2_at=100,
                                   shed_p1_at=100, no_worker_wait_s=600)
    return scheduler_settings(addresses, **{**base, **overrides})


def idle_seconds(h: SchedulerHarness) -> dict[str, float]:
    return {p: h.metric(IDLE, {"priority": p}) for p in ("P0", "P1", "P2")}


async def test_worker_seconds_with_room_while_work_waits_are_counted(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    async with SchedulerHarness(settings([a.address, b.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        held = [(await open_lease(h, f"batch-{i}", LONG, priority=P2))[0] for i in range(4)]  # 2 on each worker
        assert idle_seconds(h) == {"P0": 0, "P1": 0, "P2": 0} and h.metric(NOW, {}) == 0
        waiting, event = await open_lease(h, "batch-4", LONG, priority=P2, skip_queued=False)
        assert event.HasField("queued")  # both workers at P2's share: 2 leases of 4, room held back for P0
        assert h.metric(NOW, {}) == 1
        await h.clock.advance(3)
        assert idle_seconds(h) == pytest.approx({"P0": 0, "P1": 0, "P2": 6})  # two workers for 3 s
        # P0 fills both workers to their cap: no room anywhere, so nothing is counted.
        p0 = [(await open_lease(h, f"chat-{i}", LONG, priority=P0))[0] for i in range(4)]
        assert [w.inflight for w in h.workers.all()] == [4, 4] and h.metric(NOW, {}) == 0
        await h.clock.advance(2)
        assert idle_seconds(h)["P2"] == pytest.approx(6)
        p0[0].cancel()  # one P0 lease ends: its worker has room again (the P2 request still waits: 3 of 4 held)
        await h.until(lambda: sorted(w.inflight for w in h.workers.all()) == [3, 4])
        assert h.metric(NOW, {}) == 1
        await h.clock.advance(2)
        assert idle_seconds(h)["P2"] == pytest.approx(8)
        # The P0 leases and one P2 lease end: the waiting request takes its place and nothing waits any more.
        for call in [*p0, held[0]]:
            call.cancel()
        await h.until(lambda: h.leases.queued() == 0)
        assert h.metric(NOW, {}) == 0
        await h.clock.advance(5)
        assert idle_seconds(h) == pytest.approx({"P0": 0, "P1": 0, "P2": 8})
        for call in [*held, *p0, waiting]:
            call.cancel()


async def test_each_worker_second_counts_once_for_the_most_urgent_class_waiting(  # type: ignore[no-untyped-def]
        workers) -> None:
    (a,) = await workers(1)
    async with SchedulerHarness(settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        held = [(await open_lease(h, f"chat-{i}", LONG, priority=P0))[0] for i in range(2)]
        waiting = []
        for request_id, priority in (("batch", P2), ("background", P1)):  # both at their share (2 of 4): they wait
            call, event = await open_lease(h, request_id, LONG, priority=priority, skip_queued=False)
            assert event.HasField("queued")
            waiting.append(call)
        await h.clock.advance(4)
        assert idle_seconds(h) == pytest.approx({"P0": 0, "P1": 4, "P2": 0})
        waiting[1].cancel()  # the P1 request gives up: P2 is the most urgent class waiting now
        await h.until(lambda: h.leases.queued(P1) == 0)
        await h.clock.advance(1)
        assert idle_seconds(h) == pytest.approx({"P0": 0, "P1": 4, "P2": 1})
        for call in [*held, *waiting]:
            call.cancel()


async def test_a_full_worker_or_one_that_cannot_serve_the_model_is_not_idle(  # type: ignore[no-untyped-def]
        workers) -> None:
    (a,) = await workers(1)  # serves model "m"
    async with SchedulerHarness(settings([a.address], max_inflight_per_worker=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        other, event = await open_lease(h, "other-model", LONG, model="other", skip_queued=False)
        assert event.HasField("queued")  # no worker serves it
        await h.clock.advance(3)
        assert idle_seconds(h) == {"P0": 0, "P1": 0, "P2": 0} and h.metric(NOW, {}) == 0
        other.cancel()
        await h.until(lambda: h.leases.queued() == 0)
        holder, _ = await open_lease(h, "holder", LONG, model="m")
        waiting, event = await open_lease(h, "next", LONG, model="m", skip_queued=False)
        assert event.HasField("queued")  # the worker is at its cap
        await h.clock.advance(3)
        assert idle_seconds(h) == {"P0": 0, "P1": 0, "P2": 0} and h.metric(NOW, {}) == 0
        for call in (holder, waiting):
            call.cancel()


async def test_a_worker_whose_kv_cache_is_full_has_no_room(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        held = [(await open_lease(h, f"batch-{i}", LONG, priority=P2))[0] for i in range(2)]
        waiting, event = await open_lease(h, "batch-2", LONG, priority=P2, skip_queued=False)
        assert event.HasField("queued") and h.metric(NOW, {}) == 1
        a.load = inference_pb2.WorkerLoad(max_num_seqs=8, ready=True, kv_cache_usage=0.99)  # above kv_full (0.97)
        await h.until(lambda: h.metric(NOW, {}) == 0)  # at its next load check
        await h.clock.advance(3)
        assert idle_seconds(h)["P2"] == 0
        for call in [*held, waiting]:
            call.cancel()


async def test_an_ejected_worker_stops_counting_until_it_is_readmitted(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        held = [(await open_lease(h, f"batch-{i}", LONG, priority=P2))[0] for i in range(2)]
        waiting, event = await open_lease(h, "batch-2", LONG, priority=P2, skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(2)
        await a.set_serving(False)
        await h.until(lambda: not h.workers.healthy())
        assert h.metric(NOW, {}) == 0
        await h.clock.advance(5)
        assert idle_seconds(h)["P2"] == pytest.approx(2)
        await a.set_serving(True)
        await h.until(lambda: len(h.workers.healthy()) == 1)
        assert h.metric(NOW, {}) == 1
        await h.clock.advance(1.5)
        assert idle_seconds(h)["P2"] == pytest.approx(3.5)
        for call in [*held, waiting]:
            call.cancel()
