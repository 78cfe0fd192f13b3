"""The class queues: where admitted requests wait for a worker, laid out by a queue policy.

Each class (P0, P1, P2) has one :class:`ClassQueue`; inside it every tenant has a heap ordered by deadline (earliest
first), and tenants take turns, so one tenant's burst cannot starve another. :class:`ClassQueues` holds the queues a
:class:`QueuePolicy` lays out (``priority``: the three classes; ``fifo``: one arrival-order queue, a baseline).

A bounded class's depth is shared out between the tenants waiting in it, in proportion to their weights (the latest
weight each sent): tenant t's share is ``max_queue * w_t / sum(w)`` over the tenants queued there, the arriving one
counted. When the queue is full, :meth:`ClassQueue.when_full` says what gives way: the arrival itself when its tenant
already holds its share, else the newest request of the tenant most over its own share. A tenant alone may use the
whole queue.

Example:
    >>> import asyncio
    >>> from goodput_scheduler.placement import PlacementRequest
    >>> async def order() -> list[str]:
    ...     q = ClassQueue()
    ...     loop = asyncio.get_running_loop()
    ...     for i, (tenant, deadline) in enumerate([("big", 9.0), ("big", 5.0), ("small", 7.0)]):
    ...         req = PlacementRequest(request_id=f"{tenant}-{deadline:g}", tenant=tenant, priority=P1, model="",
    ...                                prompt_tokens=1, max_tokens=1)
    ...         q.push(Ticket(request=req, priority=P1, deadline=deadline, call_deadline=None, enqueued_at=0.0,
    ...                       seq=i, future=loop.create_future()))
    ...     return [q.pop_head().request.request_id for _ in range(len(q))]
    >>> asyncio.run(order())          # tenants alternate; inside a tenant, the earliest deadline first
    ['big-5', 'small-7', 'big-9']

A full queue of 4 places, three held by ``big``: ``small`` (share 2) pushes out ``big``'s newest; at its share it is
refused.

    >>> async def full() -> list[str]:
    ...     q, loop, seen = ClassQueue(max_queue=4), asyncio.get_running_loop(), []
    ...     def ticket(i: int, tenant: str) -> Ticket:
    ...         req = PlacementRequest(request_id=f"{tenant}-{i}", tenant=tenant, priority=P0, model="",
    ...                                prompt_tokens=1, max_tokens=1)
    ...         return Ticket(request=req, priority=P0, deadline=None, call_deadline=None, enqueued_at=0.0, seq=i,
    ...                       future=loop.create_future())
    ...     for i, tenant in enumerate(["big", "big", "big", "small"]):
    ...         q.push(ticket(i, tenant))
    ...     for i in (4, 5):
    ...         verdict = q.when_full(ticket(i, "small").request)
    ...         seen.append(f"{verdict.tenant} holds {verdict.held} of share {verdict.share:g}: "
    ...                     f"{verdict.gives_way.request.request_id if verdict.gives_way else 'refused'}")
    ...         if verdict.gives_way is not None:
    ...             q.remove(verdict.gives_way)
    ...             q.push(ticket(i, "small"))
    ...     return seen
    >>> for line in asyncio.run(full()):
    ...     print(line)
    big holds 3 of share 2: big-2
    small holds 2 of share 2: refused
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodput.common.v1 import types_pb2

if TYPE_CHECKING:
    from goodput_scheduler.config import SchedulerSettings
    from goodput_scheduler.leasebook import Grant
    from goodput_scheduler.placement import PlacementRequest

__all__ = ["CLASSES", "P0", "P1", "P2", "QUEUE_POLICIES", "ClassQueue", "ClassQueues", "QueuePolicy", "ShareFull",
           "Ticket"]

P0, P1, P2 = int(types_pb2.PRIORITY_P0), int(types_pb2.PRIORITY_P1), int(types_pb2.PRIORITY_P2)
CLASSES = (P0, P1, P2)


@dataclass(eq=False)
class Ticket:
    """A request's place in its class queue until it is granted, dropped or cancelled."""

    request: PlacementRequest
    priority: int
    deadline: float | None  # the earlier of the call's deadline and the class's queue timeout
    call_deadline: float | None
    enqueued_at: float
    seq: int
    future: asyncio.Future[Grant]
    queue: ClassQueue | None = None
    claimed: bool = False  # the grant became a Lease (or was undone)
    queue_deadline: float | None = None  # the end of its queue-wait budget (Admit.max_queue_wait_s)
    made_room: bool = False  # a lease was preempted to make room for it (one per waiting request)

    @property
    def done(self) -> bool:
        return self.future.done()


def by_deadline(t: Ticket) -> tuple[float, int]:
    """Earliest deadline first; an answer being resumed (its caller mid-stream, its slot taken a moment ago) before
    any."""
    return (-math.inf if t.request.resumed else t.deadline if t.deadline is not None else math.inf, t.seq)


@dataclass(frozen=True)
class ShareFull:
    """A full queue's answer to an arrival: whose share is full, and what gives way."""

    tenant: str  # the arriving tenant (refused), or the tenant most over its share (it gives up a place)
    held: int  # places that tenant holds in the queue now
    share: float  # its weighted share of the queue's places
    gives_way: Ticket | None  # that tenant's newest queued request, pushed out for the arrival; None: refuse it


class ClassQueue:
    """One class's queue: a heap per tenant (earliest deadline first), tenants served in turn, and the weight of
    each tenant waiting (for the shares of a bounded depth); at most ``max_queue`` requests (0: unbounded), each for
    at most ``timeout_s`` (0: no timeout). Without ``shares``, one heap holds every tenant's requests, in ``order``.

    >>> q = ClassQueue("P1", max_queue=100, timeout_s=60.0)
    >>> len(q), q.name, q.max_queue
    (0, 'P1', 100)
    """

    def __init__(self, name: str = "", *, max_queue: int = 0, timeout_s: float = 0.0,
                 order: Callable[[Ticket], tuple[float, int]] = by_deadline, shares: bool = True) -> None:
        self.name, self.max_queue, self.timeout_s, self.order, self.shares = name, max_queue, timeout_s, order, shares
        self._tenants: collections.OrderedDict[str, list[tuple[tuple[float, int], Ticket]]] = collections.OrderedDict()
        self._weights: dict[str, float] = {}  # of the tenants queued here: the latest weight each sent
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Ticket]:
        for heap in self._tenants.values():
            for _, t in heap:
                yield t

    def push(self, t: Ticket) -> None:
        tenant = self._tenant(t.request)
        heapq.heappush(self._tenants.setdefault(tenant, []), (self.order(t), t))
        self._weights[tenant] = t.request.tenant_weight
        t.queue = self
        self._size += 1

    def peek(self) -> Ticket | None:
        for heap in self._tenants.values():
            return heap[0][1]
        return None

    def heads(self) -> Iterator[Ticket]:
        """Each tenant's most urgent request, in the tenants' turn order (the first is :meth:`peek`)."""
        for heap in self._tenants.values():
            yield heap[0][1]

    def waiting(self) -> dict[str, float]:
        """The tenants waiting here, with the latest weight each sent."""
        return dict(self._weights)

    def pop_head(self, t: Ticket | None = None) -> Ticket:
        """Takes out the head of the tenant whose turn it is, or ``t``, one of :meth:`heads`: its tenant goes to the
        back of the turn."""
        tenant = self._tenant(t.request) if t is not None else next(iter(self._tenants))
        heap = self._tenants.pop(tenant)
        _, t = heapq.heappop(heap)
        if heap:
            self._tenants[tenant] = heap  # to the back: the next tenant goes first next time
        else:
            del self._weights[tenant]
        self._size -= 1
        t.queue = None
        return t

    def remove(self, t: Ticket) -> bool:
        tenant = self._tenant(t.request)
        heap = self._tenants.get(tenant)
        if heap is None:
            return False
        for i, (_, other) in enumerate(heap):
            if other is t:
                heap.pop(i)
                heapq.heapify(heap)
                if not heap:
                    del self._tenants[tenant]
                    del self._weights[tenant]
                self._size -= 1
                t.queue = None
                return True
        return False

    def position(self, t: Ticket) -> int:
        """Requests ahead in this queue (an estimate across tenants: those with an earlier key)."""
        key = self.order(t)
        return sum(1 for other in self if other is not t and self.order(other) < key)

    def _tenant(self, request: PlacementRequest) -> str:
        return request.tenant if self.shares else ""

    def when_full(self, request: PlacementRequest) -> ShareFull | None:
        """The queue holds ``max_queue`` requests and ``request`` arrives: what gives way, by the tenants' weighted
        shares of the places (the arriving tenant counted with the weight it sends now, which is kept). None when
        there are no shares to weigh (a queue without shares, or the arriving tenant is the only one waiting here):
        the queue is simply full."""
        tenant = self._tenant(request)
        if not self._tenants.keys() - {tenant}:
            return None
        if tenant in self._weights:
            self._weights[tenant] = request.tenant_weight  # the latest weight a tenant sent wins
        weights = {**self._weights, tenant: request.tenant_weight}
        total = sum(weights.values())

        def held(name: str) -> int:
            return len(self._tenants.get(name, ()))

        def share(name: str) -> float:
            return self.max_queue * weights[name] / total

        if held(tenant) >= share(tenant):
            return ShareFull(tenant=tenant, held=held(tenant), share=share(tenant), gives_way=None)
        # The arrival is under its share, so the others hold more than theirs together: one is over its own.
        over = max(self._tenants, key=lambda name: (held(name) - share(name), self._newest(name).seq))
        return ShareFull(tenant=over, held=held(over), share=share(over), gives_way=self._newest(over))

    def _newest(self, tenant: str) -> Ticket:
        return max((t for _, t in self._tenants[tenant]), key=lambda t: t.seq)


@dataclass(frozen=True)
class QueuePolicy:
    """What differs between queue policies (``queue_policy`` names one of :data:`QUEUE_POLICIES`): the queues, most
    urgent first, each class's (classes may share one) with its bounds, order and shares; what else keeps them apart.

    >>> from goodput_scheduler.config import SchedulerSettings
    >>> [(q.name, q.max_queue) for q in ClassQueues(QUEUE_POLICIES["fifo"], SchedulerSettings())]
    [('scheduler', 200)]
    """

    queues: Callable[[SchedulerSettings], dict[int, ClassQueue]]
    sheds_classes: bool  # overload sheds P2, then P1 (P0 is refused only when its own queue is full)
    gates_classes: bool  # the profile's prefill_gate holds batch prompts back for P0's


QUEUE_POLICIES: Mapping[str, QueuePolicy] = {
    # strict priority between the classes, each with its depth and timeout; tenant shares and deadlines inside one
    "priority": QueuePolicy(lambda s: {P0: ClassQueue("P0", max_queue=s.p0_max_queue, timeout_s=s.p0_timeout_s),
                                       P1: ClassQueue("P1", max_queue=s.p1_max_queue, timeout_s=s.p1_timeout_s),
                                       P2: ClassQueue("P2", max_queue=s.p2_max_queue, timeout_s=s.p2_timeout_s)},
                            sheds_classes=True, gates_classes=True),
    # the overload benchmark's baseline: one arrival-order queue for every class, no tenant shares, nothing shed
    "fifo": QueuePolicy(lambda s: dict.fromkeys(CLASSES, ClassQueue("scheduler", max_queue=s.fifo_max_queue,
                                                                   order=lambda t: (0.0, t.seq), shares=False)),
                        sheds_classes=False, gates_classes=False),
}


class ClassQueues:
    """The queues a policy lays out, most urgent first (several classes may share one)."""

    def __init__(self, policy: QueuePolicy, settings: SchedulerSettings) -> None:
        self.of: Mapping[int, ClassQueue] = policy.queues(settings)  # the queue each class joins
        self._all = list(dict.fromkeys(self.of.values()))  # each queue once

    def __iter__(self) -> Iterator[ClassQueue]:
        """Most urgent first: the order the dispatcher serves them in."""
        return iter(self._all)

    def queued(self, prio: int | None = None) -> int:
        if prio is None:
            return sum(len(q) for q in self)
        return sum(1 for t in self.of[prio] if t.priority == prio)

    def tenants(self, prio: int) -> int:
        """Tenants with requests of this class waiting (a bounded class's depth is shared out between them)."""
        return len({t.request.tenant for t in self.of[prio] if t.priority == prio})

    def ahead(self, prio: int) -> int:
        """Queued requests that would be granted before a new one of this class."""
        return sum(len(q) for q in self._all[:self._all.index(self.of[prio]) + 1])

    def position(self, ticket: Ticket) -> int:
        """Requests ahead of a queued ticket (0 once it left the queue)."""
        if ticket.queue is None:
            return 0
        return ticket.queue.position(ticket) + sum(len(q) for q in self._all[:self._all.index(ticket.queue)])
