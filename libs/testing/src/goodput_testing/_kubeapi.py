"""A stand-in for kube-apiserver, which cannot run on this machine: the list/watch protocol of EndpointSlices, and
the read/create/replace of coordination.k8s.io Leases (leader election: a replace at a stale resourceVersion gets
409 Conflict, as from the real server).

It serves ``GET /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices`` the way the API server does, so the
official ``kubernetes`` client talks to it unchanged:

- a list (``?labelSelector=k=v``) answers an ``EndpointSliceList`` whose ``metadata.resourceVersion`` is the current
  version;
- a watch (``?watch=true&resourceVersion=N``) streams one JSON event per line — ADDED, MODIFIED, DELETED, and
  BOOKMARK when ``allowWatchBookmarks=true`` — for every change after N, until ``timeoutSeconds`` or until the test
  interrupts it; a version older than the history kept (see :meth:`KubeApiStandIn.compact`) gets one
  ``ERROR`` event of code 410 Expired, as from the real server, and the client must relist.

Every write takes the next resourceVersion from one counter, as etcd's revision is.

Example (in a coroutine)::

    api = KubeApiStandIn()
    await api.start()                                   # on 127.0.0.1, a free port: api.url
    api.apply(endpoint_slice("goodput", "inference", name="inference-a", address="127.0.0.1", port=50061))
    ...                                                 # a client lists and watches api.url
    await api.stop()

>>> s = endpoint_slice("ml", "inference", name="inference-a", address="10.0.0.7", port=50061, terminating=True)
>>> s["metadata"]["labels"], s["endpoints"][0]["conditions"]
({'kubernetes.io/service-name': 'inference'}, {'ready': False, 'serving': True, 'terminating': True})
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

from aiohttp import web

__all__ = ["KubeApiStandIn", "endpoint_slice"]

_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


def endpoint_slice(namespace: str, service: str, *, name: str, address: str, port: int, ready: bool = True,
                   terminating: bool = False, port_name: str = "grpc") -> dict[str, Any]:
    """An EndpointSlice of ``service`` with one endpoint, as the EndpointSlice controller writes it. A terminating pod's
    endpoint is not ready but still serving; ``ready=False`` alone is a pod failing its readiness probe."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv6" if ":" in address else "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address],
                       "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
                       "targetRef": {"kind": "Pod", "namespace": namespace, "name": name}}],
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class KubeApiStandIn:
    """EndpointSlices behind the list/watch protocol (see the module). What a test does: :meth:`apply`,
    :meth:`delete`, :meth:`compact` (history dropped: a resumed watch gets 410), :meth:`bookmark`, :meth:`interrupt`
    (the open watches end, as on an API server restart or a watch timeout), ``outage = True`` (503 to everything).
    ``requests`` records each request as ``("list" | "watch", query)``."""

    def __init__(self) -> None:
        self.rv = 100
        self.oldest = 0  # history before this version is compacted away
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> object
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.outage = False
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}  # coordination.k8s.io Leases (leader election)
        self._tick = asyncio.Event()  # replaced at every change; setting it wakes the open watches
        self._generation = 0  # open watches end when it moves
        self._bookmark: int | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listens on ``host:port`` (0: a free one); HTTPS with ``ssl_context``, as the in-cluster address is."""
        app = web.Application()
        app.router.add_get(_PATH, self._handle)
        app.router.add_post(_LEASES, self._create_lease)
        app.router.add_get(_LEASES + "/{name}", self._read_lease)
        app.router.add_put(_LEASES + "/{name}", self._replace_lease)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        self.url = f"{'https' if ssl_context else 'http'}://{host}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.interrupt()
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- what a test does -------------------------------------------------------------------------------------------

    def _changed(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def apply(self, obj: dict[str, Any]) -> int:
        """Creates or updates a slice (ADDED or MODIFIED); returns its new resourceVersion."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.slices else "ADDED"
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.slices[key] = obj
        self.history.append((self.rv, kind, obj))
        self._changed()
        return self.rv

    def delete(self, namespace: str, name: str) -> int:
        obj = self.slices.pop((namespace, name))
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self.history.append((self.rv, "DELETED", obj))
        self._changed()
        return self.rv

    def compact(self) -> None:
        """Other resources' writes move the revision on and compaction drops the history before it: every version a
        client holds is now too old to watch from."""
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

    # ---- the protocol -----------------------------------------------------------------------------------------------

    @staticmethod
    def _selected(obj: dict[str, Any], namespace: str, selector: str) -> bool:
        if obj["metadata"].get("namespace") != namespace:
            return False
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        namespace = request.match_info["namespace"]
        watching = query.get("watch") in ("true", "1")
        self.requests.append(("watch" if watching else "list", query))
        if self.outage:
            return web.json_response(_status(503, "ServiceUnavailable", "the stand-in is down"), status=503)
        selector = query.get("labelSelector", "")
        if not watching:
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [s for s in self.slices.values() if self._selected(s, namespace, selector)]})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        sent = int(query.get("resourceVersion") or self.rv)
        loop = asyncio.get_running_loop()
        try:
            if sent < self.oldest:
                await self._send(response, "ERROR", _status(410, "Expired",
                                                            f"too old resource version: {sent} ({self.oldest})"))
                return response
            generation, bookmarked = self._generation, self._bookmark
            deadline = loop.time() + float(query.get("timeoutSeconds") or 300)
            while True:
                tick = self._tick  # taken before looking, so a change made while writing wakes the next wait
                for rv, kind, obj in list(self.history):
                    if rv > sent and self._selected(obj, namespace, selector):
                        await self._send(response, kind, obj)
                    sent = max(sent, rv)
                if self._bookmark != bookmarked and query.get("allowWatchBookmarks") == "true":
                    bookmarked = self._bookmark
                    await self._send(response, "BOOKMARK", {
                        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": str(bookmarked)}})
                if self._generation != generation or loop.time() >= deadline:
                    break
                try:
                    await asyncio.wait_for(tick.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, kind: str, obj: dict[str, Any]) -> None:
        await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    # ---- coordination.k8s.io/v1 Leases: read, create, replace (optimistic concurrency on resourceVersion) ----------

    async def _read_lease(self, request: web.Request) -> web.Response:
        if self.outage:
            return web.json_response(_status(503, "ServiceUnavailable", "outage"), status=503)
        lease = self.leases.get((request.match_info["namespace"], request.match_info["name"]))
        if lease is None:
            return web.json_response(_status(404, "NotFound", "leases not found"), status=404)
        return web.json_response(lease)

    async def _create_lease(self, request: web.Request) -> web.Response:
        if self.outage:
            return web.json_response(_status(503, "ServiceUnavailable", "outage"), status=503)
        body = await request.json()
        key = (request.match_info["namespace"], body["metadata"]["name"])
        if key in self.leases:
            return web.json_response(_status(409, "AlreadyExists", "leases already exists"), status=409)
        return web.json_response(self._store_lease(key, body), status=201)

    async def _replace_lease(self, request: web.Request) -> web.Response:
        if self.outage:
            return web.json_response(_status(503, "ServiceUnavailable", "outage"), status=503)
        body = await request.json()
        key = (request.match_info["namespace"], request.match_info["name"])
        current = self.leases.get(key)
        if current is None:
            return web.json_response(_status(404, "NotFound", "leases not found"), status=404)
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response(_status(409, "Conflict", "the object has been modified"), status=409)
        return web.json_response(self._store_lease(key, body))

    def _store_lease(self, key: tuple[str, str], body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        lease = json.loads(json.dumps(body))
        lease["metadata"].update(namespace=key[0], name=key[1], resourceVersion=str(self.rv))
        lease.setdefault("kind", "Lease")
        lease.setdefault("apiVersion", "coordination.k8s.io/v1")
        self.leases[key] = lease
        return lease
