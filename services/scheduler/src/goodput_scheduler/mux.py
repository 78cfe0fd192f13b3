"""Many leases over one stream (``Scheduler/LeaseBatches``): how the gateway leases workers. On one long-lived stream
a lease is two small messages (admit, granted) on a connection already open, not a stream set up and torn down per
request, and the messages that queued up behind a write go out together (``goodput_core.batching``).

Each message names its lease (``lease_id``). A lease goes through its steps (admitted into its class queue, granted,
first token, released) through the :class:`~goodput_scheduler.leases.LeaseManager`; a refusal or a drop is a
``LeaseError`` event for that lease alone (the error's status, code and retry-after). ``cancel`` withdraws a lease
(its caller went away). When the stream ends or breaks, every lease it still holds is released as ABANDONED and every
queued one leaves its queue: capacity is never leaked. The open leases per stream are bounded (``MUX__MAX_LEASES``).
A lease the manager preempts (:mod:`~goodput_scheduler.fairshare`) is a ``Preempted`` event: already released, the
gateway admits its request again.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from goodput.scheduler.v1 import scheduler_pb2
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from goodput_core.context import request_context
from goodput_core.errors import GoodputError, Internal, InvalidArgument

from goodput_scheduler.leasebook import Lease
from goodput_scheduler.leases import LeaseManager
from goodput_scheduler.placement import PlacementRequest
from goodput_scheduler.queues import Ticket

__all__ = ["LeaseMux", "error_event"]

log = logging.getLogger("goodput.scheduler.mux")
_tracer = trace.get_tracer("goodput.scheduler")
MAX_SEQUENCES = 128  # Admit.n: OpenAI's own limit on n

Event = scheduler_pb2.LeaseMuxEvent


def error_event(lease_id: str, err: GoodputError) -> Event:
    return Event(lease_id=lease_id, error=scheduler_pb2.LeaseError(
        status=err.grpc_code.name, message=err.message, code=err.code or "", param=err.param or "",
        retry_after_s=err.retry_after_s or 0.0))


@dataclass(eq=False)
class _Open:
    ticket: Ticket | None = None
    lease: Lease | None = None
    waiter: asyncio.Task[None] | None = None
    tenant: str = ""
    span: trace.Span | None = None  # the admission, in the request's trace (ended at the grant or the refusal)


class LeaseMux:
    """The leases of one ``LeaseBatches`` stream. :meth:`handle` takes each request message; events go to ``emit``;
    :meth:`close` (always called) gives back whatever the stream still holds."""

    def __init__(self, leases: LeaseManager, emit: Callable[[Event], None], *, max_leases: int,
                 parse_weight: Callable[[float], float]) -> None:
        self.leases = leases
        self.emit = emit
        self.max_leases = max_leases
        self._parse_weight = parse_weight
        self._open: dict[str, _Open] = {}

    def handle(self, msg: scheduler_pb2.LeaseMuxRequest) -> None:
        lease_id = msg.lease_id
        kind = msg.WhichOneof("kind")
        if not lease_id or len(lease_id) > 256:
            self.emit(error_event(lease_id[:256], InvalidArgument("every message names its lease (lease_id, 1 to "
                                                                  "256 characters)", param="lease_id")))
        elif kind == "admit":
            self._admit(lease_id, msg.admit, msg.timeout_s, msg.trace_context)
        elif kind == "attach":
            self._attach(lease_id, msg.attach)
        # the other kinds act on an open lease; one released already, or never admitted, is ignored (a late message
        # is harmless)
        elif (entry := self._open.get(lease_id)) is not None:
            with request_context(request_id=lease_id, tenant=entry.tenant or None):
                if kind == "first_token" and entry.lease is not None:
                    self.leases.first_token(entry.lease, msg.first_token.ttft_s)
                elif kind == "release":
                    r = msg.release
                    self._finish(lease_id, entry, r.outcome or scheduler_pb2.OUTCOME_OK, ttft_s=r.ttft_s,
                                 prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens)
                elif kind == "cancel":
                    self._finish(lease_id, entry, scheduler_pb2.OUTCOME_CANCELLED)

    def _admit(self, lease_id: str, a: scheduler_pb2.Admit, timeout_s: float, trace_context: Mapping[str, str]) -> None:
        if lease_id in self._open:
            self.emit(error_event(lease_id, InvalidArgument(f"lease {lease_id!r} is already open on this stream",
                                                            param="lease_id")))
            return
        if len(self._open) >= self.max_leases:
            self.emit(error_event(lease_id, InvalidArgument(
                f"this stream holds {len(self._open)} open leases, its limit; release some or open another stream",
                code="too_many_leases")))
            return
        with request_context(request_id=lease_id, tenant=a.tenant or None):
            try:
                if not (math.isfinite(timeout_s) and timeout_s >= 0):
                    raise InvalidArgument("timeout_s must be a finite number of seconds, 0 or more", param="timeout_s")
                now = self.leases.clock.now()
                req = self._request(lease_id, a)
                ticket = self.leases.enqueue(req, deadline=now + timeout_s if timeout_s > 0 else None,
                                             queue_deadline=now + a.max_queue_wait_s if a.max_queue_wait_s > 0
                                             else None)
            except GoodputError as err:
                self.emit(error_event(lease_id, err))
                return
            entry = _Open(ticket=ticket, tenant=a.tenant,
                          span=_tracer.start_span("goodput.scheduler.Lease",
                                                  context=propagate.extract(dict(trace_context)),
                                                  attributes={"goodput.lease_id": lease_id,
                                                              "goodput.priority": int(a.priority)}))
            self._open[lease_id] = entry
            if ticket.done and not ticket.future.cancelled() and ticket.future.exception() is None:
                self._granted(lease_id, entry, self.leases.claim(ticket))  # placed at once: granted without a task
                return
            if not ticket.done:
                self.emit(Event(lease_id=lease_id, queued=scheduler_pb2.Queued(position=self.leases.position(ticket))))
            entry.waiter = asyncio.get_running_loop().create_task(self._wait(lease_id, entry, ticket),
                                                                  name=f"lease-{lease_id}")

    def _request(self, lease_id: str, a: scheduler_pb2.Admit) -> PlacementRequest:
        if not 0 <= a.n <= MAX_SEQUENCES:
            raise InvalidArgument(f"n must be between 0 and {MAX_SEQUENCES} (0 = 1)", param="n")
        return PlacementRequest(request_id=lease_id, tenant=a.tenant, priority=int(a.priority), model=a.model,
                                prompt_tokens=a.prompt_tokens_estimate, max_tokens=a.max_tokens,
                                prefix_hint=a.prefix_hint, session_id=a.session_id, fixed_output=a.fixed_output,
                                tenant_weight=self._parse_weight(a.tenant_weight), slots=a.n or 1,
                                resumable=a.resumable, resumed=a.resumed)

    def _attach(self, lease_id: str, a: scheduler_pb2.Attach) -> None:
        """A lease the previous leader granted, brought here after a failover (see LeaseManager.attach)."""
        if lease_id in self._open or len(self._open) >= self.max_leases:
            self.emit(error_event(lease_id, InvalidArgument(f"lease {lease_id!r} cannot be attached here (already "
                                                            "open, or the stream is full)", param="lease_id")))
            return
        with request_context(request_id=lease_id, tenant=a.admit.tenant or None):
            try:
                lease = self.leases.attach(self._request(lease_id, a.admit), a.worker_id,
                                           prefilling=not a.first_token_seen)
            except GoodputError as err:
                self.emit(error_event(lease_id, err))
                return
        self._open[lease_id] = _Open(lease=lease, tenant=a.admit.tenant)
        lease.revoke = partial(self._preempted, lease_id)
        self.emit(Event(lease_id=lease_id, granted=self.leases.granted(lease)))

    async def _wait(self, lease_id: str, entry: _Open, ticket: Ticket) -> None:
        try:
            lease = await self.leases.wait(ticket)  # cancelled: wait() gives the place or the grant back itself
        except GoodputError as err:
            self._open.pop(lease_id, None)
            self.emit(error_event(lease_id, err))
            _end(entry, error=err.message)
            return
        except asyncio.CancelledError:
            _end(entry, error="cancelled")
            raise
        except Exception as exc:  # never leave the caller waiting on a lease that will not come
            log.exception("lease wait failed")
            self._open.pop(lease_id, None)
            self.emit(error_event(lease_id, Internal(f"the scheduler failed to place the request: {exc}")))
            return
        self._granted(lease_id, entry, lease)

    def _granted(self, lease_id: str, entry: _Open, lease: Lease) -> None:
        entry.lease = lease
        lease.revoke = partial(self._preempted, lease_id)
        if entry.span is not None:
            entry.span.set_attribute("goodput.worker", lease.worker.worker_id)
        _end(entry)
        self.emit(Event(lease_id=lease_id, granted=self.leases.granted(lease)))

    def _preempted(self, lease_id: str, reason: str) -> None:
        """The manager took the lease back (already released there): the gateway admits the request again."""
        if self._open.pop(lease_id, None) is not None:
            self.emit(Event(lease_id=lease_id, preempted=scheduler_pb2.Preempted(reason=reason)))

    def _finish(self, lease_id: str, entry: _Open, outcome: int, *, ttft_s: float = 0.0, prompt_tokens: int = 0,
                completion_tokens: int = 0, emit: bool = True) -> None:
        self._open.pop(lease_id, None)
        if entry.lease is not None:
            self.leases.release(entry.lease, outcome, ttft_s=ttft_s, prompt_tokens=prompt_tokens,
                                completion_tokens=completion_tokens)
        else:  # still queued (or its grant not yet taken): withdraw it
            if entry.waiter is not None:
                entry.waiter.cancel()
            if entry.ticket is not None:
                self.leases.abandon(entry.ticket)
        if emit:
            self.emit(Event(lease_id=lease_id, released=scheduler_pb2.Released()))

    def close(self) -> None:
        """The stream ended: everything it holds goes back (held leases as ABANDONED)."""
        if self._open:
            log.info("lease stream closed with leases open: released as abandoned", extra={"leases": len(self._open)})
        for lease_id, entry in list(self._open.items()):
            self._finish(lease_id, entry, scheduler_pb2.OUTCOME_ABANDONED, emit=False)


def _end(entry: _Open, *, error: str = "") -> None:
    if entry.span is None:
        return
    if error:
        entry.span.set_status(Status(StatusCode.ERROR, error))
    entry.span.end()
    entry.span = None
