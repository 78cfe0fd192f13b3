"""The class queues: where admitted requests wait for a worker.

Each class (P0, P1, P2) has one :class:`ClassQueue`; inside it every tenant has a heap ordered by deadline (earliest
first), and tenants take turns, so one tenant's burst cannot starve another. :class:`ClassQueues` holds the queues of
one policy (``priority``: the three classes; ``fifo``: one arrival-order queue) with each class's depth and timeout.

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

__all__ = ["CLASSES", "FIFO", "P0", "P1", "P2", "ClassQueue", "ClassQueues", "Ticket"]

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
