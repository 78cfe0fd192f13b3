"""The gateway's leases (goodput_gateway.leasemux.LeaseStream: every lease over one long-lived
Scheduler/LeaseBatches stream) against a scheduler process and a worker process on the simulated engine (no model
loads), over gRPC on localhost: leases are granted and released, refusals arrive as the errors they stand for, a
caller that goes away withdraws its lease, and a scheduler that restarts costs nothing: the gateway carries on,
re-attaching the leases it holds and re-admitting the ones that waited."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_core.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from goodput_testing import ServiceProcess, async_wait_until, free_port, sim_worker_env

from goodput_gateway.leasemux import LeaseStream

pytestmark = [pytest.mark.integration]

P0 = types_pb2.PRIORITY_P0


def start_scheduler(start: Callable[..., ServiceProcess], worker: str, grpc_port: int) -> ServiceProcess:
    return start("goodput_scheduler", "scheduler", GOODPUT_SCHEDULER_WORKERS=worker,
                 GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(grpc_port),
                 GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2",
                 GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER="1", GOODPUT_SCHEDULER_P0_MAX_QUEUE="1")


async def test_leases_over_one_stream_against_a_scheduler_process(service_processes) -> None:  # type: ignore[no-untyped-def]
    port, grpc_port = free_port(), free_port()
    service_processes("goodput_inference", "worker", **sim_worker_env(port))
    worker = f"127.0.0.1:{port}"
    scheduler = start_scheduler(service_processes, worker, grpc_port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def inflight() -> int:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return -1
        return sum(w.inflight for w in listed.workers if w.healthy) if any(w.healthy for w in listed.workers) \
            else -1

    async def until_inflight(n: int) -> None:
        await async_wait_until(lambda: _is(inflight(), n), timeout=30, interval=0.05,
                               message=f"{n} leases held (scheduler log: {scheduler.log})")

    leases = LeaseStream(stub)
    admit = scheduler_pb2.Admit(request_id="r", tenant="t", priority=P0)  # type: ignore[arg-type]
    try:
        await until_inflight(0)  # the worker is up and healthy
        assert (await leases.acquire("a", admit, timeout_s=10)).address == worker
        leases.first_token("a", 0.05)
        # the worker holds one (its cap): the next waits, the one after is refused
        waiting = asyncio.ensure_future(leases.acquire("b", admit, timeout_s=10))
        await asyncio.sleep(0.2)
        with pytest.raises(ResourceExhausted) as refused:
            await leases.acquire("c", admit, timeout_s=10)
        assert refused.value.code == "queue_full" and refused.value.retry_after_s
        await leases.release("a", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK, completion_tokens=4,
                                                        prompt_tokens=4, ttft_s=0.05))
        assert (await waiting).address == worker
        with pytest.raises(InvalidArgument):
            await leases.acquire("b", admit, timeout_s=10)  # "b" is held on this stream
        # a caller that goes away withdraws its lease; a deadline that passes while queued is DEADLINE_EXCEEDED
        gone = asyncio.ensure_future(leases.acquire("d", admit, timeout_s=10))
        await asyncio.sleep(0.2)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        with pytest.raises(DeadlineExceeded):
            await leases.acquire("e", admit, timeout_s=0.3)
        await leases.release("b", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await until_inflight(0)  # nothing leaked: not "d", not "e"

        # the scheduler restarts (a failover, as far as the gateway can tell): the lease held on the old stream is
        # attached at the new scheduler (its worker is still busy with it), and the admission that was waiting is
        # admitted again there: nothing a retry can save is lost
        assert (await leases.acquire("f", admit, timeout_s=10)).address == worker
        waiting = asyncio.ensure_future(leases.acquire("g", admit, timeout_s=30))
        await asyncio.sleep(0.2)
        scheduler.kill()
        scheduler = start_scheduler(service_processes, worker, grpc_port)
        await until_inflight(1)  # "f", attached; "g" waits behind it (the worker's cap is 1)
        assert not waiting.done()
        await leases.release("f", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        assert (await waiting).address == worker
        await until_inflight(1)
        await leases.release("g", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await until_inflight(0)
        assert leases.failovers == 1
    finally:
        await leases.close()
        await channel.close()


async def test_a_failover_is_not_granted_the_worker_it_leaves(service_processes) -> None:  # type: ignore[no-untyped-def]
    # As the gateway's pipeline does when a worker is lost: the lost lease's release is started (not awaited), then
    # the request is admitted again at once. The release reaches the scheduler first, which grants nothing on that
    # worker until its check answers, though the worker is alive here and would be the emptier of the two.
    ports = [free_port(), free_port()]
    for port in ports:
        service_processes("goodput_inference", "worker", **sim_worker_env(port))
    grpc_port = free_port()
    service_processes("goodput_scheduler", "scheduler", GOODPUT_SCHEDULER_WORKERS=",".join(
        f"127.0.0.1:{p}" for p in ports), GOODPUT_SCHEDULER_INSECURE_INTERNAL="true",
        GOODPUT_SCHEDULER_GRPC_PORT=str(grpc_port), GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()),
        GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.5")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def healthy() -> int:
        try:
            return sum(w.healthy for w in (await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers)
        except grpc.aio.AioRpcError:
            return 0

    leases = LeaseStream(stub)
    admit = scheduler_pb2.Admit(request_id="r", tenant="t", priority=P0)  # type: ignore[arg-type]
    try:
        await async_wait_until(lambda: _is(healthy(), 2), timeout=60, interval=0.1)
        held = {lease: (await leases.acquire(lease, admit, timeout_s=10)).address for lease in ("a", "b", "c")}
        # "c" went where "a" or "b" is: the lease left alone on its worker is the one lost, so that worker is the
        # emptier one once it is released
        lost = next(lease for lease in ("a", "b") if held[lease] != held["c"])
        left = held[lost]
        released = asyncio.ensure_future(leases.release(lost, scheduler_pb2.Release(
            outcome=scheduler_pb2.OUTCOME_WORKER_FAILED)))
        assert (await leases.acquire("failover", admit, timeout_s=10)).address != left
        await released
    finally:
        await leases.close()
        await channel.close()


async def _is(value: "asyncio.Future[int] | object", expected: int) -> bool:
    return await value == expected  # type: ignore[misc]
