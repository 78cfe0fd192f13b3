"""Fair share of the slots, with no configuration: each active tenant of a class (holding slots in it or waiting in
its queue) is entitled to ``slots * w_t / sum(w)`` of the fleet's slots, where ``slots`` is the lease cap of every
placeable worker summed and ``w`` the weights the tenants sent (``Admit.tenant_weight``). A request of ``n``
sequences holds ``n`` slots.

Two rules follow, applied by the :class:`~goodput_scheduler.leases.LeaseManager`:

* **No new slot over the share while another waits below its own** (:meth:`Shares.blocked`): the dispatcher skips a
  tenant at or above its share while a tenant below its share waits in the same queue, or while the free slots are
  no more than the headroom kept for the active tenants below their share (those holding slots in the class, or that
  held one in the last :data:`ACTIVE_S`), so their next requests find a slot at once instead of waiting for one to
  end: for each, up to its share, :data:`HEADROOM` slots or the slots it gave back since it last held the most in the
  last :data:`ACTIVE_S` (its peak), whichever is more. A slot a tenant below its share frees so stays its own while it
  is active: given to a tenant over its share, it would come back only when one of that tenant's answers ends or is
  paused (below), so a tenant whose load needs more than :data:`HEADROOM` slots would wait for a preemption at each
  request beyond them. A tenant alone
  takes every slot: nothing is held back for tenants that do not come.
* **Room is made at once for a tenant below its share**: when its most urgent request is still waiting after a
  dispatch pass (in a class with a queue-wait budget: P0 and P1 by default), a lease (for the same model) of the
  tenant most over its share is taken back: its youngest without a first token yet (it costs one prefill: the
  gateway stops its worker call and admits it again, so it is never lost and its caller never sees it), else its
  youngest that the gateway can resume (``Admit.resumable``) on a worker whose engine continues answers
  (``ModelInfo.continues``). That one is paused and resumed by recomputation, as vLLM resumes the requests it
  preempts itself: the gateway admits it again (always given a place in the queue, ``Admit.resumed``) and continues
  the answer on its new lease from the tokens already sent, which the new worker prefills after the prompt (mostly
  prefix-cache hits on the same worker); its caller's stream pauses, with nothing lost or repeated. vLLM cannot pause
  one chosen request in place (its own preemption happens only under KV-cache pressure), hence the round trip. One
  lease per waiting request, at once: what it costs the over-share tenant is a re-prefill (mostly prefix-cache hits),
  while a wait for a turnover would add to the TTFT of the tenant below its share (a wait of 1% of the budget left
  B's bursts 0.3 s behind A's streams in loadtests/reports/noisy_neighbour-tenants.md; 0.2% and at once could not be
  told apart there, within its run-to-run noise).

Quotas (the gateway's) stay the operator's hard limits on top of this.

Example: 8 slots, tenant ``a`` holds all of them and ``b`` (weight 1 as well) waits:

    >>> s = Shares(slots=8, held={"a": 8}, weights={"a": 1.0, "b": 1.0}, waiting={"a", "b"}, free=0)
    >>> s.share("a"), s.under("b"), s.blocked("a"), s.blocked("b")
    (4.0, True, True, False)
    >>> s.over()
    ['a']
    >>> Shares(slots=8, held={"a": 8}, weights={"a": 1.0}, waiting={"a"}, free=0).blocked("a")   # alone
    False

``b`` holds 1 slot and waits for nothing: ``a`` (at its share) does not take the last :data:`HEADROOM` free slots;
nor when ``b`` holds nothing but held a slot lately.

    >>> busy = {"held": {"a": 4, "b": 1}, "weights": {"a": 1.0, "b": 1.0}, "waiting": {"a"}}
    >>> Shares(slots=8, free=3, **busy).blocked("a"), Shares(slots=8, free=2, **busy).blocked("a")
    (False, True)
    >>> Shares(slots=8, free=2, held={"a": 6}, weights={"a": 1.0, "b": 1.0}, waiting={"a"}, recent={"b"}).blocked("a")
    True

``b`` held 3 slots lately and holds none now: the 3 it gave back stay free for it, not ``a``'s.

    >>> idle_b = {"held": {"a": 5}, "weights": {"a": 1.0, "b": 1.0}, "waiting": {"a"}, "recent": {"b"},
    ...           "peak": {"b": 3}}
    >>> Shares(slots=8, free=3, **idle_b).blocked("a"), Shares(slots=8, free=4, **idle_b).blocked("a")
    (True, False)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

__all__ = ["ACTIVE_S", "HEADROOM", "Shares"]

# Free slots kept at the least, per active tenant below its share, from tenants at or above theirs (more when it gave
# back more since its peak): a tenant's next requests usually come before a slot turns over, and two cover most Poisson
# gaps; what it costs is at most two idle slots per such tenant beyond those it held lately, and only while another
# tenant is over its share.
HEADROOM = 2
# A tenant whose last slot in a class ended this long ago is still active there (keeps its weight in the shares and its
# headroom): an interactive client's next request comes within seconds; an idle tenant's claim lapses after that.
ACTIVE_S = 10.0


@dataclass(frozen=True)
class Shares:
    """One class's slots shared out between its active tenants (see the module)."""

    slots: int  # the fleet's slots (placeable workers' lease caps summed)
    held: Mapping[str, int]  # slots each tenant holds in the class
    weights: Mapping[str, float]  # of every active tenant (holding or waiting): the latest weight it sent
    waiting: Set[str]  # tenants with requests in the class's queue
    free: int  # slots free now on the placeable workers
    recent: Set[str] = frozenset()  # tenants holding no slot in the class that held one in the last ACTIVE_S
    peak: Mapping[str, int] = field(default_factory=dict)  # most slots each tenant held at once in the last ACTIVE_S

    def share(self, tenant: str) -> float:
        total = sum(self.weights.values())
        return self.slots * self.weights.get(tenant, 1.0) / total if total > 0 else float(self.slots)

    def under(self, tenant: str) -> bool:
        return self.held.get(tenant, 0) < self.share(tenant)

    def blocked(self, tenant: str) -> bool:
        """At or above its share while another tenant waits below its own, or while the free slots are the headroom
        of the active tenants below their share: no new slot for it now."""
        if self.under(tenant):
            return False
        if any(u != tenant and self.under(u) for u in self.waiting):
            return True
        headroom = sum(min(max(HEADROOM, self.peak.get(u, 0) - self.held.get(u, 0)),
                           math.ceil(self.share(u) - self.held.get(u, 0)))
                       for u in {*self.held, *self.recent} if u != tenant and self.under(u))
        return 0 < headroom >= self.free

    def over(self) -> list[str]:
        """The tenants above their share, furthest above first."""
        excess = {t: n - self.share(t) for t, n in self.held.items() if n > self.share(t)}
        return sorted(excess, key=excess.__getitem__, reverse=True)
