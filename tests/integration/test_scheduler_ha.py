"""Scheduler high availability, end to end: two scheduler processes elect a leader through Redis, a worker process
on the simulated engine serves, and the gateway's lease client reaches the leader through a channel that follows it
(client-side gRPC health checking over both addresses). Killing the leader with SIGKILL mid-traffic: the standby
leads within the lease's time to live, the leases the gateway holds are attached there (the new leader's counts are
right: the worker's cap still holds), the admission that was waiting is admitted again and granted, one that arrives
while no replica leads waits for the next leader, and nothing is lost.
Stopping a leader with SIGTERM (a rolling update) hands over at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_core.clients import make_channel
from goodput_testing import ServiceProcess, async_wait_until, free_port, sim_worker_env

from goodput_gateway.leasemux import LeaseStream

pytestmark = [pytest.mark.integration]

SERVICE = "goodput.scheduler.v1.Scheduler"
TTL_S = 2.0


def scheduler(start: Callable[..., ServiceProcess], name: str, port: int, worker: str, redis_url: str,
              key: str) -> ServiceProcess:
    return start("goodput_scheduler", name, GOODPUT_SCHEDULER_WORKERS=worker,
                 GOODPUT_SCHEDULER_INSECURE_INTERNAL="true", GOODPUT_SCHEDULER_GRPC_PORT=str(port),
                 GOODPUT_SCHEDULER_HTTP_PORT=str(free_port()), GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2",
                 GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER="2", GOODPUT_SCHEDULER_LEADER_ELECTION="redis",
                 GOODPUT_SCHEDULER_LEADER_REDIS_URL=redis_url, GOODPUT_SCHEDULER_LEADER_KEY=key,
                 GOODPUT_SCHEDULER_LEADER_TTL_S=str(TTL_S), GOODPUT_SCHEDULER_LEADER_RENEW_S="0.5",
                 GOODPUT_SCHEDULER_LEADER_RETRY_S="0.2")


async def leading(port: int) -> bool:
    """Whether the replica on ``port`` serves the Scheduler service (its health says so only while it leads)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                                   timeout=1)
        except grpc.aio.AioRpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_standby_takes_over_and_nothing_is_lost(service_processes, redis_url: str,  # type: ignore[no-untyped-def]
                                                        redis_prefix: str) -> None:
    port = free_port()
    service_processes("goodput_inference", "worker", **sim_worker_env(port))
    worker = f"127.0.0.1:{port}"
    ports = [free_port(), free_port()]
    key = f"{redis_prefix}:scheduler-leader"
    procs = [scheduler(service_processes, f"scheduler-{i}", p, worker, redis_url, key) for i, p in enumerate(ports)]
    channel = make_channel(",".join(f"127.0.0.1:{p}" for p in ports), None, traced=False, health_service=SERVICE)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    leases = LeaseStream(stub)
    admit = scheduler_pb2.Admit(request_id="r", tenant="t", priority=types_pb2.PRIORITY_P0)  # type: ignore[arg-type]

    async def held_on_worker() -> int:
        try:
            listed = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=1, wait_for_ready=True)
        except grpc.aio.AioRpcError:
            return -1
        return sum(w.inflight for w in listed.workers if w.healthy) if any(w.healthy for w in listed.workers) \
            else -1

    async def until(check: Callable[[], object], what: str, timeout: float = 30) -> None:
        await async_wait_until(check, timeout=timeout, interval=0.05, message=f"{what} (logs: {procs[0].log}, "
                                                                                 f"{procs[1].log})")

    try:
        await until(lambda: _one_leader(ports), "one replica leads")
        await until(lambda: _equals(held_on_worker(), 0), "the leader sees the worker")
        first = 0 if await leading(ports[0]) else 1
        await leases.acquire("a", admit, timeout_s=10)
        await leases.acquire("b", admit, timeout_s=10)
        leases.first_token("a", 0.05)
        waiting = asyncio.ensure_future(leases.acquire("w", admit, timeout_s=60))  # the worker's cap is 2
        await asyncio.sleep(0.3)
        assert not waiting.done()

        # SIGKILL the leader: no goodbye, its Redis lock lapses after its TTL
        killed_at = time.monotonic()
        procs[first].kill()
        # a request that arrives while no replica leads yet waits for the next leader instead of failing
        arriving = asyncio.ensure_future(leases.acquire("n", admit, timeout_s=60))
        await until(lambda: leading(ports[1 - first]), "the standby leads")
        await until(lambda: _equals(held_on_worker(), 2), "the held leases are attached at the new leader")
        failover_s = time.monotonic() - killed_at
        assert failover_s < 5.0, f"failover took {failover_s:.1f} s"
        assert not waiting.done()  # still waiting: the cap holds at the new leader too
        await leases.release("a", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await leases.release("b", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        assert (await asyncio.wait_for(waiting, 10)).address == worker
        assert (await asyncio.wait_for(arriving, 10)).address == worker
        await leases.release("w", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await leases.release("n", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await until(lambda: _equals(held_on_worker(), 0), "every lease released")

        # the killed replica comes back as a standby; SIGTERM on the leader (a rolling update) hands over at once
        procs[first] = scheduler(service_processes, f"scheduler-{first}-again", ports[first], worker, redis_url, key)
        await asyncio.sleep(1.0)
        assert not await leading(ports[first])
        await leases.acquire("c", admit, timeout_s=10)
        stopped_at = time.monotonic()
        procs[1 - first].stop()  # SIGTERM: it steps down and frees the lock first
        await until(lambda: leading(ports[first]), "the restarted replica leads")
        assert time.monotonic() - stopped_at < TTL_S
        await until(lambda: _equals(held_on_worker(), 1), "the held lease is attached again")
        await leases.release("c", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        await until(lambda: _equals(held_on_worker(), 0), "released at the new leader")
    finally:
        await leases.close()
        await channel.close()


async def _one_leader(ports: list[int]) -> bool:
    return sum([await leading(p) for p in ports]) == 1


async def _equals(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]
