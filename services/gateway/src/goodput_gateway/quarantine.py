"""Requests suspected of crashing their inference worker (poison): not tried on another worker nor parked as a job,
and refused for a while when they come again (:class:`Quarantine`).

A worker lost *before* it accepted a request (the connection refused, no ``started``) is plain unavailability: the
pipeline tries another worker (:mod:`goodput_gateway.pipeline`). A worker lost *after* accepting it (its call ended
UNAVAILABLE, UNKNOWN or INTERNAL: the process died or its engine failed with the request in flight) may have been
killed by the request: a prompt, schema or sampling that crashes the engine crashes every worker it reaches, and
again as a parked job later. One loss cannot be told from an operator's kill -9 or a lost node, so the gateway judges
by who else was there. The request is suspected when

* its worker held it alone: no other request of this replica on the worker when it was lost, and the scheduler's
  last count of the worker's leases no higher (``alone``);
* or the same request was in flight on a second worker lost within ``QUARANTINE__TTL_S`` (``again``): a crash that
  follows one request from worker to worker.

A worker lost with several requests in flight (a kill, a rollout, a lost node) suspects none of them the first time:
they go on on other workers as before (a resumable answer continues from the tokens sent, ``Delta.token_ids``).

A suspected request is counted (``goodput_gateway_poison_requests_total``), its fingerprint quarantined for
``QUARANTINE__TTL_S``, and it ends with :class:`Quarantined`; it is neither retried, continued nor parked. The same
request again (same tenant, model, prompt, tools and sampling: :meth:`GenerationRequest.fingerprint`) is refused with
the same error before a worker is leased. Only the fingerprint (a hash) is kept, never the content. The quarantine is
in-replica (each gateway replica and jobs worker has its own, bounded, forgotten on restart): a poison request costs
at most a worker or two per replica and TTL, which is what it bounds.

Example (a worker lost holding only this request):

    >>> from prometheus_client import CollectorRegistry
    >>> q = Quarantine(QuarantineSettings(), GatewayMetrics(CollectorRegistry()))
    >>> q.lost("f1", worker="w1", address="10.0.0.1:50061", here=1).code
    'request_quarantined'
    >>> q.check("f1")
    Traceback (most recent call last):
    goodput_gateway.quarantine.Quarantined: this request is quarantined for 600 s more: ...
    >>> q.lost("f2", worker="w2", address="10.0.0.2:50061", here=3) is None  # one of three: not suspected yet
    True
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from cachetools import TTLCache

from goodput_core.errors import FailedPrecondition

from goodput_gateway.config import QuarantineSettings
from goodput_gateway.metrics import GatewayMetrics

__all__ = ["INCIDENT_S", "Quarantine", "Quarantined"]

log = logging.getLogger("goodput.gateway.pipeline")
# The losses of one worker within this long are one incident: they are judged by the company the first one found (a
# worker's death ends all its calls within moments; the streams that go on elsewhere no longer count as its own).
INCIDENT_S = 5.0
# Workers lost with the same request (the first included) that make it suspected however busy they were.
_STRIKES = 2


class Quarantined(FailedPrecondition):
    """A request suspected of crashing its inference worker, or sent again while quarantined. 422 and
    FAILED_PRECONDITION, not a 5xx / UNAVAILABLE: the request is well formed and the fault is the server's, but
    sending it again as it is would only crash another worker, and clients (the OpenAI SDKs, gRPC retry policies)
    retry those on their own; ``Retry-After`` says when the quarantine ends."""


class Quarantine:
    """The fingerprints of suspected requests (refused until their time is up) and of requests lost with a worker
    (the workers they were lost with), each at most ``max_entries``, and the recent incidents by worker address."""

    def __init__(self, settings: QuarantineSettings, metrics: GatewayMetrics, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = settings.ttl_s
        self.metrics = metrics
        self._clock = clock
        ttl = self.ttl_s or 1.0  # off (0): nothing is ever put in them
        self._until: TTLCache[str, float] = TTLCache(maxsize=settings.max_entries, ttl=ttl, timer=clock)
        self._lost_with: TTLCache[str, frozenset[str]] = TTLCache(maxsize=settings.max_entries, ttl=ttl, timer=clock)
        self._incidents: TTLCache[str, int] = TTLCache(maxsize=1024, ttl=INCIDENT_S, timer=clock)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def check(self, fingerprint: str) -> None:
        """Raises :class:`Quarantined` for a request under quarantine (counted as ``refused``)."""
        until = self._until.get(fingerprint) if fingerprint else None
        if until is not None:
            self.metrics.poison_requests.labels("refused").inc()
            raise _refused(until - self._clock())

    def lost(self, fingerprint: str, *, worker: str, address: str, here: int, listed: int = 0) -> Quarantined | None:
        """The worker ``worker`` at ``address`` was lost with the request in flight after accepting it; ``here``: this
        replica's requests on it (this one included), ``listed``: the scheduler's last count of its leases. The error
        to end the request with when it is suspected (now quarantined); None when another worker may go on with it."""
        if not self.enabled or not fingerprint:
            return None
        company = self._incidents.get(address)
        if company is None:
            company = self._incidents[address] = max(here, listed)
        workers = self._lost_with.get(fingerprint, frozenset()) | {worker}
        self._lost_with[fingerprint] = workers
        if company > 1 and len(workers) < _STRIKES:
            return None
        event = "crashed_alone" if company <= 1 else "crashed_again"
        self.metrics.poison_requests.labels(event).inc()
        self._until[fingerprint] = self._clock() + self.ttl_s
        log.warning("a request is suspected of crashing its inference worker: not retried, quarantined",
                    extra={"worker": worker, "fingerprint": fingerprint, "event": event, "workers": len(workers)})
        return Quarantined(f"the inference worker serving this request failed while it held it"
                           f"{' alone' if company <= 1 else ', as another worker did before'}: the request may be "
                           f"what failed it, so it is not retried, and the same request is refused for "
                           f"{self.ttl_s:g} s", code="request_quarantined", retry_after_s=self.ttl_s)


def _refused(left_s: float) -> Quarantined:
    left_s = max(left_s, 0.0)
    return Quarantined(f"this request is quarantined for {math.ceil(left_s)} s more: an inference worker failed while "
                       "serving it, and it may be what failed the worker; change it, or report it to the platform's "
                       "operators", code="request_quarantined", retry_after_s=left_s)
