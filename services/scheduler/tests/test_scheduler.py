"""Scheduler behaviour over gRPC: placement, health ejection/re-admission, leases released on every path."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2

from goodput_core.errors import GoodputError

from .conftest import SchedulerHarness, Stream, open_lease, scheduler_settings


async def test_least_loaded_placement_spreads_leases(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    async with SchedulerHarness(scheduler_settings([a.address, b.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        calls, grants = [], []
        for i in range(6):
            call, event = await open_lease(h, f"r{i}")
            calls.append(call)
            grants.append(event.granted.address)
        assert grants.count(a.address) == 3 and grants.count(b.address) == 3
        for call in calls:
            call.cancel()


async def test_unhealthy_worker_is_ejected_and_readmitted(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    async with SchedulerHarness(scheduler_settings([a.address, b.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        await a.set_serving(False)
        await h.until(lambda: [w.address for w in h.workers.healthy()] == [b.address])
        for i in range(3):
            call, event = await open_lease(h, f"r{i}")
            assert event.granted.address == b.address
            call.cancel()
        listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        status = {w.address: w for w in listed.workers}
        assert not status[a.address].healthy and status[a.address].last_error
        await a.set_serving(True)
        await h.until(lambda: len(h.workers.healthy()) == 2)


async def test_a_lease_is_released_when_the_gateway_vanishes(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        call, event = await open_lease(h, "r1")
        worker = h.workers.get(event.granted.worker_id)
        assert worker is not None and worker.inflight == 1
        call.cancel()  # the gateway died or the client went away: no release message ever comes
        await h.until(lambda: worker.inflight == 0)
        await h.until(lambda: h.metric("goodput_scheduler_releases_total", {"outcome": "abandoned"}) == 1)


async def test_explicit_release_frees_capacity_for_a_waiting_request(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], max_inflight_per_worker=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        first, _ = await open_lease(h, "r1")
        second, queued = await open_lease(h, "r2", skip_queued=False)
        assert queued.HasField("queued")
        waiting = asyncio.create_task(second.read())
        await h.clock.advance(0.3)  # the dispatcher ticks: the worker is still at its cap
        assert h.leases.queued() == 1 and not waiting.done(), "the second request must wait while the worker is full"
        await first.release()
        event = await asyncio.wait_for(waiting, 5)
        assert event.granted.address == a.address
        second.cancel()
        assert h.metric("goodput_scheduler_releases_total", {"outcome": "ok"}) == 1


async def test_expired_request_never_gets_a_worker(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], max_inflight_per_worker=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        first, _ = await open_lease(h, "r1")
        late, event = await open_lease(h, "r2", timeout=20, skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(21)  # its own deadline (before P0's 30 s queue timeout) passes while it waits
        with pytest.raises(GoodputError) as exc:
            await late.read()
        assert exc.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline passed while it waited" in exc.value.message
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "deadline"}) == 1
        first.cancel()


async def test_full_queue_sheds_with_retry_after(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], max_inflight_per_worker=1, p0_max_queue=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        first, _ = await open_lease(h, "r1")
        second, queued = await open_lease(h, "r2", skip_queued=False)  # waits: the P0 queue holds one
        assert queued.HasField("queued")
        with pytest.raises(GoodputError) as exc:
            await open_lease(h, "r3")
        assert exc.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exc.value.retry_after_s is not None and exc.value.retry_after_s > 0
        first.cancel()
        second.cancel()


async def test_no_healthy_worker_is_unavailable(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    await a.set_serving(False)
    async with SchedulerHarness(scheduler_settings([a.address], no_worker_wait_s=0.5)) as h:
        call, event = await open_lease(h, "r1", skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(0.6)  # no healthy worker appeared within no_worker_wait_s
        with pytest.raises(GoodputError) as exc:
            await call.read()
        assert exc.value.grpc_code == grpc.StatusCode.UNAVAILABLE


async def test_reported_worker_failure_ejects_at_once(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    async with SchedulerHarness(scheduler_settings([a.address, b.address], health_interval_s=30)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        call, event = await open_lease(h, "r1")
        victim = a if event.granted.address == a.address else b
        await victim.server.stop(None)  # the worker process dies
        await call.release(scheduler_pb2.OUTCOME_WORKER_FAILED)
        # With 30 s between routine checks, only the reported failure can eject it this fast.
        await h.until(lambda: [w.address for w in h.workers.healthy()] == [
            (b if victim is a else a).address], timeout=3)


async def test_the_failover_is_never_granted_the_worker_it_leaves(workers) -> None:  # type: ignore[no-untyped-def]
    # The gateway's failover sends the lost lease's release and the request's new admission on one stream, the one
    # right after the other; the worker's check has not answered yet (it is even alive here, the emptier of the two).
    a, b = await workers(2)
    async with SchedulerHarness(scheduler_settings([a.address, b.address], health_interval_s=30)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        stream = Stream(h)

        def admit(lease_id: str) -> scheduler_pb2.LeaseMuxRequest:
            return scheduler_pb2.LeaseMuxRequest(lease_id=lease_id, timeout_s=10, admit=scheduler_pb2.Admit(
                request_id=lease_id, tenant="t", priority=types_pb2.PRIORITY_P0))

        stream.send(admit("lost"))
        left = (await stream.next("granted")).granted.address
        stream.send(admit("other"))
        assert (await stream.next("granted")).granted.address != left  # the worker left is the emptier one now
        stream.send(scheduler_pb2.LeaseMuxRequest(lease_id="lost", release=scheduler_pb2.Release(
            outcome=scheduler_pb2.OUTCOME_WORKER_FAILED)), admit("failover"))
        assert (await stream.next("granted")).granted.address != left
        # its check passes (it was alive): it takes grants again, without waiting for the next routine check
        await h.until(lambda: len(h.workers.healthy()) == 2, timeout=3)
        stream.cancel()


async def test_register_and_deregister_at_runtime(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([])) as h:
        resp = await h.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address=a.address))
        await h.until(lambda: len(h.workers.healthy()) == 1)
        await h.stub.DeregisterWorker(scheduler_pb2.DeregisterWorkerRequest(worker_id=resp.worker_id))
        assert not h.workers.all()
        for nonsense in ("nonsense", f"{'a' * 300}:{a.port}", "localhost:70000"):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await h.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address=nonsense))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_worker_registers_only_its_own_address_and_deregisters_only_itself(workers) -> None:  # type: ignore[no-untyped-def]
    """A stolen worker certificate cannot point the scheduler (and tenants' prompts) at another host, nor take
    another worker out: the address registered must be the caller's own, by IP or by a name that resolves to it."""
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([])) as h:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await h.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address="10.255.0.9:50061"))
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "10.255.0.9" in exc.value.details()
        assert not h.workers.all()
        own = await h.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address=f"localhost:{a.port}"))
        other = h.workers.add("10.255.0.9:50061")  # known otherwise (configured or discovered)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await h.stub.DeregisterWorker(scheduler_pb2.DeregisterWorkerRequest(worker_id=other.worker_id))
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert h.workers.get(other.worker_id) is not None
        await h.stub.DeregisterWorker(scheduler_pb2.DeregisterWorkerRequest(worker_id=own.worker_id))
        assert [w.worker_id for w in h.workers.all()] == [other.worker_id]


async def test_workers_discovered_through_dns(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([f"dns:///localhost:{a.port}"], discovery_interval_s=0.2)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) >= 1)
        assert all(w.address.endswith(f":{a.port}") for w in h.workers.all())
