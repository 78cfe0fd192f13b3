"""Kubernetes-native worker discovery: the endpoints of one Service, from its EndpointSlices (list, then watch).

A worker entry ``k8s:///<namespace>/<service>:<port>`` names a Service; the scheduler lists the EndpointSlices
labelled ``kubernetes.io/service-name=<service>`` in that namespace, then watches them from the list's
resourceVersion with the official ``kubernetes`` client (its asyncio API, ``kubernetes.aio``). ``<port>`` is the
name of a Service port (each slice maps it to the pods' target port) or a literal port number.

Each endpoint address becomes one of two states:

- ``ready`` — ``conditions.ready`` true (or unset) and not terminating: the worker may be placed on;
- ``draining`` — terminating, or no longer ready: no new grants, but leases already granted finish there.

An endpoint missing from every slice is gone: the registry removes its worker once its leases are released.

The watch restarts from the last resourceVersion it saw (events and bookmarks advance it) when the server ends it,
relists when the server answers 410 Gone (the version was compacted away), and retries other failures with
capped, jittered exponential backoff. While the API server cannot be reached the last known endpoints stay: an API
blip must not empty the fleet.

Example:
    >>> target = ServiceTarget.parse("k8s:///ml/goodput-inference:grpc")
    >>> target.namespace, target.service, target.port, target.label_selector
    ('ml', 'goodput-inference', 'grpc', 'kubernetes.io/service-name=goodput-inference')
    >>> slice_ = {
    ...     "addressType": "IPv4", "ports": [{"name": "grpc", "port": 50061}],
    ...     "endpoints": [
    ...         {"addresses": ["10.0.0.7"], "conditions": {"ready": True}},
    ...         {"addresses": ["10.0.0.8"], "conditions": {"ready": False, "serving": True, "terminating": True}},
    ...     ]}
    >>> sorted((a, s.value) for a, s in slice_endpoints(slice_, "grpc").items())
    [('10.0.0.7:50061', 'ready'), ('10.0.0.8:50061', 'draining')]

In a coroutine (``apply`` receives every address's state after each change)::

    api = await kube_api_client(settings.kube_api_url)
    watch = EndpointSliceWatch(target, api, on_update=apply)
    task = asyncio.create_task(watch.run())     # cancel the task to stop; then ``await api.close()``
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

__all__ = ["SCHEME", "EndpointSliceWatch", "EndpointState", "ServiceTarget", "kube_api_client", "slice_endpoints"]

log = logging.getLogger("goodput.scheduler.discovery")

SCHEME = "k8s:///"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_ENTRY = re.compile(rf"k8s:///(?P<namespace>{_DNS_LABEL})/(?P<service>{_DNS_LABEL}):(?P<port>\d+|{_DNS_LABEL})")


class EndpointState(enum.Enum):
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class ServiceTarget:
    """A ``k8s:///<namespace>/<service>:<port>`` worker entry."""

    namespace: str
    service: str
    port: str  # a Service port's name, or a number

    @classmethod
    def parse(cls, entry: str) -> ServiceTarget:
        """Reads an entry; ValueError with the expected form when it is not one.

        >>> ServiceTarget.parse("k8s:///ml/inference:50061").port
        '50061'
        >>> ServiceTarget.parse("k8s:///inference:grpc")
        Traceback (most recent call last):
        ...
        ValueError: 'k8s:///inference:grpc' is not k8s:///<namespace>/<service>:<port name or number>
        """
        m = _ENTRY.fullmatch(entry.strip())
        if m is None:
            raise ValueError(f"{entry!r} is not {SCHEME}<namespace>/<service>:<port name or number>")
        return cls(m["namespace"], m["service"], m["port"])

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.namespace}/{self.service}:{self.port}"


def _slice_port(obj: Mapping[str, Any], port: str) -> int | None:
    if port.isdigit():
        return int(port)
    for p in obj.get("ports") or []:
        if p.get("name") == port and p.get("port"):
            return int(p["port"])
    return None


def slice_endpoints(obj: Mapping[str, Any], port: str) -> dict[str, EndpointState]:
    """The ``host:port`` addresses of one EndpointSlice (its JSON form) and their states. A slice without the named
    port contributes nothing. Unset conditions read as the API documents: ready and serving unless said otherwise,
    not terminating."""
    number = _slice_port(obj, port)
    if number is None:
        return {}
    out: dict[str, EndpointState] = {}
    for endpoint in obj.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        ready = conditions.get("ready") is not False
        terminating = conditions.get("terminating") is True
        state = EndpointState.READY if ready and not terminating else EndpointState.DRAINING
        for host in endpoint.get("addresses") or []:
            out[f"[{host}]:{number}" if ":" in host else f"{host}:{number}"] = state
    return out


def _merge(slices: Mapping[str, Mapping[str, EndpointState]]) -> dict[str, EndpointState]:
    """One state per address; an address in several slices (a slice being rebalanced) is ready if any says so."""
    out: dict[str, EndpointState] = {}
    for endpoints in slices.values():
        for address, state in endpoints.items():
            if out.get(address) is not EndpointState.READY:
                out[address] = state
    return out


async def kube_api_client(api_url: str = "") -> ApiClient:
    """A client of the Kubernetes API: ``api_url`` as is when given (no credentials: ``kubectl proxy``, or a test's
    stand-in), else the pod's service account when running in a cluster, else the kubeconfig (``KUBECONFIG`` or
    ``~/.kube/config``). The caller closes it."""
    from kubernetes.aio import client, config

    configuration = client.Configuration()
    if api_url:
        configuration.host = api_url.rstrip("/")
        source = "kube_api_url"
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
        source = "in-cluster service account"
    else:
        await config.load_kube_config(client_configuration=configuration)
        source = "kubeconfig"
    log.info("kubernetes api client", extra={"host": configuration.host, "source": source})
    return client.ApiClient(configuration)


UpdateCallback = Callable[[Mapping[str, EndpointState]], Awaitable[None]]


class EndpointSliceWatch:
    """Mirrors the endpoints of one Service: calls ``on_update(states)`` with every address's state after the
    initial list and after each change. Runs until its task is cancelled.

    ``watch_timeout_s`` is the server-side length of one watch request (randomised up to twice that, as client-go
    does, so many schedulers do not reconnect together); the watch then continues from the last resourceVersion.
    Failures back off from ``backoff_s`` to ``max_backoff_s``."""

    def __init__(self, target: ServiceTarget, api: ApiClient, *, on_update: UpdateCallback,
                 watch_timeout_s: float = 300.0, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 rand: Callable[[], float] = random.random) -> None:
        self.target = target
        self.api = api
        self.on_update = on_update
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._rand = rand
        self._slices: dict[str, dict[str, EndpointState]] = {}
        self._published: dict[str, EndpointState] | None = None
        self.resource_version: str | None = None
        self._failures = 0  # in a row; an event from the server resets it

    async def run(self) -> None:
        from kubernetes.aio.client.exceptions import ApiException

        while True:
            try:
                if self.resource_version is None:
                    await self._relist()
                await self._watch()
                continue  # the server ended the watch (its timeout): resume from the last version
            except ApiException as err:
                if err.status == 410:
                    log.info("endpointslice watch expired; relisting",
                             extra={"target": str(self.target), "resource_version": self.resource_version})
                    self.resource_version = None
                    if self._failures == 0:
                        self._failures = 1  # a second 410 before any event backs off
                        continue
                else:
                    log.warning("endpointslice list/watch failed",
                                extra={"target": str(self.target), "status": err.status, "error": err.reason})
            except (OSError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as err:
                # aiohttp's client errors are OSErrors; a malformed object is a ValueError/KeyError/TypeError
                log.warning("endpointslice list/watch failed",
                            extra={"target": str(self.target), "error": f"{type(err).__name__}: {err}"})
            self._failures += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self._failures - 1))
            await asyncio.sleep(delay * (0.5 + self._rand() / 2))

    def _api(self) -> Any:
        from kubernetes.aio.client import DiscoveryV1Api

        return DiscoveryV1Api(self.api)

    async def _relist(self) -> None:
        listed = await self._api().list_namespaced_endpoint_slice(self.target.namespace,
                                                                  label_selector=self.target.label_selector)
        self._slices = {}
        for item in listed.items or []:
            obj = self.api.sanitize_for_serialization(item)  # the JSON form, as watch events carry it
            self._slices[obj["metadata"]["name"]] = slice_endpoints(obj, self.target.port)
        self.resource_version = listed.metadata.resource_version
        log.info("endpointslices listed", extra={"target": str(self.target), "slices": len(self._slices),
                                                 "resource_version": self.resource_version})
        await self._publish()

    async def _watch(self) -> None:
        """One watch request from ``resource_version``, until the server ends it."""
        from kubernetes.aio import watch

        timeout = int(self.watch_timeout_s * (1 + self._rand()))
        stream = watch.Watch()
        async with stream:
            async for event in stream.stream(self._api().list_namespaced_endpoint_slice, self.target.namespace,
                                             label_selector=self.target.label_selector,
                                             resource_version=self.resource_version, allow_watch_bookmarks=True,
                                             timeout_seconds=timeout, _request_timeout=timeout + 30):
                kind, obj = event["type"], event["raw_object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[obj["metadata"]["name"]] = slice_endpoints(obj, self.target.port)
                elif kind == "DELETED":
                    self._slices.pop(obj["metadata"]["name"], None)
                # BOOKMARK: only the resourceVersion moves
                if stream.resource_version:
                    self.resource_version = stream.resource_version
                self._failures = 0
                if kind != "BOOKMARK":
                    await self._publish()

    async def _publish(self) -> None:
        states = _merge(self._slices)
        if states == self._published:
            return
        self._published = states
        await self.on_update(dict(states))
