"""Kubernetes-native worker discovery (``k8s:///namespace/service:port``): the scheduler lists and watches the
Service's EndpointSlices; ready endpoints become workers, terminating ones drain (no new grants, leases in flight
finish), vanished ones leave once their leases are released.

No kube-apiserver can run on this machine, so :class:`KubeApiStandIn` stands in for it: a local aiohttp server that
speaks the list/watch protocol of ``/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` the way the API server
does (a list carries ``metadata.resourceVersion``; ``?watch=true`` streams one JSON event per line — ADDED,
MODIFIED, DELETED, BOOKMARK — from the requested version; a version older than the server keeps answers with an
ERROR event of code 410 Expired). The scheduler talks to it through the official ``kubernetes`` client, unchanged;
only ``kube_api_url`` points it here. The workers are real gRPC stand-ins (conftest.StandInWorker), so health checks
and leases are the real ones.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2

from goodput_scheduler.endpointslices import EndpointState, ServiceTarget, _merge, slice_endpoints

from .conftest import SchedulerHarness, StandInWorker, scheduler_settings

NAMESPACE = "goodput"
SERVICE = "goodput-inference"
ENTRY = f"k8s:///{NAMESPACE}/{SERVICE}:grpc"
BASE = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


class KubeApiStandIn:
    """A stand-in for kube-apiserver (which cannot run here), serving EndpointSlices only.

    Every write takes the next resourceVersion (one counter, as etcd's revision is). History older than ``oldest``
    is compacted away: a watch from an older version gets ``ERROR 410 Expired`` and must relist. ``interrupt()``
    ends the open watches (an API server restart or a watch timeout); ``outage`` answers 503 to everything."""

    def __init__(self) -> None:
        self.rv = 100
        self.oldest = 0
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list" | "watch", query)
        self.outage = False
        self._tick = asyncio.Event()  # replaced at every change; set to wake the open watches
        self._generation = 0  # open watches end when it moves
        self._bookmark: int | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(BASE, self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.interrupt()
        assert self._runner is not None
        await self._runner.cleanup()

    # ---- what the test does -------------------------------------------------------------------------------------

    def _changed(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def apply(self, obj: dict[str, Any]) -> None:
        """Creates or updates a slice (ADDED / MODIFIED)."""
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.slices[name] = obj
        self.history.append((self.rv, kind, obj))
        self._changed()

    def delete(self, name: str) -> None:
        obj = self.slices.pop(name)
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self.history.append((self.rv, "DELETED", obj))
        self._changed()

    def compact(self) -> None:
        """Other resources' writes move the revision on and compaction drops the history before it: every version
        a client holds is now too old to watch from."""
        self.rv += 10
        self.oldest = self.rv
        self.history.clear()

    def interrupt(self) -> None:
        self._generation += 1
        self._changed()

    def bookmark(self) -> int:
        """Other resources' writes move the revision on; the open watches that asked for bookmarks get one."""
        self.rv += 5
        self._bookmark = self.rv
        self._changed()
        return self.rv

    def watches(self) -> list[dict[str, str]]:
        return [q for kind, q in self.requests if kind == "watch"]

    def lists(self) -> int:
        return sum(1 for kind, _ in self.requests if kind == "list")

    # ---- the protocol ---------------------------------------------------------------------------------------------

    @staticmethod
    def _selected(obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watching = query.get("watch") in ("true", "1")
        self.requests.append(("watch" if watching else "list", query))
        if self.outage:
            return web.json_response(_status(503, "ServiceUnavailable", "the stand-in is down"), status=503)
        selector = query.get("labelSelector", "")
        if not watching:
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [s for s in self.slices.values() if self._selected(s, selector)]})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        sent = int(query.get("resourceVersion") or self.rv)
        try:
            if sent < self.oldest:
                await _send(response, "ERROR", _status(410, "Expired",
                                                        f"too old resource version: {sent} ({self.oldest})"))
                return response
            generation, bookmarked = self._generation, self._bookmark
            deadline = asyncio.get_running_loop().time() + float(query.get("timeoutSeconds") or 300)
            while True:
                tick = self._tick  # taken before looking, so a change made while writing wakes the next wait
                for rv, kind, obj in list(self.history):
                    if rv > sent and self._selected(obj, selector):
                        await _send(response, kind, obj)
                    sent = max(sent, rv)
                if self._bookmark != bookmarked and query.get("allowWatchBookmarks") == "true":
                    bookmarked = self._bookmark
                    await _send(response, "BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                       "metadata": {"resourceVersion": str(bookmarked)}})
                if self._generation != generation:
                    break
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(tick.wait(), remaining)
                except TimeoutError:
                    break
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client went away (the scheduler stopped)
        return response


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


async def _send(response: web.StreamResponse, kind: str, obj: dict[str, Any]) -> None:
    await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


def endpoint_slice(worker: StandInWorker, *, ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    """What the EndpointSlice controller writes for one worker pod. Each worker listens on its own port here, so each
    gets its own slice (a slice's ports apply to all its endpoints)."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": f"{SERVICE}-{worker.port}", "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": worker.port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"],
                       "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
                       "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": f"inference-{worker.port}"}}],
    }


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
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def lease(h: SchedulerHarness, request_id: str):  # type: ignore[no-untyped-def]
    call = h.stub.Lease(timeout=10)
    await call.write(scheduler_pb2.LeaseRequest(admit=scheduler_pb2.Admit(
        request_id=request_id, tenant="t", priority=types_pb2.PRIORITY_P0)))
    event = await call.read()
    while event.HasField("queued"):
        event = await call.read()
    assert event.HasField("granted"), event
    return call, event.granted.address


async def release(call) -> None:  # type: ignore[no-untyped-def]
    await call.write(scheduler_pb2.LeaseRequest(release=scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK)))
    await call.done_writing()
    assert (await call.read()).HasField("released")


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
    kube_api.apply(endpoint_slice(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        kube_api.apply(endpoint_slice(b))  # scale-out: a new ready pod
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address, b.address})
        calls, grants = [], []
        for i in range(4):
            call, address = await lease(h, f"r{i}")
            calls.append(call)
            grants.append(address)
        assert sorted(grants) == sorted([a.address, b.address] * 2)
        for call in calls:
            await release(call)
        kube_api.delete(endpoint_slice(a)["metadata"]["name"])  # scale-in, nothing in flight: removed at once
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        assert kube_api.lists() == 1, "one list, then one watch carried every change"
        assert kube_api.watches()[0]["resourceVersion"] == "101"  # from the list's version
        assert kube_api.watches()[0]["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"


async def test_a_terminating_endpoint_drains_while_its_lease_finishes(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(endpoint_slice(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        inflight, address = await lease(h, "long-stream")
        assert address == a.address
        kube_api.apply(endpoint_slice(b))
        await h.until(lambda: len(h.workers.healthy()) == 2)

        kube_api.apply(endpoint_slice(a, ready=False, terminating=True))  # the pod got SIGTERM
        await h.until(lambda: addresses(h.workers.draining()) == {a.address})
        assert addresses(h.workers.healthy()) == {b.address}
        assert h.metric("goodput_scheduler_workers", {"state": "draining"}) == 1
        assert h.metric("goodput_scheduler_workers", {"state": "healthy"}) == 1
        listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert {w.address: w.healthy for w in listed.workers} == {a.address: False, b.address: True}

        calls = []
        for i in range(3):  # new requests go elsewhere ...
            call, address = await lease(h, f"new{i}")
            assert address == b.address
            calls.append(call)
        worker_a = h.workers.get(a.address)
        assert worker_a is not None and worker_a.inflight == 1  # ... while the stream on the draining worker goes on
        await release(inflight)
        assert worker_a.inflight == 0 and h.workers.get(a.address) is worker_a  # still listed until its endpoint goes

        kube_api.delete(endpoint_slice(a)["metadata"]["name"])  # the pod exited
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        assert h.metric("goodput_scheduler_workers", {"state": "draining"}) == 0
        for call in calls:
            await release(call)


async def test_a_vanished_endpoint_leaves_once_its_leases_are_released(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(endpoint_slice(a))
    kube_api.apply(endpoint_slice(b))
    async with harness(kube_api, max_inflight_per_worker=1) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        calls = {rid: (await lease(h, rid))[0] for rid in ("r1", "r2")}  # one on each worker (the cap is one)
        kube_api.delete(endpoint_slice(a)["metadata"]["name"])
        await h.until(lambda: addresses(h.workers.draining()) == {a.address})
        worker_a = h.workers.get(a.address)
        assert worker_a is not None and worker_a.inflight == 1, "kept while its lease is in flight"
        (on_a,) = [rid for rid, held in h.leases.leases.items() if held.worker is worker_a]
        await release(calls.pop(on_a))
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        for call in calls.values():
            await release(call)


async def test_a_worker_that_turns_ready_again_takes_grants_again(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    kube_api.apply(endpoint_slice(a))
    async with harness(kube_api) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        kube_api.apply(endpoint_slice(a, ready=False))  # its readiness probe failed for a while
        await h.until(lambda: not h.workers.healthy() and len(h.workers.draining()) == 1)
        kube_api.apply(endpoint_slice(a))
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        call, address = await lease(h, "r1")
        assert address == a.address
        await release(call)


async def test_an_expired_version_relists_and_catches_up(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    kube_api.apply(endpoint_slice(a))
    async with harness(kube_api) as h:
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address})
        await eventually(lambda: len(kube_api.watches()) == 1)
        # While the watch is down its history is compacted, and the fleet changes: the resumed watch gets 410 Expired
        # (an ERROR event), and only a fresh list can show what happened.
        kube_api.interrupt()
        kube_api.delete(endpoint_slice(a)["metadata"]["name"])
        kube_api.apply(endpoint_slice(b))
        kube_api.compact()
        await h.until(lambda: addresses(h.workers.all()) == {b.address})
        await h.until(lambda: addresses(h.workers.healthy()) == {b.address})
        assert kube_api.lists() == 2
        await eventually(lambda: kube_api.watches()[-1]["resourceVersion"] == str(kube_api.rv))


async def test_a_bookmark_moves_the_resume_point(workers, kube_api) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    kube_api.apply(endpoint_slice(a))
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
    kube_api.apply(endpoint_slice(a))
    async with harness(kube_api) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        kube_api.outage = True
        kube_api.interrupt()
        await eventually(lambda: len(kube_api.watches()) >= 3, timeout=10)  # retried, backing off
        assert addresses(h.workers.healthy()) == {a.address}, "an API outage must not empty the fleet"
        call, address = await lease(h, "during-outage")
        assert address == a.address
        await release(call)
        kube_api.outage = False
        kube_api.apply(endpoint_slice(b))
        await h.until(lambda: addresses(h.workers.healthy()) == {a.address, b.address}, timeout=10)
