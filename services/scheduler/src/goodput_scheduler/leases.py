"""Admission, dispatch and release of requests: the scheduler's domain logic, free of gRPC.

* Every request joins the queue of its class (P0, P1, P2), each with its own depth and longest wait
  (:mod:`~goodput_scheduler.queues`). A bounded depth is shared out between the tenants waiting, by weight: when the
  queue is full, a tenant at its share is refused, and a tenant under it takes the place of the newest request of
  the tenant most over its own share (that request fails with ResourceExhausted and a retry-after).
* A dispatcher grants the head of the most urgent non-empty class to the best worker with room (late binding:
  nothing is bound to a worker before one has room; :mod:`~goodput_scheduler.placement` decides which). Inside a
  class, tenants take turns and each tenant's requests go earliest deadline first.
* The slots are shared out too (:mod:`~goodput_scheduler.fairshare`, no configuration): a tenant at its weighted
  share of a class's slots gets no new one while another waits below its own (nor the free slots kept for an active
  tenant below its share: those it gave back since its peak of the last seconds, two at the least), and one that
  finds no slot gets a lease of the tenant most over its share taken back at once (preempted: the gateway admits it
  again and starts it, or continues its answer from the tokens already sent). A request of ``n`` sequences holds
  ``n`` slots.
* A request whose deadline (its own, or its class's queue timeout) passes while it waits is dropped before it
  reaches a worker: DeadlineExceeded.
* The overload detector (:mod:`~goodput_scheduler.overload`) sheds P2 first, then P1; P0 is refused only when its
  own queue is full. A refused request gets ResourceExhausted with a retry-after computed from the drain rate.
* The latency guard (:mod:`~goodput_scheduler.guard`) bounds P1/P2 concurrency per worker to protect P0's TTFT.
* What each grant holds on its worker is booked in :mod:`~goodput_scheduler.leasebook`, the one owner of a
  worker's counters.
* The queue policy (:class:`~goodput_scheduler.queues.QueuePolicy`) lays out the queues, their bounds and shedding.
* Worker-seconds in which a healthy worker had room while a request it could serve waited are counted in
  :mod:`~goodput_scheduler.efficiency`, updated at each change below (what counts, held back on purpose included).

Time comes from an injected :class:`~goodput_scheduler.clock.Clock`.

Example (in a coroutine; :mod:`~goodput_scheduler.mux` does this per lease)::

    ticket = leases.enqueue(request, deadline=leases.clock.now() + 30)   # or refused: ResourceExhausted
    lease = await leases.wait(ticket)         # or: lease = await leases.acquire(request, deadline=...)
    ...                                       # the gateway streams from lease.worker.address
    leases.first_token(lease, ttft_s=0.12)    # the prompt is prefilled
    leases.release(lease, Outcome.OK)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from functools import partial

from goodput.scheduler.v1 import scheduler_pb2

from goodput_core.errors import DeadlineExceeded, GoodputError, NotFound, ResourceExhausted, Unavailable
from goodput_core.priority import priority_name

from goodput_scheduler.clock import Clock, SystemClock
from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.efficiency import IdleWhileQueued
from goodput_scheduler.fairshare import ACTIVE_S, Shares
from goodput_scheduler.guard import LatencyGuard
from goodput_scheduler.leasebook import Grant, Lease, LeaseBook
from goodput_scheduler.metrics import SchedulerMetrics
from goodput_scheduler.overload import DrainRate, OverloadDetector, retry_after_s
from goodput_scheduler.placement import Decision, HasCapacity, PlacementPipeline, PlacementRequest
from goodput_scheduler.predict import ServiceTimePredictor
from goodput_scheduler.queues import CLASSES, P0, P1, P2, QUEUE_POLICIES, ClassQueue, ClassQueues, Ticket
from goodput_scheduler.registry import Worker, WorkerRegistry

__all__ = ["DISPATCH_INTERVAL_S", "LeaseManager"]

log = logging.getLogger("goodput.scheduler.leases")

# The dispatcher's tick while requests wait (the former DISPATCH_INTERVAL_S setting; no chart, test or benchmark set
# it): admits, releases, first tokens and worker changes dispatch at once, so the tick only bounds how late a queue
# timeout, a load change seen by a health check or the guard's next step is acted on.
DISPATCH_INTERVAL_S = 0.05


class LeaseManager:
    def __init__(self, settings: SchedulerSettings, registry: WorkerRegistry, pipeline: PlacementPipeline,
                 metrics: SchedulerMetrics, *, guard: LatencyGuard | None = None,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or (guard.clock if guard is not None else SystemClock())
        self.guard = guard or LatencyGuard(settings, clock=self.clock)
        self.registry = registry
        self.pipeline = pipeline
        self.metrics = metrics
        self.policy = QUEUE_POLICIES[settings.queue_policy]
        self.queues = ClassQueues(self.policy, settings)
        self.overload = OverloadDetector(settings)
        self.drain = DrainRate(clock=self.clock)
        self.predictor = ServiceTimePredictor(prefill_s_per_token=settings.predict.prefill_s_per_token,
                                              tpot_s=settings.predict.tpot_s)
        self.book = LeaseBook(on_change=self._inflight_changed)
        # the room placement gives P0 (the has_capacity filter's cap and KV limit; its defaults without one)
        cap = next((f for f in pipeline.filters if isinstance(f, HasCapacity)), None)
        self.efficiency = IdleWhileQueued(
            now=self.clock.now, workers=registry.all,
            max_inflight=cap.max_inflight if cap is not None else settings.max_inflight_per_worker,
            kv_full=cap.kv_full if cap is not None else HasCapacity.Parameters().kv_full)
        self.on_change: list[Callable[[], None]] = []  # after every change of the queues or the leases
        # per class, tenants whose last lease there ended lately: when, and their weight (fairshare.ACTIVE_S)
        self._recent: dict[int, dict[str, tuple[float, float]]] = {prio: {} for prio in CLASSES}
        # per class and tenant, the slots it held at its changes in the last ACTIVE_S as a running maximum: (when,
        # slots) with the slots falling from the head, which is its peak (Shares.peak); at most the fleet's slots long
        self._peaks: dict[int, dict[str, collections.deque[tuple[float, int]]]] = {prio: {} for prio in CLASSES}
        self._seq = itertools.count()
        self._ticker: asyncio.Task[None] | None = None
        self._bind_gauges()
        registry.on_change.append(self._dispatch)

    def _bind_gauges(self) -> None:
        m = self.metrics
        for prio in CLASSES:
            m.queue_depth.labels(priority_name(prio)).set_function(partial(self.queued, prio))
            m.queue_tenants.labels(priority_name(prio)).set_function(partial(self.queues.tenants, prio))
            m.shedding.labels(priority_name(prio)).set_function(partial(self.overload.sheds, prio))
        m.saturation.set_function(lambda: self.overload.saturation)
        m.drain_rate.set_function(lambda: self.drain.rate(self.clock.now()))
        m.guard_limit.set_function(lambda: min(self.guard.current(), 1e9))
        m.p0_ttft_target.set_function(lambda: self.guard.target() or 0.0)
        m.p0_ready_workers.set_function(lambda: float(self.guard.p0_reserve()))
        m.idle_while_queued.set_function(self.efficiency.seconds)
        m.queued_with_idle_workers.set_function(lambda: float(self.efficiency.active))

    def _inflight_changed(self, worker: Worker) -> None:
        self.metrics.inflight.labels(worker.worker_id).set(worker.inflight)

    def _notify(self) -> None:
        self.efficiency.update()  # first: the time since the last change is added with the state before this one
        for cb in self.on_change:
            cb()

    # ---- introspection ---------------------------------------------------------------------------------------

    @property
    def leases(self) -> dict[str, Lease]:
        """The leases held now, by request id."""
        return self.book.leases

    def queued(self, prio: int | None = None) -> int:
        return self.queues.queued(prio)

    def retry_after_s(self, prio: int = P2) -> float:
        """When retrying is likely to succeed: the queue ahead drained at the observed rate, and for a class shed
        by overload, the time for saturation to fall back below the class's re-admission level."""
        shed = self.policy.sheds_classes and self.overload.sheds(prio)
        return retry_after_s(
            ahead=self.queues.ahead(prio) + 1, rate=self.drain.rate(self.clock.now()),
            slots=sum(w.lease_cap(self.settings.max_inflight_per_worker) for w in self.registry.healthy()),
            shed_excess=self.overload.saturation - self.overload.exit_level(prio) if shed else 0.0,
            queue_saturation_s=self.settings.saturation.queue_s)

    def position(self, ticket: Ticket) -> int:
        return self.queues.position(ticket)

    def granted(self, lease: Lease) -> scheduler_pb2.Granted:
        """What a ``granted`` event says of ``lease``: its worker, why, its wait, and the slots left there."""
        worker = lease.worker
        free = max(worker.lease_cap(self.settings.max_inflight_per_worker) - worker.inflight, 0)
        return scheduler_pb2.Granted(worker_id=worker.worker_id, address=worker.address, reason=lease.reason,
                                     queue_wait_s=lease.queue_wait_s, free_slots=free)

    # ---- admission -------------------------------------------------------------------------------------------

    def _update_overload(self) -> None:
        self.overload.update(queued=self.queued(), drain_rate=self.drain.rate(self.clock.now()),
                             workers=self.registry.healthy())

    def enqueue(self, req: PlacementRequest, *, deadline: float | None,
                queue_deadline: float | None = None) -> Ticket:
        """Admits the request into its class queue (and dispatches at once), or refuses it: ResourceExhausted
        (queue full, or the class is shed under overload) or DeadlineExceeded (already expired). ``deadline`` (the
        request's) and ``queue_deadline`` (its queue-wait budget's end: it may not wait past it) are on this
        manager's clock."""
        now = self.clock.now()
        prio = req.priority if req.priority in CLASSES else P1
        label = priority_name(prio)
        if deadline is not None and deadline <= now:
            self.metrics.shed.labels(label, "deadline").inc()
            raise DeadlineExceeded("the request's deadline passed before it was admitted")
        if deadline is not None and self.settings.predict.deadlines and not req.resumed:
            self._refuse_if_late(req, prio, deadline, now)
        queue = self.queues.of[prio]
        if prio == P0:
            self.guard.note_p0(now)
        self._update_overload()
        if self.policy.sheds_classes and self.overload.sheds(prio) and not req.resumed:
            self.metrics.shed.labels(label, "overload").inc()
            raise ResourceExhausted(
                f"overloaded (saturation {self.overload.saturation:.2f}): {label} requests are shed for now",
                code="overloaded", retry_after_s=self.retry_after_s(prio))
        if queue.max_queue and len(queue) >= queue.max_queue and not req.resumed:
            self._make_room(queue, req, prio)
        # a resumed answer waits until its own deadline, never the class's queue timeout: its caller is mid-stream
        timeout = now + queue.timeout_s if queue.timeout_s > 0 and not req.resumed else None
        effective = min((d for d in (deadline, timeout, queue_deadline) if d is not None), default=None)
        ticket = Ticket(request=req, priority=prio, deadline=effective, call_deadline=deadline, enqueued_at=now,
                        queue_deadline=queue_deadline,
                        seq=next(self._seq), future=asyncio.get_running_loop().create_future())
        queue.push(ticket)
        self.efficiency.queued(prio, model=req.model)
        self._dispatch()
        if not ticket.done:
            self._ensure_ticker()
        return ticket

    def _refuse_if_late(self, req: PlacementRequest, prio: int, deadline: float, now: float) -> None:
        """Seed 002's backpressure: a request predicted not to finish before its deadline is refused now, not
        started and cut. DeadlineExceeded when it cannot finish in time even alone; ResourceExhausted with a
        retry-after when only the queue ahead of it is in the way."""
        label = priority_name(prio)
        service = self.predictor.service_s(prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens,
                                           fixed=req.fixed_output)
        tokens = self.predictor.expected_tokens(req.max_tokens, fixed=req.fixed_output)
        left = deadline - now
        if service > left:
            self.metrics.shed.labels(label, "predicted_late").inc()
            raise DeadlineExceeded(
                f"the request is predicted to take {service:.2f} s ({tokens} tokens at "
                f"{self.predictor.tpot_s * 1000:.1f} ms each, plus prefill) and its deadline is in {left:.2f} s",
                code="deadline_unreachable")
        ahead = self.queues.ahead(prio)
        if ahead == 0:
            return
        wait = self.retry_after_s(prio)
        if wait + service > left:
            self.metrics.shed.labels(label, "predicted_late").inc()
            raise ResourceExhausted(
                f"the request would wait about {wait:.2f} s behind {ahead} queued and then take {service:.2f} s; its "
                f"deadline is in {left:.2f} s: retry when the queue has drained", code="deadline_unreachable_now",
                retry_after_s=wait)

    def _make_room(self, queue: ClassQueue, req: PlacementRequest, prio: int) -> None:
        """The class queue is full: refuse the request, or (its tenant under its share) push out the newest request
        of the tenant most over its own. Either way the tenant named is the one whose share is full."""
        label = priority_name(prio)
        full, max_queue = queue.when_full(req), queue.max_queue
        if full is None:  # no shares to weigh: one tenant alone, or a queue without shares
            self.metrics.shed.labels(label, "queue_full").inc()
            raise ResourceExhausted(f"the {queue.name} queue is full ({len(queue)} waiting)", code="queue_full",
                                    retry_after_s=self.retry_after_s(prio))
        if full.gives_way is None:
            self.metrics.shed.labels(label, "tenant_share").inc()
            raise ResourceExhausted(f"tenant {full.tenant}'s share of the {label} queue is full ({full.held} of "
                                    f"{max_queue} places)", code="queue_full", retry_after_s=self.retry_after_s(prio))
        self._unqueue(full.gives_way)
        self._fail(full.gives_way, "tenant_share", ResourceExhausted(
            f"tenant {full.tenant} holds more than its share of the {label} queue ({full.held} of {max_queue} "
            f"places; its share is {full.share:.3g}): its newest waiting request gave its place to another "
            "tenant's", code="queue_full", retry_after_s=self.retry_after_s(full.gives_way.priority)))

    async def wait(self, ticket: Ticket) -> Lease:
        """Waits for the grant. Raises DeadlineExceeded or Unavailable when the request is dropped; on
        cancellation (the caller went away) the request leaves the queue, or a grant made meanwhile is undone."""
        try:
            await asyncio.shield(ticket.future)
        except asyncio.CancelledError:
            self.abandon(ticket)
            raise
        return self.claim(ticket)

    def claim(self, ticket: Ticket) -> Lease:
        """The lease of a ticket whose grant is made (``ticket.done``, no error): :meth:`wait` without the wait, for a
        request placed as it was enqueued. Raises what the ticket failed with, as :meth:`wait` does."""
        grant = ticket.future.result()
        ticket.claimed = True
        now = self.clock.now()
        return self.book.open(ticket.request, grant, priority=ticket.priority, queue_wait_s=now - ticket.enqueued_at,
                              now=now)

    def abandon(self, ticket: Ticket) -> None:
        """The caller went away before taking its grant: leave the queue, or give back a grant made meanwhile.
        Idempotent; a no-op once the grant became a lease (release that instead)."""
        self._unqueue(ticket)
        if not ticket.future.done():
            ticket.future.cancel()
            self._notify()
            return
        if ticket.claimed or ticket.future.cancelled() or ticket.future.exception() is not None:
            return
        ticket.claimed = True
        self.book.undo(ticket.future.result())
        self._dispatch()

    def attach(self, req: PlacementRequest, worker_id: str, *, prefilling: bool) -> Lease:
        """A lease a previous leader granted, still running on ``worker_id``, that a gateway brings to this one after a
        failover: booked on its worker as it is (no queue, no cap: the request is already there), so this leader's
        counts are right again, and released like any other. NotFound when this scheduler does not know the
        worker (the gateway's release of it then has nothing to give back here)."""
        worker = self.registry.get(worker_id)
        if worker is None or worker.removed:
            raise NotFound(f"no worker {worker_id!r} here to attach the lease to")
        prio = req.priority if req.priority in CLASSES else P1
        grant = self.book.hold(Decision(worker=worker, reason="attached", score=0.0), req, prio)
        lease = self.book.open(req, grant, priority=prio, queue_wait_s=0.0, now=self.clock.now())
        if not prefilling:
            self.book.first_token(lease)
            lease.first_token_at = lease.granted_at
        self.metrics.attached.inc()
        self._notify()
        return lease

    def step_down(self) -> None:
        """This replica is no longer the leader: every request waiting in its queues fails UNAVAILABLE (a gateway
        re-admits it at the new leader). The leases it holds stay booked until their streams close."""
        for queue in self.queues:
            for ticket in list(queue):
                self._unqueue(ticket)
                self._fail(ticket, "not_leader", Unavailable(
                    "this scheduler is no longer the leader; the request is re-admitted at the new one",
                    retry_after_s=0.5))
        self._notify()

    async def acquire(self, req: PlacementRequest, *, deadline: float | None) -> Lease:
        """enqueue + wait."""
        return await self.wait(self.enqueue(req, deadline=deadline))

    # ---- dispatch --------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grants queue heads, most urgent class first, while workers have room. A head that cannot be placed
        stops the pass (strict priority: a less urgent class never jumps a more urgent one)."""
        self._dispatch_pass()
        self._make_room_for_waiting()
        self._notify()

    def _dispatch_pass(self) -> None:
        now = self.clock.now()
        workers = self.registry.all()
        for queue in self.queues:
            while len(queue):
                ticket = self._head(queue)
                if ticket is None:
                    break
                if ticket.done:  # cancelled while queued
                    self._pop_head(queue, ticket)
                    continue
                if ticket.deadline is not None and now >= ticket.deadline:
                    self._pop_head(queue, ticket)
                    self._drop_expired(ticket)
                    continue
                decision = self.pipeline.place(ticket.request, workers)
                if decision is None:
                    return
                self._pop_head(queue, ticket)
                self._grant(ticket, decision, now)

    def shares(self, queue: ClassQueue, prio: int) -> Shares:
        """The fair share of the slots in ``prio`` between the tenants holding slots in it or waiting in ``queue``."""
        waiting, caps = queue.waiting(), [(w.lease_cap(self.settings.max_inflight_per_worker), w.inflight)
                                          for w in self.registry.healthy()]
        held, recent, since = self.book.held(prio), self._recent[prio], self.clock.now() - ACTIVE_S
        for tenant in [t for t, (ended, _) in recent.items() if ended < since or t in held]:
            del recent[tenant]
        peaks = self._peaks[prio]
        for tenant, marks in list(peaks.items()):
            while marks and marks[0][0] < since:
                marks.popleft()
            if not marks:
                del peaks[tenant]
        return Shares(slots=sum(cap for cap, _ in caps), held=held,
                      weights={**{t: w for t, (_, w) in recent.items()}, **self.book.weights(prio), **waiting},
                      waiting=waiting.keys(), free=sum(max(cap - n, 0) for cap, n in caps), recent=recent.keys(),
                      peak={t: marks[0][1] for t, marks in peaks.items()})

    def _held_until_now(self, prio: int, tenant: str, slots: int) -> None:
        """Notes that ``tenant`` held ``slots`` slots of ``prio`` until now (at a grant: from now), for its peak; only
        where the class's slots are shared (:meth:`shares`, which forgets the old marks, is asked only there)."""
        if not self.queues.of[prio].shares:
            return
        marks = self._peaks[prio].setdefault(tenant, collections.deque())
        while marks and marks[-1][1] <= slots:
            marks.pop()
        marks.append((self.clock.now(), slots))

    def _head(self, queue: ClassQueue) -> Ticket | None:
        """The next request to grant: the head of the first tenant in turn not held back by its fair share (a tenant
        at or above its share while another waits below its own). None only for an empty queue: a tenant below its
        share is never held back."""
        first = queue.peek()
        if first is None or not queue.shares:
            return first
        shares = self.shares(queue, first.priority)
        return next((t for t in queue.heads() if t.done or not shares.blocked(t.request.tenant)), None)

    def _pop_head(self, queue: ClassQueue, ticket: Ticket) -> None:
        """Takes a head out of its queue (its tenant goes to the back of the turn)."""
        queue.pop_head(ticket)
        self.efficiency.left(ticket.priority, model=ticket.request.model)

    # ---- preemption ------------------------------------------------------------------------------------------

    def _make_room_for_waiting(self) -> None:
        """Takes back a lease of the tenant most over its share for the most urgent request of each tenant below its
        share still waiting after a dispatch pass, in a class with a queue-wait budget (see
        :mod:`~goodput_scheduler.fairshare`)."""
        now = self.clock.now()
        for queue in (q for q in self.queues if q.shares and len(q)):
            shares: Shares | None = None  # once per queue (this runs at every dispatch), again after a preemption
            for head in list(queue.heads()):
                if head.done or head.made_room or not (queue.timeout_s or head.queue_deadline is not None):
                    continue
                shares = shares or self.shares(queue, head.priority)
                if not shares.under(head.request.tenant):
                    continue
                for over in shares.over():
                    victim = self._victim(over, head)
                    if victim is not None:
                        head.made_room = True
                        self._preempt(victim, f"tenant {head.request.tenant} (below its share of "
                                              f"{priority_name(head.priority)}'s slots) waited "
                                              f"{now - head.enqueued_at:.2f} s; tenant {over} held {shares.held[over]} "
                                              f"slots, its share is {shares.share(over):.3g}")
                        shares = None
                        break

    def _victim(self, tenant: str, head: Ticket) -> Lease | None:
        """The lease of ``tenant`` to take back for ``head`` (its class and model): its latest without a first token
        (what it costs is one prefill), else its latest resumable one on a worker that continues answers (a
        re-prefill of its prompt and the answer so far, mostly from the prefix cache; the least answer to redo)."""
        model = head.request.model
        mine = [lease for lease in self.book.leases.values()
                if lease.request.tenant == tenant and lease.priority == head.priority and lease.revoke is not None
                and (not model or lease.request.model == model)]
        prefilling = [lease for lease in mine if lease.prefilling]
        return max(prefilling or [lease for lease in mine if lease.request.resumable and lease.worker.model is not None
                                  and lease.worker.model.continues],
                   key=lambda lease: lease.granted_at, default=None)

    def _preempt(self, lease: Lease, reason: str) -> None:
        """Takes a lease back: its slots are free at once, and its holder is told (the gateway stops the worker call
        and admits the request again, to start it or to continue its answer)."""
        if not self.book.close(lease):
            return
        log.info("lease preempted", extra={"lease": lease.request.request_id, "reason": reason})
        self.metrics.preemptions.labels(priority_name(lease.priority)).inc()
        self.metrics.releases.labels("preempted").inc()
        assert lease.revoke is not None
        lease.revoke(reason)
        self._dispatch_pass()

    def _unqueue(self, ticket: Ticket) -> None:
        """Takes the ticket out of its queue, wherever it is; a no-op once it left."""
        if ticket.queue is not None and ticket.queue.remove(ticket):
            self.efficiency.left(ticket.priority, model=ticket.request.model)

    def _grant(self, ticket: Ticket, decision: Decision, now: float) -> None:
        grant: Grant = self.book.hold(decision, ticket.request, ticket.priority)
        tenant = ticket.request.tenant
        self._held_until_now(ticket.priority, tenant, self.book.holding(ticket.priority, tenant))
        self.pipeline.commit(ticket.request, decision)
        label = priority_name(ticket.priority)
        self.metrics.admissions.labels(label).inc()
        self.metrics.queue_wait.labels(label).observe(now - ticket.enqueued_at)
        self.metrics.placements.labels(decision.worker.worker_id, decision.reason).inc()
        ticket.future.set_result(grant)

    def _fail(self, ticket: Ticket, reason: str, err: GoodputError) -> None:
        if ticket.done:
            return
        self.metrics.shed.labels(priority_name(ticket.priority), reason).inc()
        ticket.future.set_exception(err)

    def _drop_expired(self, ticket: Ticket) -> None:
        """Fails a ticket whose deadline passed, naming the bound that set it (the earliest of the three)."""
        if ticket.deadline == ticket.call_deadline:
            self._fail(ticket, "deadline", DeadlineExceeded(
                "the request's deadline passed while it waited for a worker"))
        elif ticket.deadline == ticket.queue_deadline and ticket.queue_deadline is not None:
            self._fail(ticket, "queue_budget", DeadlineExceeded(
                f"the request waited {ticket.queue_deadline - ticket.enqueued_at:g} s for a worker, its class's "
                "queue-wait budget"))
        else:
            limit = self.queues.of[ticket.priority].timeout_s
            self._fail(ticket, "timeout", DeadlineExceeded(
                f"the request waited longer than {priority_name(ticket.priority)}'s queue timeout ({limit:g} s)"))

    def _sweep(self) -> None:
        """Drops expired requests anywhere in the queues (not only at the heads), and fails requests that have
        waited ``no_worker_wait_s`` while no healthy worker exists."""
        now = self.clock.now()
        no_worker = not self.registry.healthy()
        for queue in self.queues:
            for ticket in list(queue):
                if ticket.done:
                    self._unqueue(ticket)
                elif ticket.deadline is not None and now >= ticket.deadline:
                    self._unqueue(ticket)
                    self._drop_expired(ticket)
                elif no_worker and now - ticket.enqueued_at >= self.settings.no_worker_wait_s:
                    self._unqueue(ticket)
                    self._fail(ticket, "no_worker", Unavailable(
                        "no healthy inference worker is available",
                        retry_after_s=self.settings.health_interval_s * 2))

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="scheduler-dispatch")

    async def _tick(self) -> None:
        """While anything waits: expire, re-dispatch (worker load changes), refresh the overload signal."""
        while self.queued():
            await self.clock.sleep(DISPATCH_INTERVAL_S)
            self._sweep()
            self.guard.maybe_adjust(self.clock.now())
            self._dispatch_pass()
            self._make_room_for_waiting()
            self._update_overload()
            self._notify()
        self._update_overload()
        self._notify()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for queue in self.queues:
            for ticket in list(queue):
                self._unqueue(ticket)
                if not ticket.done:
                    ticket.future.set_exception(Unavailable("the scheduler is shutting down", retry_after_s=1.0))
        self._notify()

    # ---- first token and release -----------------------------------------------------------------------------

    def first_token(self, lease: Lease, ttft_s: float) -> None:
        """The gateway saw the lease's first token: its prompt no longer counts as pending prefill on the worker
        (the prefill gate may now admit more there), and a P0 TTFT reaches the latency guard at once."""
        if not self.book.first_token(lease):
            return
        lease.first_token_at = self.clock.now()
        if lease.priority == P0:
            self.guard.observe(ttft_s)
        self._dispatch()

    def release(self, lease: Lease, outcome: int, *, ttft_s: float = 0.0, prompt_tokens: int = 0,
                completion_tokens: int = 0) -> None:
        """Frees the lease's slot. ``ttft_s`` (the gateway's measured time to first token) feeds the latency
        guard when the lease was P0 (unless :meth:`first_token` already did); with the tokens, a finished request
        teaches the service-time predictor."""
        ttft_reported = not lease.prefilling  # first_token() already gave the guard this P0's TTFT
        held = self.book.holding(lease.priority, lease.request.tenant)
        if not self.book.close(lease):
            return
        self._held_until_now(lease.priority, lease.request.tenant, held)
        if self.queues.of[lease.priority].shares:  # as for the peaks: forgotten only where the slots are shared
            self._recent[lease.priority][lease.request.tenant] = (self.clock.now(), lease.request.tenant_weight)
        if outcome == scheduler_pb2.OUTCOME_OK and completion_tokens:
            # Service time from the grant: the gateway's TTFT counts from arrival (queue, retrieval...), the first
            # token's report on this lease from the grant.
            prefill_s = (lease.first_token_at - lease.granted_at if lease.first_token_at is not None
                         else min(ttft_s, max(ttft_s - lease.queue_wait_s, 0.0)))
            duration_s = self.clock.now() - lease.granted_at
            self.predictor.observe(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                   ttft_s=prefill_s, duration_s=duration_s)
            # the batch it ran in: the mean of its worker's leases at its grant and at its end (itself included)
            batch = (lease.batch_at_grant + lease.worker.inflight + 1) / 2
            lease.worker.speed.observe(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                       ttft_s=prefill_s, duration_s=duration_s, batch=batch,
                                       pending_prefill=lease.pending_prefill)
        if lease.priority == P0 and outcome == scheduler_pb2.OUTCOME_OK and not ttft_reported:
            self.guard.observe(ttft_s)
        now = self.clock.now()
        self.guard.maybe_adjust(now)
        self.metrics.releases.labels(scheduler_pb2.Outcome.Name(outcome).removeprefix("OUTCOME_").lower()).inc()
        self.drain.add(now)
        if outcome == scheduler_pb2.OUTCOME_WORKER_FAILED:
            self.registry.report_failure(lease.worker.worker_id, "reported by the gateway")
        self._dispatch()
