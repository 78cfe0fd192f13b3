"""Leader election: scheduler replicas run active-passive, one leader admitting and placing, the others standing by
warm (their worker registries keep checking every worker) and taking over when the leader's lease lapses.

``LEADER_ELECTION``:

* ``none`` (default): this replica is always the leader (one replica; two would both admit against the same workers);
* ``redis``: a lock key (``LEADER_KEY``) set with ``SET NX PX`` to this replica's identity and renewed every
  ``LEADER_RENEW_S`` by a script that extends it only while it still holds this identity;
* ``kubernetes``: a ``coordination.k8s.io/v1`` Lease (``LEADER_LEASE_NAME`` in ``LEADER_NAMESPACE``, the pod's
  own namespace by default), taken when absent or expired and renewed with optimistic concurrency (its
  ``resourceVersion``), through the official ``kubernetes`` client — the protocol of client-go's leaderelection.

A leader that cannot renew in time (Redis or the API server unreachable, a partition) steps down *before* its lease
can expire for the others (it gives up after ``LEADER_TTL_S`` minus one renew interval without a renewal), so two
replicas never both believe they lead. On SIGTERM the leader deletes its lock or empties its Lease, so a rolling
update fails over at once instead of after the TTL. Failover after a crash takes at most ``LEADER_TTL_S`` plus one
``LEADER_RETRY_S``.

What the elected replica does with it (:class:`goodput_scheduler.__main__`): its ``goodput.scheduler.v1.Scheduler``
health turns SERVING (the gateways' channels send calls only to the replica that is SERVING: gRPC client-side health
checking), it admits leases, and gateways re-attach the leases they hold and re-admit the ones that were waiting.
Stepping down turns it NOT_SERVING, fails what waits in its queues with UNAVAILABLE (the gateways re-admit them at the
new leader) and closes its lease streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

log = logging.getLogger("goodput.scheduler.leader")

__all__ = ["Election", "KubernetesLease", "LeaderElector", "RedisLock", "identity", "pod_namespace"]

Hook = Callable[[], Awaitable[None]]


def pod_namespace() -> str:
    """The namespace this pod runs in: POD_NAMESPACE (the downward API), else its service account's, else default."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def identity() -> str:
    """This replica's name: the pod name in a cluster (POD_NAME, else the hostname), plus a random suffix so two
    processes on one host never share it."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class Election(Protocol):
    """One round of the protocol, against the store that holds the lock."""

    async def acquire(self) -> bool: ...  # take the lock if free (or already ours); True when ours now

    async def renew(self) -> bool: ...  # extend our hold; False when it is no longer ours

    async def release(self) -> None: ...  # give it up (on shutdown), only if ours

    async def close(self) -> None: ...


class LeaderElector:
    """Runs an :class:`Election`: tries to acquire every ``retry_s`` until elected, then renews every ``renew_s``;
    calls ``on_elected`` and ``on_lost`` on each change (never concurrently). ``None`` election: always leader."""

    def __init__(self, election: Election | None, *, ttl_s: float, renew_s: float, retry_s: float,
                 on_elected: Hook, on_lost: Hook) -> None:
        if election is not None and not renew_s < ttl_s:
            raise ValueError("the renew interval must be shorter than the lock's time to live")
        self.election = election
        self.ttl_s, self.renew_s, self.retry_s = ttl_s, renew_s, retry_s
        self.on_elected, self.on_lost = on_elected, on_lost
        self.leader = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.election is None:
            await self._become(True)
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        """Steps down and gives the lock up, so a standby takes over at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.leader:
            await self._become(False)
        if self.election is not None:
            try:
                await asyncio.wait_for(self.election.release(), timeout=2.0)
            except Exception as exc:  # the TTL frees it anyway
                log.warning("could not release the leader lock", extra={"error": str(exc)})
            await self.election.close()

    async def _become(self, leader: bool) -> None:
        if leader == self.leader:
            return
        self.leader = leader
        if leader:
            log.warning("elected leader")
            await self.on_elected()
        else:
            log.warning("no longer the leader")
            await self.on_lost()

    async def _run(self) -> None:
        assert self.election is not None
        loop = asyncio.get_running_loop()
        last_renewal = 0.0
        while True:
            unknown = False  # the store did not answer: the lock may still be ours
            try:
                if self.leader:
                    ok = await asyncio.wait_for(self.election.renew(), timeout=self.renew_s)
                else:
                    ok = await asyncio.wait_for(self.election.acquire(), timeout=self.retry_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("leader election round failed", extra={"error": str(exc)})
                ok, unknown = False, True
            now = loop.time()
            if ok:
                last_renewal = now
                await self._become(True)
            elif self.leader and (not unknown or now - last_renewal >= self.ttl_s - self.renew_s):
                # someone else holds it, or it could not be renewed in time: step down before the others may take it
                await self._become(False)
            await asyncio.sleep(self.renew_s if self.leader else self.retry_s)


_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end
"""


class RedisLock:
    """The lock as one Redis key holding the leader's identity, with a time to live."""

    def __init__(self, redis_url: str, *, key: str, me: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis

        self.redis: Any = aioredis.from_url(redis_url, socket_timeout=max(ttl_s / 3, 0.2),
                                            socket_connect_timeout=max(ttl_s / 3, 0.2))
        self.key, self.me, self.ttl_ms = key, me, int(ttl_s * 1000)

    async def acquire(self) -> bool:
        if await self.redis.set(self.key, self.me, nx=True, px=self.ttl_ms):
            return True
        holder = await self.redis.get(self.key)
        return holder is not None and holder.decode() == self.me and await self.renew()

    async def renew(self) -> bool:
        return bool(await self.redis.eval(_RENEW, 1, self.key, self.me, self.ttl_ms))

    async def release(self) -> None:
        await self.redis.eval(_RELEASE, 1, self.key, self.me)

    async def close(self) -> None:
        await self.redis.aclose()


class KubernetesLease:
    """The lock as a ``coordination.k8s.io/v1`` Lease: ``holderIdentity``, ``renewTime`` and
    ``leaseDurationSeconds``; every write is a replace at the resourceVersion read, so two candidates racing for an
    expired Lease cannot both win (one gets 409 Conflict)."""

    def __init__(self, *, namespace: str, name: str, me: str, ttl_s: float, api_url: str = "") -> None:
        self.namespace, self.name, self.me = namespace, name, me
        self.ttl_s = ttl_s
        self.api_url = api_url
        self._api: Any = None
        self._client: Any = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _body(self, *, resource_version: str | None, acquired: datetime | None, transitions: int) -> dict[str, Any]:
        now = datetime.now(timezone.utc)
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": self.me, "leaseDurationSeconds": max(int(round(self.ttl_s)), 1),
                         "acquireTime": (acquired or now).isoformat(), "renewTime": now.isoformat(),
                         "leaseTransitions": transitions}}

    async def acquire(self) -> bool:
        return await self._take(renewing=False)

    async def renew(self) -> bool:
        return await self._take(renewing=True)

    async def _take(self, *, renewing: bool) -> bool:
        from kubernetes.aio.client.exceptions import ApiException

        api = await self._api_client()
        try:
            lease = await api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as err:
            if err.status != 404 or renewing:
                raise
            try:
                await api.create_namespaced_lease(self.namespace, self._body(resource_version=None, acquired=None,
                                                                             transitions=0))
            except ApiException as created:
                if created.status == 409:  # another candidate created it first
                    return False
                raise
            return True
        spec = lease.spec
        holder = spec.holder_identity or ""
        mine = holder == self.me
        if not mine:
            if renewing:
                return False
            renewed = spec.renew_time or spec.acquire_time
            duration = spec.lease_duration_seconds or 0
            if holder and renewed is not None and renewed + timedelta(seconds=duration) > datetime.now(timezone.utc):
                return False  # held, and not expired
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        body = self._body(resource_version=lease.metadata.resource_version,
                          acquired=spec.acquire_time if mine else None, transitions=transitions)
        try:
            await api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as err:
            if err.status == 409:  # someone wrote it since we read it
                return False
            raise
        return True

    async def release(self) -> None:
        from kubernetes.aio.client.exceptions import ApiException

        api = await self._api_client()
        try:
            lease = await api.read_namespaced_lease(self.name, self.namespace)
        except ApiException:
            return
        if (lease.spec.holder_identity or "") != self.me:
            return
        body = self._body(resource_version=lease.metadata.resource_version, acquired=lease.spec.acquire_time,
                          transitions=lease.spec.lease_transitions or 0)
        body["spec"]["holderIdentity"] = None
        body["spec"]["leaseDurationSeconds"] = 1
        await api.replace_namespaced_lease(self.name, self.namespace, body)

    async def _api_client(self) -> Any:
        if self._api is None:
            from kubernetes.aio.client import CoordinationV1Api

            from goodput_scheduler.endpointslices import kube_api_client

            self._client = await kube_api_client(self.api_url)
            self._api = CoordinationV1Api(self._client)
        return self._api
