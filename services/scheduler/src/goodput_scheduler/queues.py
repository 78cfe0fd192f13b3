"""The class queues: where admitted requests wait for a worker.

Each class (P0, P1, P2) has one :class:`ClassQueue`; inside it every tenant has a heap ordered by deadline (earliest
first), and tenants take turns, so one tenant's burst cannot starve another. :class:`ClassQueues` holds the queues of
one policy (``priority``: the three classes; ``fifo``: one arrival-order queue) with each class's depth and timeout.

A bounded class's depth is shared out between the tenants waiting in it, in proportion to their weights (the latest
weight each sent): tenant t's share is ``max_queue * w_t / sum(w)`` over the tenants queued there, the arriving one
counted. When the queue is full, :meth:`ClassQueue.when_full` says what gives way: the arrival itself when its tenant
already holds its share, else the newest request of the tenant most over its own share. A tenant alone may use the
whole queue. The fifo policy has no shares.

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
    ...     q, loop, seen = ClassQueue(), asyncio.get_running_loop(), []
    ...     def ticket(i: int, tenant: str) -> Ticket:
    ...         req = PlacementRequest(request_id=f"{tenant}-{i}", tenant=tenant, priority=P0, model="",
    ...                                prompt_tokens=1, max_tokens=1)
    ...         return Ticket(request=req, priority=P0, deadline=None, call_deadline=None, enqueued_at=0.0, seq=i,
    ...                       future=loop.create_future())
    ...     for i, tenant in enumerate(["big", "big", "big", "small"]):
    ...         q.push(ticket(i, tenant))
    ...     for i in (4, 5):
    ...         verdict = q.when_full(ticket(i, "small").request, max_queue=4)
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodput.common.v1 import types_pb2

if TYPE_CHECKING:
    from goodput_scheduler.config import SchedulerSettings
    from goodput_scheduler.leasebook import Grant
    from goodput_scheduler.placement import PlacementRequest

__all__ = ["CLASSES", "FIFO", "P0", "P1", "P2", "ClassQueue", "ClassQueues", "ShareFull", "Ticket"]

P0, P1, P2 = int(types_pb2.PRIORITY_P0), int(types_pb2.PRIORITY_P1), int(types_pb2.PRIORITY_P2)
CLASSES = (P0, P1, P2)
FIFO = 0  # the one queue of the fifo policy


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

    def sort_key(self, fifo: bool) -> tuple[float, int]:
        if fifo:
            return (0.0, self.seq)
        return (self.deadline if self.deadline is not None else math.inf, self.seq)

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass(frozen=True)
class ShareFull:
    """A full queue's answer to an arrival: whose share is full, and what gives way."""

    tenant: str  # the arriving tenant (refused), or the tenant most over its share (it gives up a place)
    held: int  # places that tenant holds in the queue now
    share: float  # its weighted share of the queue's places
    gives_way: Ticket | None  # that tenant's newest queued request, pushed out for the arrival; None: refuse it


class ClassQueue:
    """One class's queue: a heap per tenant (earliest deadline first), tenants served in turn, and the weight of
    each tenant waiting (for the shares of a bounded depth).

    >>> q = ClassQueue()
    >>> len(q), q.tenants
    (0, 0)
    """

    def __init__(self, *, fifo: bool = False) -> None:
        self.fifo = fifo
        self._tenants: collections.OrderedDict[str, list[tuple[tuple[float, int], Ticket]]] = \
            collections.OrderedDict()
        self._weights: dict[str, float] = {}  # of the tenants queued here: the latest weight each sent
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
        self._weights[tenant] = t.request.tenant_weight
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
        else:
            del self._weights[tenant]
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
                    del self._weights[tenant]
                self._size -= 1
                t.queue = None
                return True
        return False

    def position(self, t: Ticket) -> int:
        """Requests ahead in this queue (an estimate across tenants: those with an earlier key)."""
        key = t.sort_key(self.fifo)
        return sum(1 for other in self if other is not t and other.sort_key(self.fifo) < key)

    @property
    def tenants(self) -> int:
        """Tenants with requests waiting here."""
        return len(self._tenants)

    def when_full(self, request: PlacementRequest, max_queue: int) -> ShareFull | None:
        """The queue holds ``max_queue`` requests and ``request`` arrives: what gives way, by the tenants' weighted
        shares of the places (the arriving tenant counted with the weight it sends now, which is kept). None when
        there are no shares to weigh (the fifo policy, or the arriving tenant is the only one waiting here): the
        queue is simply full."""
        tenant = request.tenant
        if self.fifo or not self._tenants.keys() - {tenant}:
            return None
        if tenant in self._weights:
            self._weights[tenant] = request.tenant_weight  # the latest weight a tenant sent wins
        weights = {**self._weights, tenant: request.tenant_weight}
        total = sum(weights.values())

        def held(name: str) -> int:
            return len(self._tenants.get(name, ()))

        def share(name: str) -> float:
            return max_queue * weights[name] / total

        if held(tenant) >= share(tenant):
            return ShareFull(tenant=tenant, held=held(tenant), share=share(tenant), gives_way=None)
        # The arrival is under its share, so the others hold more than theirs together: one is over its own.
        over = max(self._tenants, key=lambda name: (held(name) - share(name), self._newest(name).seq))
        return ShareFull(tenant=over, held=held(over), share=share(over), gives_way=self._newest(over))

    def _newest(self, tenant: str) -> Ticket:
        return max((t for _, t in self._tenants[tenant]), key=lambda t: t.seq)


class ClassQueues:
    """The queues of one policy, most urgent first, with each class's depth and queue timeout from settings."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.fifo = settings.queue_policy == "fifo"
        self._queues: dict[int, ClassQueue] = (
            {FIFO: ClassQueue(fifo=True)} if self.fifo else {p: ClassQueue() for p in CLASSES})

    def __iter__(self) -> Iterator[ClassQueue]:
        """Most urgent first: the order the dispatcher serves them in."""
        return iter(self._queues.values())

    def of(self, prio: int) -> ClassQueue:
        return self._queues[FIFO if self.fifo else prio]

    def queued(self, prio: int | None = None) -> int:
        if prio is None:
            return sum(len(q) for q in self._queues.values())
        if self.fifo:
            return sum(1 for t in self._queues[FIFO] if t.priority == prio)
        return len(self._queues[prio])

    def tenants(self, prio: int) -> int:
        """Tenants with requests of this class waiting (a bounded class's depth is shared out between them)."""
        if self.fifo:
            return len({t.request.tenant for t in self._queues[FIFO] if t.priority == prio})
        return self._queues[prio].tenants

    def limits(self, prio: int) -> tuple[int, float]:
        """(most requests that may wait, longest wait in seconds); 0 = unbounded / none."""
        s = self.settings
        if self.fifo:
            return s.fifo_max_queue, 0.0
        return {P0: (s.p0_max_queue, s.p0_timeout_s), P1: (s.p1_max_queue, s.p1_timeout_s),
                P2: (s.p2_max_queue, s.p2_timeout_s)}[prio]

    def ahead(self, prio: int) -> int:
        """Queued requests that would be granted before a new one of this class."""
        if self.fifo:
            return self.queued()
        return sum(len(self._queues[p]) for p in CLASSES if p <= prio)

    def position(self, ticket: Ticket) -> int:
        """Requests ahead of a queued ticket (0 once it left the queue)."""
        if ticket.queue is None:
            return 0
        ahead = ticket.queue.position(ticket)
        if not self.fifo:
            ahead += sum(len(self._queues[p]) for p in CLASSES if p < ticket.priority)
        return ahead
