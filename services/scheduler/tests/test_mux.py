"""Many leases over one stream (Scheduler/LeaseBatches, the gateway's): each lease is placed as any lease is, a
refusal is an event for that lease alone, cancel withdraws, and a stream that ends gives back everything it held. The
gateway's client side (goodput_gateway.leasemux.LeaseStream) is tested against a scheduler process in
tests/integration/test_lease_stream.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2

from .conftest import SchedulerHarness, Stream, scheduler_settings

P0, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P2


def admit(lease_id: str, *, priority: int = P0, timeout_s: float = 30.0) -> scheduler_pb2.LeaseMuxRequest:
    return scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, timeout_s=timeout_s, admit=scheduler_pb2.Admit(
        request_id=lease_id, tenant="t", priority=priority))  # type: ignore[arg-type]


async def test_many_leases_share_one_stream_and_each_is_released_on_its_own(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    async with SchedulerHarness(scheduler_settings([a.address, b.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        s = Stream(h)
        for i in range(4):
            s.send(admit(f"r{i}"))
        granted = {}
        while len(granted) < 4:
            event = await s.next("granted")
            granted[event.lease_id] = event.granted.address
        assert sorted(granted.values()).count(a.address) == 2  # placed as any lease is: spread
        assert sum(w.inflight for w in h.workers.all()) == 4
        s.send(scheduler_pb2.LeaseMuxRequest(lease_id="r1", first_token=scheduler_pb2.FirstToken(ttft_s=0.1)))
        s.send(scheduler_pb2.LeaseMuxRequest(lease_id="r1", release=scheduler_pb2.Release(
            outcome=scheduler_pb2.OUTCOME_OK)))
        assert (await s.next("released")).lease_id == "r1"
        assert sum(w.inflight for w in h.workers.all()) == 3
        # the stream ends (the gateway went away): everything it held goes back
        s.cancel()
        await h.until(lambda: sum(w.inflight for w in h.workers.all()) == 0)


async def test_a_refusal_is_an_event_for_that_lease_and_the_stream_goes_on(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, p0_max_queue=1)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        s = Stream(h)
        s.send(admit("held"))
        assert (await s.next("granted")).lease_id == "held"
        s.send(admit("waits"))
        assert (await s.next("queued")).lease_id == "waits"
        s.send(admit("refused"))  # the P0 queue (depth 1) is full
        event = await s.next("error")
        assert (event.lease_id, event.error.status, event.error.code) == ("refused", "RESOURCE_EXHAUSTED",
                                                                          "queue_full")
        assert event.error.retry_after_s > 0
        # cancel withdraws the queued one; the place it held is free again
        s.send(scheduler_pb2.LeaseMuxRequest(lease_id="waits", cancel=scheduler_pb2.Cancel()))
        assert (await s.next("released")).lease_id == "waits"
        assert h.leases.queued() == 0
        # bad messages are refused by name, the stream stays
        s.send(admit("held"))
        event = await s.next("error")
        assert (event.lease_id, event.error.status, event.error.param) == ("held", "INVALID_ARGUMENT", "lease_id")
        s.send(admit(""))
        assert (await s.next("error")).error.param == "lease_id"
        s.send(admit("nan", timeout_s=float("nan")))
        assert (await s.next("error")).error.param == "timeout_s"
        s.send(scheduler_pb2.LeaseMuxRequest(lease_id="held", release=scheduler_pb2.Release()))
        assert (await s.next("released")).lease_id == "held"
        s.close()


async def test_the_open_leases_of_one_stream_are_bounded(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], mux={"max_leases": 2})) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        s = Stream(h)
        for i in range(3):
            s.send(admit(f"r{i}"))
        event = await s.next("error")
        assert (event.lease_id, event.error.code) == ("r2", "too_many_leases")
        s.cancel()


async def test_lease_batches_carry_many_lease_messages_each_way_in_order(workers) -> None:  # type: ignore[no-untyped-def]
    """One message with several leases' admits is answered lease by lease (the grants of a batch come back together),
    a release in the same batch as its lease's first token is taken in order, and the stream's end gives back what
    it held."""
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        s = Stream(h)
        s.send(*[admit(f"r{i}") for i in range(5)])
        grants = [await s.next("granted") for _ in range(5)]
        assert [g.lease_id for g in grants] == [f"r{i}" for i in range(5)]  # in the order admitted
        worker = h.workers.all()[0]
        assert worker.inflight == 5
        # each grant says how many lease slots its worker had left (what a gateway's speculative start weighs)
        cap = worker.lease_cap(h.leases.settings.max_inflight_per_worker)
        assert [g.granted.free_slots for g in grants] == [cap - n for n in range(1, 6)]
        s.send(scheduler_pb2.LeaseMuxRequest(lease_id="r0", first_token=scheduler_pb2.FirstToken(ttft_s=0.1)),
               scheduler_pb2.LeaseMuxRequest(lease_id="r0", release=scheduler_pb2.Release(
                   outcome=scheduler_pb2.OUTCOME_OK, completion_tokens=3)),
               scheduler_pb2.LeaseMuxRequest(lease_id="r1", cancel=scheduler_pb2.Cancel()))
        assert {(await s.next("released")).lease_id for _ in range(2)} == {"r0", "r1"}
        assert h.workers.all()[0].inflight == 3
        s.close()  # the gateway closes its side: the three still held go back
        await h.until(lambda: h.workers.all()[0].inflight == 0)


async def test_a_batch_over_the_bound_ends_the_stream_invalid_and_gives_back_what_it_held(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], mux={"max_batch": 2})) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        s = Stream(h)
        s.send(admit("r0"), admit("r1"))  # at the bound: taken
        for _ in range(2):
            await s.next("granted")
        s.send(*[admit(f"x{i}") for i in range(3)])
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                await asyncio.wait_for(s.call.read(), 5)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 2 messages" in (ended.value.details() or "")
        await h.until(lambda: h.workers.all()[0].inflight == 0)  # the two it held went back
