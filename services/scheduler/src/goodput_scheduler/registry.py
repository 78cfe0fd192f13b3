"""Worker registry: the inference workers the scheduler may place on, their health and their live load.

Workers come from ``settings.workers``: static ``host:port`` addresses, ``dns:///name:port`` (every address the
name resolves to, re-resolved), or ``k8s:///namespace/service:port`` (the Service's EndpointSlices, watched through
the Kubernetes API; see :mod:`goodput_scheduler.endpointslices`). A Kubernetes endpoint that is terminating or no
longer ready makes its worker *draining*: no new grants, while the leases it holds finish; an endpoint that is gone
removes its worker once those leases are released.

Each worker is checked every ``health_interval_s`` (standard gRPC health check, then ``GetLoad``). After
``unhealthy_after`` consecutive failures it is ejected (no new grants); after ``healthy_after`` passes it is
re-admitted. A failure reported by the gateway (a stream broke) triggers an immediate check, and a failed immediate
check ejects at once, so the next request does not go to a dead worker.

Example (in a coroutine)::

    registry = WorkerRegistry(settings, channel_factory=lambda addr: make_channel(addr, provider))
    await registry.start()          # begins the health loops
    registry.healthy()              # [Worker(...), ...]: the workers new grants may go to
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.leasebook import Occupancy
from goodput_scheduler.predict import DEFAULT_SPEED_PRIOR, WorkerSpeed

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

    from goodput_scheduler.endpointslices import EndpointState

log = logging.getLogger("goodput.scheduler.registry")

ChannelFactory = Callable[[str], aio.Channel]
# Leases a worker may hold before it has reported its engine's batch size (vLLM's max_num_seqs as Goodput sets it).
DEFAULT_LEASE_CAP = 64


@dataclass
class Worker:
    worker_id: str
    address: str
    channel: aio.Channel
    healthy: bool = False
    load: inference_pb2.WorkerLoad = field(default_factory=inference_pb2.WorkerLoad)
    model: inference_pb2.ModelInfo | None = None
    # What the scheduler's own grants hold here; changed only through leasebook.Hold (read it through the
    # properties below, documented on Occupancy's fields).
    occupancy: Occupancy = field(default_factory=Occupancy)
    consecutive_failures: int = 0
    consecutive_passes: int = 0
    last_error: str = ""
    removed: bool = False
    # Its endpoint is terminating, not ready or gone (k8s:/// discovery): no new grants, its leases finish.
    draining: bool = False
    # How fast it serves, learned from its finished leases (placement by predicted finish time, model "auto").
    speed: WorkerSpeed = field(default_factory=lambda: WorkerSpeed(DEFAULT_SPEED_PRIOR))
    # A gateway reported it failed and its check has not answered yet: no new grants until it does (a failover
    # admitted meanwhile must not be granted the worker it is leaving).
    suspect: bool = False

    @property
    def placeable(self) -> bool:
        """New grants may go here: it passes its checks, is not draining, is still registered and its engine is making
        progress (a worker reporting ``stalled_s`` has a hung engine; it also turns NOT_SERVING itself)."""
        return (self.healthy and not self.suspect and not self.draining and not self.removed
                and self.load.stalled_s <= 0)

    @property
    def capacity(self) -> int:
        return max(self.load.max_num_seqs, 1)

    def lease_cap(self, configured: int = 0) -> int:
        """Leases this worker may hold: ``configured`` when set (MAX_INFLIGHT_PER_WORKER overrides every worker),
        else its engine's batch size (the ``max_num_seqs`` it reports: a batch pool's 128, an interactive pool's
        16), else :data:`DEFAULT_LEASE_CAP` until it has reported.

        >>> w = Worker(worker_id="w", address="w", channel=None)
        >>> w.lease_cap(), w.lease_cap(4)
        (64, 4)
        >>> w.load.max_num_seqs = 128
        >>> w.lease_cap(), w.lease_cap(4)
        (128, 4)
        """
        if configured > 0:
            return configured
        return self.load.max_num_seqs if self.load.max_num_seqs > 0 else DEFAULT_LEASE_CAP

    @property
    def inflight(self) -> int:
        return self.occupancy.inflight

    @property
    def low_inflight(self) -> int:
        return self.occupancy.low_inflight

    @property
    def p0_prefilling(self) -> int:
        return self.occupancy.p0_prefilling

    @property
    def p0_prefill_tokens(self) -> int:
        return self.occupancy.p0_prefill_tokens

    @property
    def low_prefill_tokens(self) -> int:
        return self.occupancy.low_prefill_tokens


class WorkerRegistry:
    def __init__(self, settings: SchedulerSettings, *, channel_factory: ChannelFactory) -> None:
        self.settings = settings
        self._channel_factory = channel_factory
        self._workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._reapers: dict[str, asyncio.Task[None]] = {}  # workers whose endpoint is gone, waiting for their leases
        self._checks: set[asyncio.Task[None]] = set()  # checks of workers reported failed
        self._kube: ApiClient | None = None
        self.on_change: list[Callable[[], None]] = []

    # ---- membership ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for entry in self.settings.workers:
            if entry.startswith("dns:///"):
                target = entry.removeprefix("dns:///")
                self._tasks[entry] = asyncio.create_task(self._discovery_loop(target), name=f"discover:{target}")
            elif entry.startswith("k8s:///"):
                await self._start_endpointslice_watch(entry)
            else:
                self.add(entry)

    async def _start_endpointslice_watch(self, entry: str) -> None:
        from goodput_scheduler.endpointslices import EndpointSliceWatch, ServiceTarget, kube_api_client

        target = ServiceTarget.parse(entry)
        if self._kube is None:
            self._kube = await kube_api_client(self.settings.kube_api_url)
        known: set[str] = set()  # the addresses this entry put in the registry

        async def apply(states: Mapping[str, EndpointState]) -> None:
            known.intersection_update(self._workers)  # removed meanwhile (e.g. DeregisterWorker)
            await self._apply_endpoints(str(target), states, known)

        watch = EndpointSliceWatch(target, self._kube, on_update=apply)
        self._tasks[entry] = asyncio.create_task(watch.run(), name=f"discover:{entry}")

    async def _apply_endpoints(self, source: str, states: Mapping[str, EndpointState], known: set[str]) -> None:
        """Brings the workers of one ``k8s:///`` entry in line with its endpoints: ready ones are added (or stop
        draining), terminating or unready ones drain, vanished ones are retired."""
        from goodput_scheduler.endpointslices import EndpointState

        for address, state in states.items():
            worker = self._workers.get(address)
            if state is EndpointState.READY:
                known.add(address)
                if worker is None:
                    self.add(address)
                else:
                    await self.set_draining(address, False, reason="endpoint ready")
            elif worker is not None and address in known:
                # an endpoint seen first while not ready is not added: nothing would be granted there
                await self.set_draining(address, True, reason="endpoint terminating or not ready")
        for address in sorted(known - set(states)):
            known.discard(address)
            await self.retire(address, reason="endpoint gone")
        log.debug("endpoints applied", extra={"source": source, "endpoints": len(states), "workers": len(known)})

    async def set_draining(self, worker_id: str, draining: bool, *, reason: str) -> bool:
        """Stops (or resumes) new grants to a worker; the leases it holds are untouched. Returns whether it
        changed."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.removed or worker.draining == draining:
            return False
        worker.draining = draining
        if not draining and (reaper := self._reapers.pop(worker_id, None)) is not None:
            reaper.cancel()  # it came back before its leases were done
        log.info("worker %s", "draining" if draining else "undrained",
                 extra={"worker": worker_id, "reason": reason, "inflight": worker.inflight})
        await self._notify()
        return True

    async def retire(self, worker_id: str, *, reason: str) -> None:
        """Drains a worker and removes it once its leases are released (at once when it holds none; at the latest
        after ``worker_drain_timeout_s``)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.removed:
            return
        await self.set_draining(worker_id, True, reason=reason)
        if worker.inflight == 0:
            await self.remove(worker_id)
        elif worker_id not in self._reapers:
            self._reapers[worker_id] = asyncio.create_task(self._reap(worker), name=f"reap:{worker_id}")

    async def _reap(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.worker_drain_timeout_s
        while worker.inflight > 0 and not worker.removed and loop.time() < deadline:
            await asyncio.sleep(_REAP_POLL_S)
        if worker.inflight > 0:
            log.warning("worker removed with leases still held", extra={"worker": worker.worker_id,
                                                                        "inflight": worker.inflight})
        self._reapers.pop(worker.worker_id, None)
        await self.remove(worker.worker_id)

    async def _discovery_loop(self, target: str) -> None:
        """Keeps the workers behind a DNS name (a Kubernetes headless Service lists one A record per ready pod)
        in sync: new addresses are added, vanished ones removed."""
        host, _, port = target.rpartition(":")
        known: set[str] = set()
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                hosts = {str(info[4][0]) for info in infos}
                current = {f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts}
            except (OSError, ValueError) as err:
                log.warning("worker discovery failed", extra={"target": target, "error": str(err)})
                current = known  # keep what we had: a DNS blip must not empty the fleet
            for address in current - known:
                self.add(address)
            for address in known - current:
                await self.remove(address)
            known = current
            await asyncio.sleep(self.settings.discovery_interval_s)

    def add(self, address: str) -> Worker:
        worker_id = address
        if worker_id in self._workers and not self._workers[worker_id].removed:
            return self._workers[worker_id]
        worker = Worker(worker_id=worker_id, address=address, channel=self._channel_factory(address),
                        speed=WorkerSpeed(self.settings.predict.speed_prior()))
        self._workers[worker_id] = worker
        self._tasks[worker_id] = asyncio.create_task(self._health_loop(worker), name=f"health:{worker_id}")
        log.info("worker added", extra={"worker": worker_id})
        return worker

    async def remove(self, worker_id: str) -> bool:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        worker.removed = True
        worker.healthy = False
        task = self._tasks.pop(worker_id, None)
        if task:
            task.cancel()
        reaper = self._reapers.pop(worker_id, None)
        if reaper is not None and reaper is not asyncio.current_task():
            reaper.cancel()
        await worker.channel.close(grace=None)
        await self._notify()
        log.info("worker removed", extra={"worker": worker_id})
        return True

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._reapers.values(), *self._checks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the watches close their connections
        for worker_id in list(self._workers):
            await self.remove(worker_id)
        if self._kube is not None:
            await self._kube.close()
            self._kube = None

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def healthy(self) -> list[Worker]:
        """The workers new grants may go to (passing their checks, not draining)."""
        return [w for w in self._workers.values() if w.placeable]

    def draining(self) -> list[Worker]:
        """Registered workers that take no new grants while their leases finish."""
        return [w for w in self._workers.values() if w.draining and not w.removed]

    async def _notify(self) -> None:
        for cb in self.on_change:
            cb()

    # ---- health ----------------------------------------------------------------------------------------------

    async def _health_loop(self, worker: Worker) -> None:
        while not worker.removed:
            await self.check(worker)
            await asyncio.sleep(self.settings.health_interval_s)

    async def check(self, worker: Worker, *, eject_on_failure: bool = False) -> bool:
        """One health + load check. Returns whether it passed."""
        timeout = self.settings.health_timeout_s
        try:
            health = health_pb2_grpc.HealthStub(worker.channel)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                raise _NotServing(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
            stub = inference_pb2_grpc.InferenceStub(worker.channel)
            worker.load = await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=timeout)
            if worker.model is None:
                worker.model = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=timeout)
            passed, error = True, ""
        except (grpc.RpcError, _NotServing, asyncio.TimeoutError) as err:
            passed = False
            error = err.details() if isinstance(err, grpc.RpcError) and err.details() else str(err) or "timeout"
        await self._record(worker, passed, error, eject_now=eject_on_failure)
        return passed

    async def _record(self, worker: Worker, passed: bool, error: str, *, eject_now: bool) -> None:
        was = worker.healthy
        if passed:
            worker.consecutive_failures = 0
            worker.consecutive_passes += 1
            worker.last_error = ""
            if not worker.healthy and worker.consecutive_passes >= self.settings.healthy_after:
                worker.healthy = True
        else:
            worker.consecutive_passes = 0
            worker.consecutive_failures += 1
            worker.last_error = error
            if eject_now or worker.consecutive_failures >= self.settings.unhealthy_after:
                worker.healthy = False
        if was != worker.healthy:
            log.warning("worker %s", "admitted" if worker.healthy else "ejected",
                        extra={"worker": worker.worker_id, "error": error})
        await self._notify()

    def report_failure(self, worker_id: str, reason: str) -> None:
        """The gateway saw this worker fail mid-request: it takes no new grants from now on (so not the failover's
        admission that follows the report) until a check, started now, answers; it is ejected if the check fails."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.removed or worker.suspect:
            return
        log.warning("worker failure reported", extra={"worker": worker_id, "reason": reason})
        worker.suspect = True
        task = asyncio.get_running_loop().create_task(self._check_suspect(worker), name=f"suspect:{worker_id}")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check_suspect(self, worker: Worker) -> None:
        try:
            await self.check(worker, eject_on_failure=True)
        finally:
            worker.suspect = False
            await self._notify()


class _NotServing(Exception):
    pass


_REAP_POLL_S = 0.1  # how often a retired worker's leases are looked at (a counter read)
