"""The scheduler process discovering inference worker processes through the Kubernetes API: the EndpointSlice watch
adds a worker when its pod turns ready, drains it when the pod terminates (no new grants; the request it is serving
streams to the end and its lease is released) and removes it when the endpoint goes.

No kube-apiserver can run on this machine: ``goodput_testing.KubeApiStandIn``, a local HTTP server that speaks the
EndpointSlice list/watch protocol, stands in for it, and the scheduler reaches it through the official ``kubernetes``
client with ``GOODPUT_SCHEDULER_KUBE_API_URL``. Everything else is real: the scheduler and two inference workers (the
simulated engine, so no model loads) each run as their own process on localhost, over gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_testing import KubeApiStandIn, ServiceProcess, async_wait_until, endpoint_slice, free_port, sim_worker_env

from goodput_gateway.leasemux import LeaseStream

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE, SERVICE = "goodput", "goodput-inference"


def sim_worker(start: Callable[..., ServiceProcess], i: int) -> tuple[int, ServiceProcess]:
    port = free_port()
    return port, start("goodput_inference", f"worker{i}", **sim_worker_env(port))


def pod(port: int, **conditions: bool) -> dict[str, Any]:
    return endpoint_slice(NAMESPACE, SERVICE, name=f"{SERVICE}-{port}", address="127.0.0.1", port=port, **conditions)


async def test_the_endpointslice_watch_adds_drains_and_removes_workers(service_processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = KubeApiStandIn()
    await api.start()
    (p0, _), (p1, _) = sim_worker(service_processes, 0), sim_worker(service_processes, 1)
    a, b = f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"
    api.apply(pod(p0))
    grpc_port, http_port = free_port(), free_port()
    scheduler = service_processes("goodput_scheduler", "scheduler",
                          GOODPUT_SCHEDULER_WORKERS=f"k8s:///{NAMESPACE}/{SERVICE}:grpc",
                          GOODPUT_SCHEDULER_KUBE_API_URL=api.url, GOODPUT_SCHEDULER_INSECURE_INTERNAL="true",
                          GOODPUT_SCHEDULER_GRPC_PORT=str(grpc_port), GOODPUT_SCHEDULER_HTTP_PORT=str(http_port),
                          GOODPUT_SCHEDULER_HEALTH_INTERVAL_S="0.2")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    leases = LeaseStream(stub)
    try:
        async def listed() -> dict[str, scheduler_pb2.WorkerStatus]:
            try:
                resp = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return {}  # still starting
            return {w.address: w for w in resp.workers}

        async def healthy() -> set[str]:
            return {address for address, w in (await listed()).items() if w.healthy}

        async def draining_gauge() -> float:
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"http://127.0.0.1:{http_port}/metrics")).text
            (line,) = [x for x in text.splitlines() if x.startswith('goodput_scheduler_workers{state="draining"}')]
            return float(line.split()[-1])

        async def lease(request_id: str) -> tuple[str, str]:
            granted = await leases.acquire(request_id, scheduler_pb2.Admit(
                request_id=request_id, tenant="t", priority=types_pb2.PRIORITY_P0), timeout_s=30)
            return request_id, granted.address

        async def release(lease_id: str) -> None:
            await leases.release(lease_id, scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))

        async def until(check: Callable[[], Any], what: str) -> None:
            await async_wait_until(check, timeout=60, interval=0.1, message=f"{what} (scheduler log: {scheduler.log})")

        # a pod turns ready: the scheduler adds it; a second one: both take requests
        await until(lambda: _eq(healthy(), {a}), "the first ready pod becomes a worker")
        long_call, address = await lease("long-stream")
        assert address == a
        api.apply(pod(p1))
        await until(lambda: _eq(healthy(), {a, b}), "a second ready pod becomes a worker")

        # the first pod terminates: no new grants there, while the request it serves streams to the end
        api.apply(pod(p0, ready=False, terminating=True))
        await until(lambda: _eq(healthy(), {b}), "the terminating pod stops taking requests")
        assert await draining_gauge() == 1
        for i in range(3):
            assert (await lease(f"new{i}"))[1] == b
        async with grpc.aio.insecure_channel(a) as worker_channel:
            chunks = [c async for c in inference_pb2_grpc.InferenceStub(worker_channel).Generate(
                inference_pb2.GenerateRequest(request_id="long-stream", prompt="hello " * 20,
                                              priority=types_pb2.PRIORITY_P0,
                                              sampling=types_pb2.SamplingParams(max_tokens=8)))]
        assert chunks[-1].finished.usage.completion_tokens == 8
        assert (await listed())[a].inflight == 1, "the draining worker keeps its lease until it is released"

        # the pod is gone: its worker leaves once that lease is released
        api.delete(NAMESPACE, f"{SERVICE}-{p0}")
        await release(long_call)
        await until(lambda: _eq(_keys(listed()), {b}), "the gone pod's worker is removed")
        assert await draining_gauge() == 0
        assert api.lists() == 1, "one list, then the watch carried every change"
    finally:
        await leases.close()
        await channel.close()
        scheduler.stop()  # before the stand-in, so the watch ends from the client's side
        await api.stop()


async def _eq(value: Any, expected: set[str]) -> bool:
    return bool(await value == expected)


async def _keys(value: Any) -> set[str]:
    return set(await value)
