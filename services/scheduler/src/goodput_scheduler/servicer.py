"""Thin gRPC servicer over the lease manager and the worker registry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict

from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio

from goodput_contracts.access import OPERATOR
from goodput_core.authz import normal_ip, peer_identity, peer_ip
from goodput_core.batching import event_batches, feed, unbatched
from goodput_core.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from goodput_core.tls import identity_prefix

from goodput_scheduler.config import MuxSettings
from goodput_scheduler.leases import LeaseManager
from goodput_scheduler.mux import LeaseMux
from goodput_scheduler.registry import Worker, WorkerRegistry

MAX_BATCH = 512  # lease events in one LeaseBatches message (a few hundred bytes each)


def worker_status(w: Worker, *, max_inflight: int = 0) -> scheduler_pb2.WorkerStatus:
    status = scheduler_pb2.WorkerStatus(worker_id=w.worker_id, address=w.address, healthy=w.placeable,
                                        inflight=w.inflight, last_error=w.last_error,
                                        consecutive_failures=w.consecutive_failures, draining=w.draining,
                                        lease_cap=w.lease_cap(max_inflight),
                                        pending_prefill_tokens=w.p0_prefill_tokens + w.low_prefill_tokens,
                                        speed=scheduler_pb2.SpeedEstimate(**asdict(w.speed.estimate())))
    status.load.CopyFrom(w.load)
    if w.model is not None:
        status.model.CopyFrom(w.model)
    return status


MAX_TENANT_WEIGHT = 1e6  # far beyond any ratio between tenants that means something; keeps the weights' sum finite


def tenant_weight(sent: float) -> float:
    """The admit's ``tenant_weight`` as a fair-share weight: 0 (unset) means 1; a negative, non-finite or absurdly
    large weight is refused rather than guessed at.

    >>> tenant_weight(0.0), tenant_weight(3.0)
    (1.0, 3.0)
    """
    if not (0 <= sent <= MAX_TENANT_WEIGHT):  # NaN fails this too
        raise InvalidArgument(f"tenant_weight must be between 0 and {MAX_TENANT_WEIGHT:g} (0 = 1)",
                              param="tenant_weight")
    return sent or 1.0


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, leases: LeaseManager, registry: WorkerRegistry, *, mux: MuxSettings) -> None:
        self.leases = leases
        self.registry = registry
        self.mux = mux
        self.leading = True  # a standby (leader election) admits nothing
        self._streams: set[asyncio.Queue[scheduler_pb2.LeaseMuxEvent | None | Exception]] = set()

    def _check_leading(self) -> None:
        if not self.leading:
            raise Unavailable("this scheduler replica is a standby; the leader admits requests", retry_after_s=0.5)

    def step_down(self) -> None:
        """No longer the leader: its queued requests fail UNAVAILABLE and its lease streams end UNAVAILABLE, so the
        gateways re-admit and re-attach at the new leader (the leases those streams held are released here)."""
        self.leading = False
        self.leases.step_down()
        for events in list(self._streams):
            events.put_nowait(Unavailable("this scheduler is no longer the leader", retry_after_s=0.5))

    async def LeaseBatches(self, request_iterator: AsyncIterator[scheduler_pb2.LeaseMuxBatch],
                           context: aio.ServicerContext) -> AsyncIterator[scheduler_pb2.LeaseMuxEventBatch]:
        """Many leases over one stream (:mod:`goodput_scheduler.mux`), batched each way: the events that queued up
        while the previous message was being written go out as one (:mod:`goodput_core.batching`)."""
        self._check_leading()
        requests = unbatched(request_iterator, items=lambda b: b.requests, limit=self.mux.max_batch,
                             method="LeaseBatches")
        events: asyncio.Queue[scheduler_pb2.LeaseMuxEvent | None | Exception] = asyncio.Queue()
        mux = LeaseMux(self.leases, events.put_nowait, max_leases=self.mux.max_leases, parse_weight=tenant_weight)
        reader = asyncio.get_running_loop().create_task(feed(requests, mux.handle, close=mux.close, events=events),
                                                        name="lease-mux")
        self._streams.add(events)
        try:
            batches = event_batches(events, limit=MAX_BATCH, wrap=lambda e: scheduler_pb2.LeaseMuxEventBatch(events=e))
            async with aclosing(batches):
                async for batch in batches:
                    yield batch
        finally:
            self._streams.discard(events)
            reader.cancel()
            mux.close()  # idempotent: whatever the reader had not given back yet

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: aio.ServicerContext) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=[
            worker_status(w, max_inflight=self.registry.settings.max_inflight_per_worker)
            for w in self.registry.all()])

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context: aio.ServicerContext) -> scheduler_pb2.RegisterWorkerResponse:
        """A worker registers itself: only the address it connects from (a stolen worker certificate cannot point
        the scheduler, and tenants' prompts, at another host)."""
        address = request.address.strip()
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > MAX_ADDRESS:
            raise InvalidArgument(f"address must be host:port (at most {MAX_ADDRESS} characters)", param="address")
        caller = peer_ip(context)
        if caller not in await _addresses(address):
            raise PermissionDenied(f"a worker may register only the address it connects from ({caller or 'unknown'}), "
                                   f"not {host}", param="address", code="not_your_address")
        worker = self.registry.add(address)
        return scheduler_pb2.RegisterWorkerResponse(worker_id=worker.worker_id)

    async def DeregisterWorker(self, request: scheduler_pb2.DeregisterWorkerRequest,
                               context: aio.ServicerContext) -> scheduler_pb2.DeregisterWorkerResponse:
        """The worker itself (from its own address) or the operator takes a worker out."""
        worker = self.registry.get(request.worker_id)
        if worker is None:
            raise NotFound(f"no worker {request.worker_id!r}")
        if peer_identity(context, identity_prefix(self.registry.settings)) != OPERATOR:
            caller = peer_ip(context)
            if caller not in await _addresses(worker.address):
                raise PermissionDenied(f"only worker {request.worker_id!r} itself or the operator may deregister it",
                                       param="worker_id", code="not_your_worker")
        await self.registry.remove(request.worker_id)
        return scheduler_pb2.DeregisterWorkerResponse()


# The longest host:port there is: a DNS name (253) or a bracketed IPv6 address with a zone, ":" and five digits.
MAX_ADDRESS = 261


async def _addresses(address: str) -> set[str]:
    """The IP addresses the host of ``address`` (host:port) names: itself when it is one, else what it resolves to."""
    host = address.rpartition(":")[0]
    if ip := normal_ip(host):
        return {ip}
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except OSError:
        return set()
    return {normal_ip(str(info[4][0])) for info in infos}
