"""Fair share of the slots with no limits configured (goodput_scheduler.fairshare): a tenant at its share gets no new
slot while another waits below its own, and one that waited too long gets a slot taken back from the tenant most
over its share, before that lease's first token where it has one, else a lease the gateway can resume on a worker
that continues answers; a request of n sequences counts as n slots. Leases over gRPC, as the gateway takes them."""

from __future__ import annotations

from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2

from goodput_scheduler.fairshare import ACTIVE_S
from goodput_scheduler.leases import DISPATCH_INTERVAL_S

from .conftest import SchedulerHarness, Stream, scheduler_settings

P0 = types_pb2.PRIORITY_P0
P0_TIMEOUT_S = 30.0  # P0's queue timeout (its default)


def admit(lease_id: str, tenant: str, **fields: object) -> scheduler_pb2.LeaseMuxRequest:
    return scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, timeout_s=60, admit=scheduler_pb2.Admit(
        request_id=lease_id, tenant=tenant, priority=P0, prompt_tokens_estimate=10, max_tokens=10,
        **fields))  # type: ignore[arg-type]


def first_token(lease_id: str) -> scheduler_pb2.LeaseMuxRequest:
    return scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, first_token=scheduler_pb2.FirstToken(ttft_s=0.05))


def release(lease_id: str) -> scheduler_pb2.LeaseMuxRequest:
    return scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, release=scheduler_pb2.Release(
        outcome=scheduler_pb2.OUTCOME_OK))


async def granted(stream: Stream, *lease_ids: str) -> None:
    """The next grants on ``stream`` are those of ``lease_ids`` (in any order)."""
    seen = {(await stream.next("granted")).lease_id for _ in lease_ids}
    assert seen == set(lease_ids)


async def test_a_tenant_at_its_share_gets_no_new_slot_while_another_waits(workers) -> None:
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=2)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        a, b = Stream(h), Stream(h)
        # both past their first token and not resumable: nothing can be taken back, only the next slot given
        a.send(admit("a1", "a"), admit("a2", "a"), first_token("a1"), first_token("a2"))
        await granted(a, "a1", "a2")
        a.send(admit("a3", "a"))  # queued first
        assert (await a.next()).HasField("queued")
        b.send(admit("b1", "b"))
        assert (await b.next()).HasField("queued")
        a.send(release("a1"))  # a (2 of 2 slots, its share is 1) does not get the slot back: b waits below its share
        await granted(b, "b1")
        assert h.leases.queued(P0) == 1 and h.leases.book.held(P0) == {"a": 1, "b": 1}
        b.send(release("b1"))  # nobody waits below its share any more, but b was active lately: its headroom
        await h.until(lambda: not h.leases.book.held(P0).get("b"))
        await h.clock.advance(ACTIVE_S / 2)
        assert h.leases.queued(P0) == 1
        await h.clock.advance(ACTIVE_S)  # b's claim lapsed: a takes the slot
        await granted(a, "a3")
        for s in (a, b):
            s.close()


async def test_a_tenant_waiting_below_its_share_gets_a_slot_taken_back_at_once(workers) -> None:
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=3)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        a, b = Stream(h), Stream(h)
        a.send(admit("a1", "a"), first_token("a1"))
        await granted(a, "a1")
        await h.clock.advance(0.01)
        a.send(admit("a2", "a"))  # both still without a first token: a3 is the youngest
        await granted(a, "a2")
        await h.clock.advance(0.01)
        a.send(admit("a3", "a"))
        await granted(a, "a3")
        b.send(admit("b1", "b"))  # no slot is free: one of a's is taken back as b1 arrives, not after a wait
        event = await a.next()
        assert event.lease_id == "a3" and event.HasField("preempted")
        assert "tenant b" in event.preempted.reason
        await granted(b, "b1")
        assert h.metric("goodput_scheduler_preemptions_total", {"priority": "P0"}) == 1
        assert h.metric("goodput_scheduler_releases_total", {"outcome": "preempted"}) == 1
        # a's gateway admits it again: it waits (a holds 2 of 3 slots, at its share of 1.5) and finishes later
        a.send(admit("a3-again", "a"), first_token("a3"), release("a3"))  # a late report on the old lease: ignored
        assert (await a.next()).HasField("queued")
        b.send(release("b1"))
        await h.until(lambda: not h.leases.book.held(P0).get("b"))
        await h.clock.advance(ACTIVE_S * 1.5)  # once b's claim to its headroom lapsed
        await granted(a, "a3-again")
        assert h.leases.book.held(P0) == {"a": 3}
        for s in (a, b):
            s.close()


async def test_work_past_its_first_token_is_preempted_only_where_its_answer_can_be_continued(workers) -> None:
    w, triton_like = await workers(2)
    triton_like.continues = False  # an engine that takes no continuation (Triton's adapter)
    async with SchedulerHarness(scheduler_settings([w.address, triton_like.address], max_inflight_per_worker=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        a, b = Stream(h), Stream(h)
        # a1 cannot be resumed by its gateway (Admit.resumable unset: a seed, a schema...); a2 can, where its worker's
        # engine continues answers (placement decides which of the two workers it lands on)
        a.send(admit("a1", "a"), first_token("a1"))
        await granted(a, "a1")
        await h.clock.advance(0.01)
        a.send(admit("a2", "a", resumable=True), first_token("a2"))
        await granted(a, "a2")
        workers_of = {lease.request.request_id: lease.worker.address for lease in h.leases.leases.values()}
        assert set(workers_of.values()) == {w.address, triton_like.address}  # one lease on each worker
        a2_continues = workers_of["a2"] == w.address
        b.send(admit("b1", "b"))

        def preempted() -> float:
            return h.metric("goodput_scheduler_preemptions_total", {"priority": "P0"})

        if a2_continues:  # a2 is resumable and on the worker that continues: taken back for b
            event = await a.next()  # as b1 arrives: the metric is read once the scheduler has taken b1 in
            assert event.lease_id == "a2" and event.HasField("preempted") and preempted() == 1
            await granted(b, "b1")
        else:  # neither lease can be taken back: b waits for a slot's turnover
            assert (await b.next()).HasField("queued")
            await h.clock.advance(DISPATCH_INTERVAL_S * 10)
            assert preempted() == 0
            a.send(release("a1"))
            await granted(b, "b1")
        for s in (a, b):
            s.close()


async def test_a_resumable_lease_is_taken_back_after_its_first_token_and_readmitted_past_a_full_queue(
        workers) -> None:
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=2, p0_max_queue=2)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        a, b = Stream(h), Stream(h)
        a.send(admit("a1", "a", resumable=True), first_token("a1"))
        await granted(a, "a1")
        await h.clock.advance(0.01)
        a.send(admit("a2", "a", resumable=True), first_token("a2"))
        await granted(a, "a2")
        a.send(admit("a3", "a"), admit("a4", "a"))  # a's waiting requests fill the queue
        assert (await a.next()).HasField("queued") and (await a.next()).HasField("queued")
        b.send(admit("b1", "b"))  # b, below its share, takes the place of a's newest waiting request, and a slot
        events = {(e.lease_id, e.WhichOneof("kind")) for e in [await a.next(), await a.next()]}
        assert events == {("a4", "error"), ("a2", "preempted")}  # a2: the youngest, past its first token
        await granted(b, "b1")
        # its gateway admits it again to continue the answer: a place in the full queue, whatever the depth
        a.send(admit("a2-resumed", "a", resumable=True, resumed=True))
        assert (await a.next()).HasField("queued") and h.leases.queued(P0) == 2
        a.send(admit("a5", "a"))  # an ordinary request of a is still refused by the full queue
        assert (await a.next("error")).error.code == "queue_full"
        await h.clock.advance(P0_TIMEOUT_S + 2 * DISPATCH_INTERVAL_S)  # it outlives the queue timeout (a3 not)
        assert (await a.next("error")).lease_id == "a3"
        a.send(release("a1"))  # and goes first among a's waiting requests
        await granted(a, "a2-resumed")
        for s in (a, b):
            s.close()


async def test_n_sequences_hold_n_slots(workers) -> None:
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=4)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        s = Stream(h)
        s.send(admit("n3", "a", n=3))
        await granted(s, "n3")
        assert h.workers.all()[0].inflight == 3 and h.leases.book.held(P0) == {"a": 3}
        s.send(admit("n2", "a", n=2))  # 3 + 2 > 4: it waits
        assert (await s.next()).HasField("queued")
        s.send(admit("n1", "b", n=1))  # 3 + 1 fits, and a (3 slots, share 2) is held back while b waits
        await granted(s, "n1")
        s.send(release("n3"))
        await granted(s, "n2")
        assert h.workers.all()[0].inflight == 3 and h.leases.book.held(P0) == {"a": 2, "b": 1}
        s.send(admit("huge", "a", n=129))
        assert (await s.next("error")).error.param == "n"
        s.close()


async def test_an_active_tenant_below_its_share_keeps_headroom_for_its_next_request(workers) -> None:
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=4)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        a, b = Stream(h), Stream(h)
        b.send(admit("b1", "b"), first_token("b1"))
        await granted(b, "b1")
        a.send(admit("a1", "a"), admit("a2", "a"), admit("a3", "a"))  # a reaches its share (2 of 4), then waits:
        await granted(a, "a1", "a2")                                    # the last free slot is b's headroom
        assert (await a.next()).HasField("queued")
        b.send(admit("b2", "b"))  # b's next request finds its slot at once
        await granted(b, "b2")
        b.send(release("b1"), release("b2"))  # b holds nothing any more, and once it has been idle a while,
        await h.until(lambda: not h.leases.book.held(P0).get("b"))
        await h.clock.advance(ACTIVE_S * 1.5)  # a takes what is free
        await granted(a, "a3")
        for s in (a, b):
            s.close()


async def test_slots_a_tenant_below_its_share_gives_back_stay_its_own_while_it_is_active(workers) -> None:
    """b's load needs more than the headroom: the slots it got from a's turnover are not lost to a (whose answers,
    past their first token, cannot be taken back) when b's own requests end, so b's next burst is served at once."""
    (w,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([w.address], max_inflight_per_worker=8)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        a, b = Stream(h), Stream(h)
        b.send(admit("b1", "b"), first_token("b1"))
        await granted(b, "b1")
        a_ids = [f"a{i}" for i in range(1, 9)]
        a.send(*(admit(i, "a") for i in a_ids), *(first_token(i) for i in a_ids[:5]))
        await granted(a, *a_ids[:5])  # its share (4 of 8), and one more: the last 2 free slots are b's headroom
        b.send(admit("b2", "b"), admit("b3", "b"), admit("b4", "b"))
        await granted(b, "b2", "b3")
        assert (await b.next()).HasField("queued")
        a.send(release("a1"))  # a turnover: b4's, since b waits below its share
        await granted(b, "b4")
        assert h.leases.book.held(P0) == {"a": 4, "b": 4} and h.leases.queued(P0) == 3
        b.send(*(release(f"b{i}") for i in range(1, 5)))
        await h.until(lambda: not h.leases.book.held(P0).get("b"))
        await h.clock.advance(ACTIVE_S / 2)
        assert h.leases.book.held(P0) == {"a": 4} and h.leases.queued(P0) == 3  # the 4 free slots stay b's
        b.send(*(admit(f"b{i}", "b") for i in range(5, 9)))
        await granted(b, "b5", "b6", "b7", "b8")
        b.send(*(release(f"b{i}") for i in range(5, 9)))
        await h.until(lambda: not h.leases.book.held(P0).get("b"))
        await h.clock.advance(ACTIVE_S * 1.5)  # once b has been idle a while, a takes what is free
        await granted(a, *a_ids[5:])
        for s in (a, b):
            s.close()
