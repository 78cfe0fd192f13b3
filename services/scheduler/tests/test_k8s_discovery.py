"""Kubernetes-native worker discovery (``k8s:///namespace/service:port``): the scheduler lists and watches the
Service's EndpointSlices; ready endpoints become workers, terminating ones drain (no new grants, leases in flight
finish), vanished ones leave once their leases are released.

No kube-apiserver can run on this machine, so ``goodput_testing.KubeApiStandIn`` stands in for it: a local aiohttp
server that speaks the list/watch protocol of ``/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` the way
the API server does (a list carries ``metadata.resourceVersion``; ``?watch=true`` streams one JSON event per line —
ADDED, MODIFIED, DELETED, BOOKMARK — from the requested version; a version older than the history the server keeps
answers with an ERROR event of code 410 Expired). The scheduler talks to it through the official ``kubernetes``
client, unchanged; only ``kube_api_url`` points it there. The workers are real gRPC stand-ins
(conftest.StandInWorker), so health checks and leases are the real ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from goodput.scheduler.v1 import scheduler_pb2

from goodput_testing import KubeApiStandIn, async_wait_until, endpoint_slice

from goodput_scheduler.endpointslices import EndpointState, ServiceTarget, _merge, slice_endpoints

from .conftest import LeaseCall, SchedulerHarness, StandInWorker, open_lease, scheduler_settings

NAMESPACE = "goodput"
SERVICE = "goodput-inference"
ENTRY = f"k8s:///{NAMESPACE}/{SERVICE}:grpc"


def slice_of(worker: StandInWorker, **conditions: bool) -> dict[str, Any]:
    """The EndpointSlice of one worker pod. Each worker listens on its own port here, so each gets its own slice (a
    slice's ports apply to all its endpoints)."""
    return endpoint_slice(NAMESPACE, SERVICE, name=slice_name(worker), address="127.0.0.1", port=worker.port,
                          **conditions)


def slice_name(worker: StandInWorker) -> str:
    return f"{SERVICE}-{worker.port}"


@pytest.fixture
async def kube_api() -> AsyncIterator[KubeApiStandIn]:
    api = KubeApiStandIn()
    await api.start()
    yield api
    await api.stop()


def harness(api: KubeApiStandIn, **overrides: object) -> SchedulerHarness:
    return SchedulerHarness(scheduler_settings([ENTRY], kube_api_url=api.url, **overrides))


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """For conditions on the stand-in's side, which the scheduler's change notifications do not cover."""
    await async_wait_until(predicate, timeout=timeout, interval=0.02)


async def lease(h: SchedulerHarness, request_id: str) -> tuple[LeaseCall, str]:
    call, event = await open_lease(h, request_id)
    assert event.HasField("granted"), event
    return call, event.granted.address


def addresses(workers: list[Any]) -> set[str]:
    return {w.address for w in workers}


# ---- the pure part: one slice's endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(("conditions", "state"), [
    ({"ready": True, "serving": True, "terminating": False}, EndpointState.READY),
    ({}, EndpointState.READY),  # unset conditions read as ready, as the API documents
    ({"ready": False, "serving": True, "terminating": True}, EndpointState.DRAINING),  # graceful termination
    ({"ready": True, "terminating": True}, EndpointState.DRAINING),  # publishNotReadyAddresses: still terminating
    ({"ready": False, "serving": False, "terminating": False}, EndpointState.DRAINING),  # readiness failing
])
def test_endpoint_conditions_map_to_ready_or_draining(conditions: dict[str, bool], state: EndpointState) -> None:
    obj = {"addressType": "IPv4", "ports": [{"name": "grpc", "port": 50061}],
           "endpoints": [{"addresses": ["10.1.2.3"], "conditions": conditions}]}
    assert slice_endpoints(obj, "grpc") == {"10.1.2.3:50061": state}


def test_ports_by_name_or_number_and_ipv6() -> None:
    obj = {"addressType": "IPv6", "ports": [{"name": "grpc", "port": 50061}, {"name": "http", "port": 9161}],
           "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": True}}]}
    assert slice_endpoints(obj, "http") == {"[fd00::7]:9161": EndpointState.READY}
    assert slice_endpoints(obj, "7000") == {"[fd00::7]:7000": EndpointState.READY}
    assert slice_endpoints(obj, "metrics") == {}  # a slice without the port adds nothing
    # an address in two slices (while the controller rebalances them) is ready when either says so
    assert _merge({"a": {"x:1": EndpointState.DRAINING}, "b": {"x:1": EndpointState.READY}}) == {
        "x:1": EndpointState.READY}


def test_malformed_entries_are_refused_at_startup() -> None:
    for bad in ("k8s:///inference:grpc", "k8s:///ns/Inference:grpc", "k8s:///ns/inference"):
        with pytest.raises(ValueError, match="namespace"):
            scheduler_settings([bad])
    assert ServiceTarget.parse(ENTRY).label_selector == f"kubernetes.io/service-name={SERVICE}"


# ---- against the stand-in API server -----------------------------------------------------------------------------


async def test_ready_endpoints_are_added_and_vanished_ones_removed(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        kube_api.apply(slice_of(b))  # scale-out: a new ready pod
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address, b.address})
        calls, grants = [], []
        for i in range(4):
            call, address = await lease(h, f"r{i}")
            calls.append(call)
            grants.append(address)
        assert sorted(grants) == sorted([a.address, b.address] * 2)
        for call in calls:
            await call.release()
        kube_api.delete(NAMESPACE, slice_name(a))  # scale-in, nothing in flight: removed at once
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        assert kube_api.lists() == 1, "one list, then one watch carried every change"
        assert kube_api.watches()[0]["resourceVersion"] == "101"  # from the list's version
        assert kube_api.watches()[0]["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"


async def test_a_terminating_endpoint_drains_while_its_lease_finishes(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        inflight, address = await lease(h, "long-stream")
        assert address == a.address
        kube_api.apply(slice_of(b))
        await h.until(lambda: len(h.workers.healthy()) == 2)

        kube_api.apply(slice_of(a, ready=False, terminating=True))  # the pod got SIGTERM
        await h.until(lambda: addresses(h.workers.draining()) == {a.address})
        assert addresses(h.workers.healthy()) == {b.address}
        assert h.metric("goodput_scheduler_workers", {"state": "draining"}) == 1
        assert h.metric("goodput_scheduler_workers", {"state": "healthy"}) == 1
        listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert {w.address: w.healthy for w in listed.workers} == {a.address: False, b.address: True}
        assert {w.address: w.draining for w in listed.workers} == {a.address: True, b.address: False}

        calls = []
        for i in range(3):  # new requests go elsewhere ...
            call, address = await lease(h, f"new{i}")
            assert address == b.address
            calls.append(call)
        worker_a = h.workers.get(a.address)
        assert worker_a is not None and worker_a.inflight == 1  # ... while the stream on the draining worker goes on
        await inflight.release()
        assert worker_a.inflight == 0 and h.workers.get(a.address) is worker_a  # still listed until its endpoint goes

        kube_api.delete(NAMESPACE, slice_name(a))  # the pod exited
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        assert h.metric("goodput_scheduler_workers", {"state": "draining"}) == 0
        for call in calls:
            await call.release()


async def test_a_vanished_endpoint_leaves_once_its_leases_are_released(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(slice_of(a))
    kube_api.apply(slice_of(b))
    async with harness(kube_api, max_inflight_per_worker=1) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        calls = {rid: (await lease(h, rid))[0] for rid in ("r1", "r2")}  # one on each worker (the cap is one)
        kube_api.delete(NAMESPACE, slice_name(a))
        await h.until(lambda: addresses(h.workers.draining()) == {a.address})
        worker_a = h.workers.get(a.address)
        assert worker_a is not None and worker_a.inflight == 1, "kept while its lease is in flight"
        (on_a,) = [rid for rid, held in h.leases.leases.items() if held.worker is worker_a]
        await calls.pop(on_a).release()
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        for call in calls.values():
            await call.release()


async def test_a_worker_that_turns_ready_again_takes_grants_again(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        kube_api.apply(slice_of(a, ready=False))  # its readiness probe failed for a while
        await h.until(lambda: not h.workers.healthy() and len(h.workers.draining()) == 1)
        kube_api.apply(slice_of(a))
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        call, address = await lease(h, "r1")
        assert address == a.address
        await call.release()


async def test_an_expired_version_relists_and_catches_up(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        await eventually(lambda: len(kube_api.watches()) == 1)
        # While the watch is down its history is compacted, and the fleet changes: the resumed watch gets 410 Expired
        # (an ERROR event), and only a fresh list can show what happened.
        kube_api.interrupt()
        kube_api.delete(NAMESPACE, slice_name(a))
        kube_api.apply(slice_of(b))
        kube_api.compact()
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        await h.until(lambda: addresses(h.workers.healthy()) == {b.address})
        assert kube_api.lists() == 2
        await eventually(lambda: kube_api.watches()[-1]["resourceVersion"] == str(kube_api.rv))


async def test_a_bookmark_moves_the_resume_point(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        await eventually(lambda: len(kube_api.watches()) == 1)
        assert kube_api.watches()[0]["allowWatchBookmarks"] == "true"
        version = kube_api.bookmark()
        kube_api.interrupt()  # the server ends the watch (its timeout); the client resumes from the bookmark
        await eventually(lambda: len(kube_api.watches()) == 2)
        assert kube_api.watches()[1]["resourceVersion"] == str(version)
        assert kube_api.lists() == 1


async def test_the_fleet_outlives_an_api_outage(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(slice_of(a))
    async with harness(kube_api) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        kube_api.outage = True
        kube_api.interrupt()
        await eventually(lambda: len(kube_api.watches()) >= 3, timeout=10)  # retried, backing off
        assert addresses(h.workers.healthy()) == {a.address}, "an API outage must not empty the fleet"
        call, address = await lease(h, "during-outage")
        assert address == a.address
        await call.release()
        kube_api.outage = False
        kube_api.apply(slice_of(b))
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address, b.address}, timeout=10)
