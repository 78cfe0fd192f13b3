"""Admission, priority queues, overload shedding, dispatch and release of requests: the scheduler's domain logic,
free of gRPC.

* Every request joins the queue of its class (P0, P1, P2), each with its own depth and longest wait (settings).
* A dispatcher grants the head of the most urgent non-empty class to the best worker with room (late binding:
  nothing is bound to a worker before one has room). Inside a class, tenants take turns (round-robin, so one
  tenant's burst cannot starve another) and each tenant's requests go earliest deadline first.
* A request whose deadline (its own, or its class's queue timeout) passes while it waits is dropped before it
  reaches a worker: DeadlineExceeded.
* An :class:`OverloadDetector` turns queued work (in seconds of the observed drain rate), KV-cache usage and GPU
  utilisation into one saturation number; with hysteresis it stops admitting P2 first, then P1. P0 is refused only
  when its own queue is full. A refused request gets ResourceExhausted with a retry-after computed from the drain
  rate.
* ``queue_policy=fifo`` replaces all this with one arrival-order queue (a baseline for benchmarks).

Example:
    >>> ticket = leases.enqueue(PlacementRequest(...), deadline=time.monotonic() + 30)
    >>> lease = await leases.wait(ticket)      # or: lease = await leases.acquire(request, deadline=...)
    >>> ...  # the gateway streams from lease.worker.address
    >>> leases.release(lease, Outcome.OK)
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput_core.errors import DeadlineExceeded, GoodputError, ResourceExhausted, Unavailable
from goodput_core.metrics import LATENCY_BUCKETS
from goodput_core.priority import priority_name

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import Decision, PlacementPipeline, PlacementRequest
from goodput_scheduler.registry import Worker, WorkerRegistry

__all__ = ["CLASSES", "ClassQueue", "DrainRate", "LatencyGuard", "Lease", "LeaseManager", "OverloadDetector",
           "SchedulerMetrics", "Ticket"]

log = logging.getLogger("goodput.scheduler.leases")

P0, P1, P2 = int(types_pb2.PRIORITY_P0), int(types_pb2.PRIORITY_P1), int(types_pb2.PRIORITY_P2)
CLASSES = (P0, P1, P2)
FIFO = 0  # the one queue of the fifo policy
MAX_RETRY_AFTER_S = 600.0


@dataclass
class Lease:
    request: PlacementRequest
    worker: Worker
    reason: str
    queue_wait_s: float
    granted_at: float = field(default_factory=time.monotonic)
    released: bool = False
    priority: int = P1
    prefilling: bool = True  # no first token reported yet


@dataclass(eq=False)
class Ticket:
    """A request's place in its class queue until it is granted, dropped or cancelled."""

    request: PlacementRequest
    priority: int
    deadline: float | None  # the earlier of the call's deadline and the class's queue timeout
    call_deadline: float | None
    enqueued_at: float
    seq: int
    future: asyncio.Future[Decision]
    queue: ClassQueue | None = None
    claimed: bool = False  # the grant became a Lease (or was undone)

    def sort_key(self, fifo: bool) -> tuple[float, int]:
        if fifo:
            return (0.0, self.seq)
        return (self.deadline if self.deadline is not None else math.inf, self.seq)

    @property
    def done(self) -> bool:
        return self.future.done()


class ClassQueue:
    """One class's queue: a heap per tenant (earliest deadline first), tenants served in turn.

    >>> q = ClassQueue()
    >>> len(q)
    0
    """

    def __init__(self, *, fifo: bool = False) -> None:
        self.fifo = fifo
        self._tenants: collections.OrderedDict[str, list[tuple[tuple[float, int], Ticket]]] = \
            collections.OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Ticket]:
        for heap in self._tenants.values():
            for _, t in heap:
                yield t

    def push(self, t: Ticket) -> None:
        tenant = "" if self.fifo else t.request.tenant
        heap = self._tenants.get(tenant)
        if heap is None:
            heap = self._tenants[tenant] = []
        heapq.heappush(heap, (t.sort_key(self.fifo), t))
        t.queue = self
        self._size += 1

    def peek(self) -> Ticket | None:
        for heap in self._tenants.values():
            return heap[0][1]
        return None

    def pop_head(self) -> Ticket:
        tenant, heap = next(iter(self._tenants.items()))
        _, t = heapq.heappop(heap)
        del self._tenants[tenant]
        if heap:
            self._tenants[tenant] = heap  # to the back: the next tenant goes first next time
        self._size -= 1
        t.queue = None
        return t

    def remove(self, t: Ticket) -> bool:
        tenant = "" if self.fifo else t.request.tenant
        heap = self._tenants.get(tenant)
        if heap is None:
            return False
        for i, (_, other) in enumerate(heap):
            if other is t:
                heap.pop(i)
                heapq.heapify(heap)
                if not heap:
                    del self._tenants[tenant]
                self._size -= 1
                t.queue = None
                return True
        return False

    def position(self, t: Ticket) -> int:
        """Requests ahead in this queue (an estimate across tenants: those with an earlier key)."""
        key = t.sort_key(self.fifo)
        return sum(1 for other in self if other is not t and other.sort_key(self.fifo) < key)


class DrainRate:
    """Requests finished per second over a sliding window: how fast queued work drains.

    >>> d = DrainRate(window_s=10)
    >>> d.rate(now=0.0)
    0.0
    """

    def __init__(self, *, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque(maxlen=8192)
        self._since = time.monotonic()

    def add(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if not self._times:
            return 0.0
        span = min(self.window_s, max(now - self._since, 1.0))
        return len(self._times) / span


class OverloadDetector:
    """Saturation = max(queued work / what drains in ``queue_saturation_s``, mean KV usage / ``kv_saturation``,
    mean GPU utilisation / ``gpu_saturation``). Classes are shed from ``shed_p2_at`` (P2) and ``shed_p1_at`` (P1)
    and admitted again only below the threshold minus ``shed_hysteresis``, so admission does not flap. KV and GPU
    top out near 1.1, so alone they can shed P2 but never P1: only a growing queue does that."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.saturation = 0.0
        self.shedding: dict[int, bool] = {P1: False, P2: False}

    def update(self, *, queued: int, drain_rate: float, workers: list[Worker]) -> float:
        s = self.settings
        slots = sum(s.max_inflight_per_worker for _ in workers)
        drainable = max(drain_rate * s.queue_saturation_s, float(slots), 1.0)
        sat = queued / drainable
        if workers:
            kv = sum(w.load.kv_cache_usage for w in workers) / len(workers)
            sat = max(sat, kv / s.kv_saturation)
            gpus = [w.load.gpu_utilization for w in workers if w.load.gpu_utilization >= 0]
            if gpus:
                sat = max(sat, sum(gpus) / len(gpus) / s.gpu_saturation)
        self.saturation = sat
        for prio, threshold in ((P2, s.shed_p2_at), (P1, s.shed_p1_at)):
            if sat >= threshold:
                self.shedding[prio] = True
            elif sat < threshold - s.shed_hysteresis:
                self.shedding[prio] = False
        return sat

    def exit_level(self, prio: int) -> float:
        s = self.settings
        return (s.shed_p2_at if prio == P2 else s.shed_p1_at) - s.shed_hysteresis


def _prefill_tokens(estimate: int) -> int:
    return max(int(estimate), 1)


def _begin_prefill(worker: Worker, priority: int, prompt_tokens: int) -> None:
    """A granted request's prompt counts as pending prefill on its worker until its first token (or its end)."""
    if priority == P0:
        worker.p0_prefilling += 1
        worker.p0_prefill_tokens += _prefill_tokens(prompt_tokens)
    else:
        worker.low_prefill_tokens += _prefill_tokens(prompt_tokens)


def _end_prefill(worker: Worker, priority: int, prompt_tokens: int) -> None:
    if priority == P0:
        worker.p0_prefilling = max(worker.p0_prefilling - 1, 0)
        worker.p0_prefill_tokens = max(worker.p0_prefill_tokens - _prefill_tokens(prompt_tokens), 0)
    else:
        worker.low_prefill_tokens = max(worker.low_prefill_tokens - _prefill_tokens(prompt_tokens), 0)


P0_RATE_WINDOW_S = 10.0  # the P0 arrival rate behind p0_reserve(): recent enough to follow a surge


class LatencyGuard:
    """Keeps P0's TTFT near its unloaded value by adapting how many P1/P2 leases one worker may hold (AIMD).

    Lower-class work on a worker slows P0 there: its prompts' prefill chunks share the engine's steps, and its
    sequences make every decode step longer. Each ``guard_interval_s`` the guard compares the ``guard_percentile``
    of the P0 TTFTs the gateway reported (at the first token) with the target (``p0_ttft_target_s``, or
    ``p0_ttft_slo_ratio`` x the unloaded P0 TTFT it learned: the lowest per-interval median of the last five
    minutes). Above it, the P1/P2 limit shrinks by ``guard_decrease``; otherwise it grows by one, up to the
    class shares' cap. Work the guard holds back queues, the queue raises the saturation signal, and P2 (then P1)
    is shed: batch work yields to interactive work in steps an operator can see (``goodput_scheduler_guard_limit``).
    """

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.enabled = settings.latency_guard and settings.queue_policy == "priority"
        self.max_limit = float(max(int(settings.max_inflight_per_worker * max(settings.p1_max_share,
                                                                            settings.p2_max_share)), 1))
        self.limit = self.max_limit
        self.baseline: float | None = None
        self._samples: list[float] = []
        self._medians: collections.deque[tuple[float, float]] = collections.deque(maxlen=600)
        self._last = time.monotonic()
        self._last_p0 = -math.inf
        self._p0_arrivals: collections.deque[float] = collections.deque(maxlen=10_000)

    def current(self) -> float:
        return self.limit if self.enabled else math.inf

    def note_p0(self, now: float) -> None:
        """A P0 request arrived (interactive traffic is present: keep a worker ready for it)."""
        self._last_p0 = now
        self._p0_arrivals.append(now)
        while now - self._p0_arrivals[0] > P0_RATE_WINDOW_S:
            self._p0_arrivals.popleft()

    def p0_rate(self, now: float) -> float:
        """P0 arrivals per second over the last ``P0_RATE_WINDOW_S`` (reads only: a metrics scrape calls it too)."""
        stale = 0  # arrivals are in order and pruned at each arrival: only the head can be out of the window
        for t in self._p0_arrivals:
            if now - t <= P0_RATE_WINDOW_S:
                break
            stale += 1
        return (len(self._p0_arrivals) - stale) / P0_RATE_WINDOW_S

    def p0_reserve(self) -> int:
        """Workers to keep free of P1/P2 prefill now: 0 without recent P0 traffic, else ``p0_ready_workers``, or
        more when P0 requests arrive faster than one decode-only worker can start them one step each (P0 requests
        expected within ``p0_ready_per_ttft`` unloaded P0 TTFTs). The gate never reserves every worker."""
        s = self.settings
        if s.p0_ready_workers <= 0 or not self.p0_recent():
            return 0
        expected = 0
        if s.p0_ready_per_ttft > 0 and self.baseline is not None:
            expected = math.ceil(self.p0_rate(time.monotonic()) * self.baseline * s.p0_ready_per_ttft)
        return max(s.p0_ready_workers, expected)

    def p0_recent(self) -> bool:
        return self.enabled and time.monotonic() - self._last_p0 < self.settings.p0_recent_s

    def observe(self, ttft_s: float) -> None:
        if self.enabled and ttft_s > 0:
            self._samples.append(ttft_s)

    def target(self) -> float | None:
        if self.settings.p0_ttft_target_s > 0:
            return self.settings.p0_ttft_target_s
        return None if self.baseline is None else self.baseline * self.settings.p0_ttft_slo_ratio

    def maybe_adjust(self, now: float) -> bool:
        """Returns True when the limit grew (queued work may now fit). A decision waits for ``GUARD_MIN_SAMPLES``
        P0 TTFTs (at most ten intervals), so sparse P0 traffic still gets a verdict."""
        s = self.settings
        elapsed = now - self._last
        if not self.enabled or elapsed < s.guard_interval_s:
            return False
        if 0 < len(self._samples) < s.guard_min_samples and elapsed < 10 * s.guard_interval_s:
            return False  # keep collecting
        samples, self._samples, self._last = sorted(self._samples), [], now
        before = self.limit
        if len(samples) >= 3:
            self._medians.append((now, samples[len(samples) // 2]))
            while self._medians and now - self._medians[0][0] > 300:
                self._medians.popleft()
            self.baseline = min(m for _, m in self._medians)
        target = self.target()
        if samples and target is not None:
            observed = samples[min(int(len(samples) * s.guard_percentile), len(samples) - 1)]
            if observed > target:
                self.limit = max(1.0, math.floor(self.limit * s.guard_decrease))
                return False
        self.limit = min(self.max_limit, self.limit + 1.0)
        return self.limit > before


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, workers: WorkerRegistry) -> None:
        self.registry = registry
        self.queue_depth = Gauge("goodput_scheduler_queue_depth", "Requests waiting for a worker.", ["priority"],
                                 registry=registry)
        self.queue_wait = Histogram("goodput_scheduler_queue_wait_seconds", "Time from admit to grant.",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=registry)
        self.admissions = Counter("goodput_scheduler_admissions_total", "Requests granted a worker.", ["priority"],
                                  registry=registry)
        self.shed = Counter("goodput_scheduler_shed_total", "Requests refused or dropped before a grant, by reason "
                            "(queue_full, overload, deadline, timeout, no_worker).", ["priority", "reason"],
                            registry=registry)
        self.inflight = Gauge("goodput_scheduler_inflight", "Leases held per worker.", ["worker"],
                              registry=registry)
        self.placements = Counter("goodput_scheduler_placements_total", "Placement decisions.",
                                  ["worker", "reason"], registry=registry)
        self.releases = Counter("goodput_scheduler_releases_total", "Leases released, by outcome.", ["outcome"],
                                registry=registry)
        self.saturation = Gauge("goodput_scheduler_saturation", "Overload signal (1 = P2 shed by default).",
                                registry=registry)
        self.shedding = Gauge("goodput_scheduler_shedding", "1 while new requests of the class are shed.",
                              ["priority"], registry=registry)
        self.guard_limit = Gauge("goodput_scheduler_guard_limit", "P1/P2 leases one worker may hold now (latency "
                                 "guard).", registry=registry)
        self.p0_ttft_target = Gauge("goodput_scheduler_p0_ttft_target_seconds", "P0 TTFT the latency guard "
                                    "defends (0 until learned).", registry=registry)
        self.p0_ready_workers = Gauge("goodput_scheduler_p0_ready_workers", "Workers to keep free of P1/P2 prefill "
                                      "for P0 prompts now (0 without recent P0 traffic; the gate never reserves all "
                                      "workers).", registry=registry)
        self.drain_rate = Gauge("goodput_scheduler_drain_rate", "Leases released per second (recent window).",
                                registry=registry)
        workers_gauge = Gauge("goodput_scheduler_workers", "Workers by state.", ["state"], registry=registry)
        workers_gauge.labels("healthy").set_function(lambda: len(workers.healthy()))
        workers_gauge.labels("unhealthy").set_function(lambda: len(workers.all()) - len(workers.healthy()))


class LeaseManager:
    def __init__(self, settings: SchedulerSettings, registry: WorkerRegistry, pipeline: PlacementPipeline,
                 metrics: SchedulerMetrics, *, guard: LatencyGuard | None = None) -> None:
        self.settings = settings
        self.guard = guard or LatencyGuard(settings)
        self.registry = registry
        self.pipeline = pipeline
        self.metrics = metrics
        self.fifo = settings.queue_policy == "fifo"
        self.queues: dict[int, ClassQueue] = (
            {FIFO: ClassQueue(fifo=True)} if self.fifo else {p: ClassQueue() for p in CLASSES})
        self.overload = OverloadDetector(settings)
        self.drain = DrainRate()
        self.leases: dict[str, Lease] = {}
        self._seq = itertools.count()
        self._ticker: asyncio.Task[None] | None = None
        for prio in CLASSES:
            metrics.queue_depth.labels(priority_name(prio)).set_function(self._depth_reader(prio))
            metrics.shedding.labels(priority_name(prio)).set_function(self._shedding_reader(prio))
        metrics.saturation.set_function(lambda: self.overload.saturation)
        metrics.drain_rate.set_function(lambda: self.drain.rate(time.monotonic()))
        metrics.guard_limit.set_function(lambda: min(self.guard.current(), 1e9))
        metrics.p0_ttft_target.set_function(lambda: self.guard.target() or 0.0)
        metrics.p0_ready_workers.set_function(lambda: float(self.guard.p0_reserve()))
        registry.on_change.append(self._dispatch)

    def _depth_reader(self, prio: int) -> Callable[[], float]:
        return lambda: float(self.queued(prio))

    def _shedding_reader(self, prio: int) -> Callable[[], float]:
        return lambda: float(self.overload.shedding.get(prio, False))

    # ---- introspection ---------------------------------------------------------------------------------------

    def queued(self, prio: int | None = None) -> int:
        if prio is None:
            return sum(len(q) for q in self.queues.values())
        if self.fifo:
            return sum(1 for t in self.queues[FIFO] if t.priority == prio)
        return len(self.queues[prio])

    @property
    def waiting(self) -> int:
        return self.queued()

    def _class_limits(self, prio: int) -> tuple[int, float]:
        s = self.settings
        if self.fifo:
            return s.fifo_max_queue, 0.0
        return {P0: (s.p0_max_queue, s.p0_timeout_s), P1: (s.p1_max_queue, s.p1_timeout_s),
                P2: (s.p2_max_queue, s.p2_timeout_s)}[prio]

    def _ahead(self, prio: int) -> int:
        """Queued requests that would be granted before a new one of this class."""
        if self.fifo:
            return self.queued()
        return sum(len(self.queues[p]) for p in CLASSES if p <= prio)

    def retry_after_s(self, prio: int = P2) -> float:
        """When retrying is likely to succeed: the queue ahead drained at the observed rate, and for a class shed
        by overload, the time for saturation to fall back below the class's re-admission level."""
        now = time.monotonic()
        rate = self.drain.rate(now)
        ahead = self._ahead(prio) + 1
        if rate <= 0:
            # Nothing finished lately: assume one slot-time per queued batch of slots (1 s each).
            slots = max(len(self.registry.healthy()) * self.settings.max_inflight_per_worker, 1)
            return float(min(max(ahead / slots, 1.0), MAX_RETRY_AFTER_S))
        wait = ahead / rate
        if not self.fifo and prio in (P1, P2) and self.overload.shedding.get(prio):
            excess = self.overload.saturation - self.overload.exit_level(prio)
            wait = max(wait, excess * max(rate * self.settings.queue_saturation_s, 1.0) / rate)
        return float(min(max(wait, 0.5), MAX_RETRY_AFTER_S))

    # ---- admission -------------------------------------------------------------------------------------------

    def _update_overload(self) -> None:
        self.overload.update(queued=self.queued(), drain_rate=self.drain.rate(time.monotonic()),
                             workers=self.registry.healthy())

    def enqueue(self, req: PlacementRequest, *, deadline: float | None) -> Ticket:
        """Admits the request into its class queue (and dispatches at once), or refuses it: ResourceExhausted
        (queue full, or the class is shed under overload) or DeadlineExceeded (already expired)."""
        now = time.monotonic()
        prio = req.priority if req.priority in CLASSES else P1
        label = priority_name(prio)
        if deadline is not None and deadline <= now:
            self.metrics.shed.labels(label, "deadline").inc()
            raise DeadlineExceeded("the request's deadline passed before it was admitted")
        max_queue, timeout_s = self._class_limits(prio)
        if prio == P0:
            self.guard.note_p0(now)
        self._update_overload()
        if not self.fifo and prio != P0 and self.overload.shedding[prio]:
            self.metrics.shed.labels(label, "overload").inc()
            raise ResourceExhausted(
                f"overloaded (saturation {self.overload.saturation:.2f}): {label} requests are shed for now",
                code="overloaded", retry_after_s=self.retry_after_s(prio))
        queue = self.queues[FIFO if self.fifo else prio]
        if max_queue and len(queue) >= max_queue:
            self.metrics.shed.labels(label, "queue_full").inc()
            raise ResourceExhausted(f"the {label if not self.fifo else 'scheduler'} queue is full "
                                    f"({len(queue)} waiting)", code="queue_full",
                                    retry_after_s=self.retry_after_s(prio))
        effective = deadline
        if timeout_s > 0:
            effective = min(deadline, now + timeout_s) if deadline is not None else now + timeout_s
        ticket = Ticket(request=req, priority=prio, deadline=effective, call_deadline=deadline, enqueued_at=now,
                        seq=next(self._seq), future=asyncio.get_running_loop().create_future())
        queue.push(ticket)
        self._dispatch()
        if not ticket.done:
            self._ensure_ticker()
        return ticket

    def position(self, ticket: Ticket) -> int:
        if ticket.queue is None:
            return 0
        ahead = ticket.queue.position(ticket)
        if not self.fifo:
            ahead += sum(len(self.queues[p]) for p in CLASSES if p < ticket.priority)
        return ahead

    async def wait(self, ticket: Ticket) -> Lease:
        """Waits for the grant. Raises DeadlineExceeded or Unavailable when the request is dropped; on
        cancellation (the caller went away) the request leaves the queue, or a grant made meanwhile is undone."""
        try:
            decision = await asyncio.shield(ticket.future)
        except asyncio.CancelledError:
            self.abandon(ticket)
            raise
        ticket.claimed = True
        wait_s = time.monotonic() - ticket.enqueued_at
        lease = Lease(request=ticket.request, worker=decision.worker, reason=decision.reason, queue_wait_s=wait_s,
                      priority=ticket.priority)
        self.leases[ticket.request.request_id] = lease
        return lease

    def abandon(self, ticket: Ticket) -> None:
        """The caller went away before taking its grant: leave the queue, or give back a grant made meanwhile.
        Idempotent; a no-op once the grant became a lease (release that instead)."""
        if ticket.queue is not None:
            ticket.queue.remove(ticket)
        if not ticket.future.done():
            ticket.future.cancel()
            return
        if ticket.claimed or ticket.future.cancelled() or ticket.future.exception() is not None:
            return
        ticket.claimed = True
        worker = ticket.future.result().worker
        worker.inflight = max(worker.inflight - 1, 0)
        if ticket.priority != P0:
            worker.low_inflight = max(worker.low_inflight - 1, 0)
        _end_prefill(worker, ticket.priority, ticket.request.prompt_tokens)
        self.metrics.inflight.labels(worker.worker_id).set(worker.inflight)
        self._dispatch()

    async def acquire(self, req: PlacementRequest, *, deadline: float | None) -> Lease:
        """enqueue + wait."""
        return await self.wait(self.enqueue(req, deadline=deadline))

    # ---- dispatch --------------------------------------------------------------------------------------------

    def _order(self) -> list[ClassQueue]:
        return [self.queues[FIFO]] if self.fifo else [self.queues[p] for p in CLASSES]

    def _dispatch(self) -> None:
        """Grants queue heads, most urgent class first, while workers have room. A head that cannot be placed
        stops the pass (strict priority: a less urgent class never jumps a more urgent one)."""
        now = time.monotonic()
        workers = self.registry.all()
        for queue in self._order():
            while len(queue):
                ticket = queue.peek()
                assert ticket is not None
                if ticket.done:  # cancelled while queued
                    queue.pop_head()
                    continue
                if ticket.deadline is not None and now >= ticket.deadline:
                    queue.pop_head()
                    self._drop_expired(ticket)
                    continue
                decision = self.pipeline.place(ticket.request, workers)
                if decision is None:
                    return
                queue.pop_head()
                self._grant(ticket, decision, now)

    def _grant(self, ticket: Ticket, decision: Decision, now: float) -> None:
        worker = decision.worker
        worker.inflight += 1
        if ticket.priority != P0:
            worker.low_inflight += 1
        _begin_prefill(worker, ticket.priority, ticket.request.prompt_tokens)
        self.pipeline.commit(ticket.request, decision)
        label = priority_name(ticket.priority)
        self.metrics.inflight.labels(worker.worker_id).set(worker.inflight)
        self.metrics.admissions.labels(label).inc()
        self.metrics.queue_wait.labels(label).observe(now - ticket.enqueued_at)
        self.metrics.placements.labels(worker.worker_id, decision.reason).inc()
        ticket.future.set_result(decision)

    def _fail(self, ticket: Ticket, reason: str, err: GoodputError) -> None:
        if ticket.done:
            return
        self.metrics.shed.labels(priority_name(ticket.priority), reason).inc()
        ticket.future.set_exception(err)

    def _drop_expired(self, ticket: Ticket) -> None:
        if ticket.call_deadline is not None and ticket.deadline is not None \
                and ticket.call_deadline <= ticket.deadline:
            self._fail(ticket, "deadline",
                       DeadlineExceeded("the request's deadline passed while it waited for a worker"))
        else:
            limit = self._class_limits(ticket.priority)[1]
            self._fail(ticket, "timeout", DeadlineExceeded(
                f"the request waited longer than {priority_name(ticket.priority)}'s queue timeout ({limit:g} s)"))

    def _sweep(self) -> None:
        """Drops expired requests anywhere in the queues (not only at the heads), and fails requests that have
        waited ``no_worker_wait_s`` while no healthy worker exists."""
        now = time.monotonic()
        no_worker = not self.registry.healthy()
        for queue in self._order():
            for ticket in list(queue):
                if ticket.done:
                    queue.remove(ticket)
                elif ticket.deadline is not None and now >= ticket.deadline:
                    queue.remove(ticket)
                    self._drop_expired(ticket)
                elif no_worker and now - ticket.enqueued_at >= self.settings.no_worker_wait_s:
                    queue.remove(ticket)
                    self._fail(ticket, "no_worker", Unavailable(
                        "no healthy inference worker is available",
                        retry_after_s=self.settings.health_interval_s * 2))

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="scheduler-dispatch")

    async def _tick(self) -> None:
        """While anything waits: expire, re-dispatch (worker load changes), refresh the overload signal."""
        while self.queued():
            await asyncio.sleep(self.settings.dispatch_interval_s)
            self._sweep()
            self.guard.maybe_adjust(time.monotonic())
            self._dispatch()
            self._update_overload()
        self._update_overload()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for queue in self._order():
            for ticket in list(queue):
                queue.remove(ticket)
                if not ticket.done:
                    ticket.future.set_exception(Unavailable("the scheduler is shutting down", retry_after_s=1.0))

    # ---- first token and release -----------------------------------------------------------------------------

    def first_token(self, lease: Lease, ttft_s: float) -> None:
        """The gateway saw the lease's first token: its prompt no longer counts as pending prefill on the worker
        (the prefill gate may now admit more there), and a P0 TTFT reaches the latency guard at once."""
        if lease.released or not lease.prefilling:
            return
        lease.prefilling = False
        _end_prefill(lease.worker, lease.priority, lease.request.prompt_tokens)
        if lease.priority == P0:
            self.guard.observe(ttft_s)
        self._dispatch()

    def release(self, lease: Lease, outcome: int, *, ttft_s: float = 0.0) -> None:
        """Frees the lease's slot. ``ttft_s`` (the gateway's measured time to first token) feeds the latency
        guard when the lease was P0 (unless :meth:`first_token` already did)."""
        if lease.released:
            return
        lease.released = True
        self.leases.pop(lease.request.request_id, None)
        ttft_reported = not lease.prefilling  # first_token() already gave the guard this P0's TTFT
        if lease.prefilling:
            lease.prefilling = False
            _end_prefill(lease.worker, lease.priority, lease.request.prompt_tokens)
        lease.worker.inflight = max(lease.worker.inflight - 1, 0)
        if lease.priority != P0:
            lease.worker.low_inflight = max(lease.worker.low_inflight - 1, 0)
        elif outcome == scheduler_pb2.OUTCOME_OK and not ttft_reported:
            self.guard.observe(ttft_s)
        self.guard.maybe_adjust(time.monotonic())
        self.metrics.inflight.labels(lease.worker.worker_id).set(lease.worker.inflight)
        self.metrics.releases.labels(scheduler_pb2.Outcome.Name(outcome).removeprefix("OUTCOME_").lower()).inc()
        self.drain.add(time.monotonic())
        if outcome == scheduler_pb2.OUTCOME_WORKER_FAILED:
            asyncio.get_running_loop().create_task(
                self.registry.report_failure(lease.worker.worker_id, "reported by the gateway"))
        self._dispatch()
