"""Each bounded class queue is shared out between the tenants waiting in it, by weight: one tenant's burst is refused
against its own share while another tenant's requests are still admitted, pushing out the burst's newest."""

from __future__ import annotations

import pytest
from goodput.common.v1 import types_pb2

from goodput_core.errors import InvalidArgument, ResourceExhausted

from goodput_scheduler.leases import LeaseManager
from goodput_scheduler.placement import PlacementRequest
from goodput_scheduler.queues import Ticket

from .conftest import SchedulerHarness, open_lease, scheduler_settings

P0, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P2


def req(request_id: str, tenant: str, *, weight: float = 1.0, priority: int = P0) -> PlacementRequest:
    return PlacementRequest(request_id=request_id, tenant=tenant, priority=priority, model="", prompt_tokens=10,
                            max_tokens=10, tenant_weight=weight)


def burst(lm: LeaseManager, tenant: str, n: int, *, weight: float = 1.0, priority: int = P0) -> list[Ticket]:
    return [lm.enqueue(req(f"{tenant}-{i}", tenant, weight=weight, priority=priority), deadline=None)
            for i in range(n)]


def pushed_out(tickets: list[Ticket]) -> list[str]:
    """The requests that failed while queued (each with ResourceExhausted, or the test fails)."""
    failed = []
    for t in tickets:
        if t.done and t.future.exception() is not None:
            assert isinstance(t.future.exception(), ResourceExhausted), t.future.exception()
            failed.append(t.request.request_id)
    return failed


def waiting(tickets: list[Ticket]) -> int:
    return sum(1 for t in tickets if not t.done)


async def leave(lm: LeaseManager, *bursts: list[Ticket]) -> None:
    """The callers still waiting go away (as a gateway's would at the end of a test)."""
    for tickets in bursts:
        for t in tickets:
            lm.abandon(t)
    await lm.stop()


def settings(address: str, **overrides: object):  # type: ignore[no-untyped-def]
    # One slot, held by the test, so everything else queues; P0's queue holds 20 (its default) unless overridden.
    return scheduler_settings([address], **{"max_inflight_per_worker": 1, "p0_max_queue": 20, **overrides})


async def test_a_burst_is_refused_against_its_share_while_another_tenant_is_admitted(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings(a.address)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        await lm.acquire(req("hold", "acme"), deadline=None)
        acme = burst(lm, "acme", 20)  # acme alone may fill every place
        assert waiting(acme) == 20
        # globex's interactive requests are still admitted: each takes the place of acme's newest
        globex = burst(lm, "globex", 10)
        assert waiting(globex) == 10 and lm.queued(P0) == 20
        assert pushed_out(acme) == [f"acme-{i}" for i in range(10, 20)]
        err = acme[-1].future.exception()
        assert isinstance(err, ResourceExhausted) and err.retry_after_s is not None and err.retry_after_s > 0
        assert str(err).startswith("tenant acme holds more than its share of the P0 queue (20 of 20 places; its "
                                   "share is 10)")
        # now each holds its share (10 of 20): both are refused beyond it, and nothing more is pushed out
        for tenant in ("globex", "acme"):
            with pytest.raises(ResourceExhausted, match=f"tenant {tenant}'s share of the P0 queue is full "
                                                        r"\(10 of 20 places\)") as exc:
                lm.enqueue(req(f"{tenant}-more", tenant), deadline=None)
            assert exc.value.retry_after_s is not None and exc.value.retry_after_s > 0
        assert waiting(acme) == 10 and waiting(globex) == 10
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "tenant_share"}) == 12
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "queue_full"}) == 0
        assert h.metric("goodput_scheduler_queue_tenants", {"priority": "P0"}) == 2
        assert h.metric("goodput_scheduler_queue_depth", {"priority": "P0"}) == 20
        await leave(lm, acme, globex)


async def test_weights_share_the_places_in_proportion(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings(a.address)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        await lm.acquire(req("hold", "acme"), deadline=None)
        acme = burst(lm, "acme", 20, weight=3)
        globex = [lm.enqueue(req(f"globex-{i}", "globex", weight=1), deadline=None) for i in range(5)]
        with pytest.raises(ResourceExhausted, match=r"tenant globex's share of the P0 queue is full \(5 of 20"):
            lm.enqueue(req("globex-5", "globex", weight=1), deadline=None)
        with pytest.raises(ResourceExhausted, match=r"tenant acme's share of the P0 queue is full \(15 of 20"):
            lm.enqueue(req("acme-20", "acme", weight=3), deadline=None)
        assert waiting(acme) == 15 and waiting(globex) == 5  # 3:1 of 20 places
        # the latest weight a tenant sends wins: at 3:3, globex's share is 10
        globex += [lm.enqueue(req(f"globex-{i}", "globex", weight=3), deadline=None) for i in range(6, 11)]
        assert waiting(acme) == 10 and waiting(globex) == 10
        await leave(lm, acme, globex)


async def test_a_lone_tenant_may_use_every_place(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings(a.address)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        await lm.acquire(req("hold", "acme"), deadline=None)
        acme = burst(lm, "acme", 20, weight=0.5)  # a small weight is no limit while no one else waits
        with pytest.raises(ResourceExhausted, match=r"the P0 queue is full \(20 waiting\)"):
            lm.enqueue(req("acme-20", "acme"), deadline=None)
        assert waiting(acme) == 20 and not pushed_out(acme)
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "queue_full"}) == 1
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "tenant_share"}) == 0
        await leave(lm, acme)


async def test_fifo_policy_and_unbounded_queues_have_no_shares(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings(a.address, queue_policy="fifo", fifo_max_queue=4)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        await lm.acquire(req("hold", "acme"), deadline=None)
        acme = burst(lm, "acme", 4)
        with pytest.raises(ResourceExhausted, match=r"the scheduler queue is full \(4 waiting\)"):
            lm.enqueue(req("globex-0", "globex"), deadline=None)
        assert waiting(acme) == 4 and not pushed_out(acme)
        await leave(lm, acme)
    # P2 unbounded (its default), and never shed for overload here
    async with SchedulerHarness(settings(a.address, p2_max_queue=0, shed_p2_at=1000, shed_p1_at=1000)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        await lm.acquire(req("hold", "acme", priority=P2), deadline=None)
        acme = burst(lm, "acme", 50, priority=P2)
        globex = burst(lm, "globex", 50, priority=P2)
        assert waiting(acme) == 50 and waiting(globex) == 50
        await leave(lm, acme, globex)


async def test_over_grpc_a_tenant_under_its_share_pushes_out_the_burst(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(settings(a.address, p0_max_queue=4)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, event = await open_lease(h, "hold", tenant="acme")
        assert event.HasField("granted")
        holder.first_token()  # streaming, and not resumable: globex cannot take its slot back
        await h.until(lambda: not next(iter(h.leases.leases.values())).prefilling)
        acme = []
        for i in range(4):
            call, event = await open_lease(h, f"acme-{i}", tenant="acme", tenant_weight=1.0, skip_queued=False)
            assert event.HasField("queued")
            acme.append(call)
        # globex (weight 0 = 1) is admitted; acme's newest waiting request is refused in its place
        globex, event = await open_lease(h, "globex-0", tenant="globex", skip_queued=False)
        assert event.HasField("queued")
        with pytest.raises(ResourceExhausted) as exc:
            await acme[-1].read()
        assert exc.value.message.startswith("tenant acme holds more than its share of the P0 queue (4 of 4 places; "
                                            "its share is 2)")
        assert (exc.value.retry_after_s or 0) > 0
        assert h.leases.queued(P0) == 4
        # a weight the gateway could never mean is refused by name
        with pytest.raises(InvalidArgument) as bad:
            await open_lease(h, "globex-1", tenant="globex", tenant_weight=-1.0)
        assert bad.value.param == "tenant_weight"
        for call in (holder, *acme[:-1], globex):
            call.cancel()
