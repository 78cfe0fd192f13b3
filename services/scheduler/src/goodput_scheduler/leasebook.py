"""Lease bookkeeping: what the scheduler's own grants hold on each worker, and the leases the gateways hold.

A worker's counters (slots held, of which P1/P2, P0 prompts being prefilled, prompt tokens pending prefill) have
one owner, :class:`Occupancy`, and change only through a :class:`Hold`: one grant's share of one worker. A request
with ``n`` sequences holds ``n`` slots. The :class:`LeaseBook` also counts the slots each tenant holds per class
(:meth:`LeaseBook.held`), what the fair share of the slots is measured against. A hold is
taken when a request is granted, its prefill ends at the first token, and it is freed on release — or when the
caller went away before taking its grant. Each step happens at most once, so every path (first token, release,
abandon, a broken stream) may call it and no slot or prefill token is ever counted twice or leaked.

Example:
    >>> from goodput_scheduler.queues import P2
    >>> occ = Occupancy()
    >>> hold = occ.hold(P2, prompt_tokens=800)
    >>> occ.inflight, occ.low_inflight, occ.low_prefill_tokens
    (1, 1, 800)
    >>> hold.end_prefill(), hold.end_prefill()       # the first token; a second report changes nothing
    (True, False)
    >>> occ.low_prefill_tokens
    0
    >>> hold.free(), occ.inflight                    # release
    (True, 0)
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodput_scheduler.queues import P0, P1

if TYPE_CHECKING:
    from goodput_scheduler.placement import Decision, PlacementRequest
    from goodput_scheduler.registry import Worker

__all__ = ["Grant", "Hold", "Lease", "LeaseBook", "Occupancy"]


@dataclass(slots=True, eq=False)
class Occupancy:
    """What the scheduler's grants hold on one worker, read by placement (capacity, the prefill gate, load
    scores). The scheduler counts these itself, so they are never stale; only :class:`Hold` changes them."""

    inflight: int = 0  # slots held by leases (granted and not yet released; a lease of n sequences holds n)
    low_inflight: int = 0  # of which P1/P2 (bounded by the latency guard)
    p0_prefilling: int = 0  # P0 leases without a first token yet (their prompts are being prefilled)
    p0_prefill_tokens: int = 0  # estimated prompt tokens of those P0 leases
    low_prefill_tokens: int = 0  # estimated prompt tokens of P1/P2 leases without a first token (the prefill gate)

    def hold(self, priority: int, *, prompt_tokens: int, slots: int = 1) -> Hold:
        """Takes ``slots`` slots for a request granted here; its prompt counts as pending prefill until
        :meth:`Hold.end_prefill` or :meth:`Hold.free`."""
        return Hold(self, priority, prompt_tokens, slots)


class Hold:
    """One grant's share of one worker's :class:`Occupancy`: a slot, and its prompt's pending prefill."""

    __slots__ = ("_occ", "priority", "prompt_tokens", "slots", "_prefilling", "_held")

    def __init__(self, occ: Occupancy, priority: int, prompt_tokens: int, slots: int = 1) -> None:
        self._occ = occ
        self.priority = priority
        self.prompt_tokens = max(int(prompt_tokens), 1)  # a prompt is at least one token
        self.slots = max(int(slots), 1)
        self._prefilling = True
        self._held = True
        occ.inflight += self.slots
        if priority == P0:
            occ.p0_prefilling += 1
            occ.p0_prefill_tokens += self.prompt_tokens
        else:
            occ.low_inflight += self.slots
            occ.low_prefill_tokens += self.prompt_tokens

    @property
    def prefilling(self) -> bool:
        """No first token yet (and not freed)."""
        return self._prefilling

    def end_prefill(self) -> bool:
        """The prompt is prefilled (first token). Returns whether this call ended it."""
        if not self._prefilling:
            return False
        self._prefilling = False
        occ = self._occ
        if self.priority == P0:
            occ.p0_prefilling -= 1
            occ.p0_prefill_tokens -= self.prompt_tokens
        else:
            occ.low_prefill_tokens -= self.prompt_tokens
        return True

    def free(self) -> bool:
        """Gives the slot back (ending the prefill if no first token came). Returns whether this call freed it."""
        if not self._held:
            return False
        self.end_prefill()
        self._held = False
        self._occ.inflight -= self.slots
        if self.priority != P0:
            self._occ.low_inflight -= self.slots
        return True


@dataclass(frozen=True)
class Grant:
    """What a queued ticket receives: the placement decision and the hold taken on its worker."""

    decision: Decision
    hold: Hold
    batch: int = 1  # leases its worker held with it, this one included (what the speed estimate learns against)
    pending_prefill: int = 0  # prompt tokens granted there before it and still being prefilled

    @property
    def worker(self) -> Worker:
        return self.decision.worker


@dataclass(eq=False)
class Lease:
    """A grant the caller took: it holds its worker's slot until :meth:`LeaseBook.close`."""

    request: PlacementRequest
    worker: Worker
    reason: str
    queue_wait_s: float
    granted_at: float
    hold: Hold
    priority: int = P1
    first_token_at: float | None = None  # when the gateway reported the first token (the scheduler's clock)
    batch_at_grant: int = 1  # leases its worker held once it was granted, itself included
    pending_prefill: int = 0  # prompt tokens ahead of it in its worker's prefill when it was granted
    revoke: Callable[[str], None] | None = None  # tells its holder it was preempted (and why); None: cannot be

    @property
    def prefilling(self) -> bool:
        """No first token reported yet."""
        return self.hold.prefilling


class LeaseBook:
    """The leases held now, by request id, every change to a worker's occupancy, and the slots each tenant holds
    per class. ``on_change(worker)`` runs after each change (the scheduler mirrors ``inflight`` into its per-worker
    gauge).

    >>> from goodput_scheduler.placement import Decision, PlacementRequest
    >>> from goodput_scheduler.registry import Worker
    >>> book, w = LeaseBook(on_change=lambda w: None), Worker(worker_id="w", address="w", channel=None)
    >>> grant = book.hold(Decision(worker=w, reason="", score=0.0), PlacementRequest("r", "a", P1, "", 5, 5, slots=3),
    ...                   P1)
    >>> w.inflight, book.held(P1)
    (3, {'a': 3})
    >>> book.undo(grant), w.inflight, book.held(P1)
    (True, 0, {})
    """

    def __init__(self, *, on_change: Callable[[Worker], None]) -> None:
        self.leases: dict[str, Lease] = {}
        self._changed = on_change
        self._tenants: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._owner: dict[Hold, tuple[int, str]] = {}  # each hold not yet freed: its class and tenant
        self._weights: dict[int, dict[str, float]] = collections.defaultdict(dict)  # of tenants holding slots

    def held(self, priority: int) -> dict[str, int]:
        """Slots each tenant holds in a class (granted, not yet freed), tenants holding none left out."""
        return dict(self._tenants[priority])

    def holding(self, priority: int, tenant: str) -> int:
        """Slots ``tenant`` holds in a class."""
        return self._tenants[priority][tenant]

    def weights(self, priority: int) -> dict[str, float]:
        """The latest fair-share weight of each tenant holding slots in a class."""
        return dict(self._weights[priority])

    def hold(self, decision: Decision, request: PlacementRequest, priority: int) -> Grant:
        """A request was placed: its slots and prompt prefill count on the worker (and its tenant) from now on."""
        w = decision.worker
        pending = w.p0_prefill_tokens + w.low_prefill_tokens
        hold = w.occupancy.hold(priority, prompt_tokens=request.prompt_tokens, slots=request.slots)
        self._tenants[priority][request.tenant] += hold.slots
        self._owner[hold] = (priority, request.tenant)
        self._weights[priority][request.tenant] = request.tenant_weight
        self._changed(w)
        return Grant(decision=decision, hold=hold, batch=w.inflight, pending_prefill=pending)

    def _free(self, hold: Hold) -> bool:
        if not hold.free():
            return False
        priority, tenant = self._owner.pop(hold)
        tenants = self._tenants[priority]
        tenants[tenant] -= hold.slots
        if tenants[tenant] <= 0:
            del tenants[tenant]
            del self._weights[priority][tenant]
        return True

    def undo(self, grant: Grant) -> bool:
        """Nobody took the grant (the caller went away meanwhile): give its slots back."""
        if not self._free(grant.hold):
            return False
        self._changed(grant.decision.worker)
        return True

    def open(self, request: PlacementRequest, grant: Grant, *, priority: int, queue_wait_s: float,
             now: float) -> Lease:
        """The caller took its grant: a lease it must release."""
        decision = grant.decision
        lease = Lease(request=request, worker=decision.worker, reason=decision.reason, queue_wait_s=queue_wait_s,
                      granted_at=now, hold=grant.hold, priority=priority, batch_at_grant=grant.batch,
                      pending_prefill=grant.pending_prefill)
        self.leases[request.request_id] = lease
        return lease

    def first_token(self, lease: Lease) -> bool:
        """The lease's prompt is prefilled. Returns whether this was news (not released, not reported before)."""
        return lease.hold.end_prefill()  # freeing a hold ends its prefill: a released lease is never news

    def close(self, lease: Lease) -> bool:
        """The lease is released. Returns whether it was still held."""
        if not self._free(lease.hold):
            return False
        self.leases.pop(lease.request.request_id, None)
        self._changed(lease.worker)
        return True
