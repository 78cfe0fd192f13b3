"""Parking: a P2 request the scheduler shed for load becomes a job, from the request as the gateway parsed it.

Both APIs park through :meth:`goodput_gateway.service.GatewayService.generate`, which raises :class:`Parked` in place
of the shed error: REST answers it with its 429, ``Retry-After``, an ``X-Goodput-Job-Id`` header and ``job_id`` in
the error body; gRPC with RESOURCE_EXHAUSTED, ``retry-after`` and ``x-goodput-job-id`` trailing metadata.

Example (in the service, with the jobs' Redis behind ``queue``)::

    raise await park(queue, shed_error, tenant="acme", request=request, principal=caller)   # or shed_error

The error a parked request answers with is the shed one, naming the job:

    >>> shed = ResourceExhausted("scheduler queue is full", code="queue_full", retry_after_s=2.0)
    >>> parked = Parked(shed, "job-1f2e")
    >>> parked.openai_body()["error"]["job_id"], parked.retry_after_s
    ('job-1f2e', 2.0)
    >>> parked.extra_metadata[-1]
    ('x-goodput-job-id', 'job-1f2e')
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from goodput.common.v1 import types_pb2

from goodput_core.errors import GoodputError, ResourceExhausted

from goodput_gateway.auth import Principal
from goodput_gateway.generation_schemas import to_body
from goodput_gateway.jobs.records import JOB_ID_KEY, SHED_CODES, retry_delay
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.requests import GenerationRequest

log = logging.getLogger("goodput.gateway.jobs")

__all__ = ["Parked", "park"]


class Parked(ResourceExhausted):
    """A shed request that was parked as job ``job_id``: the same 429 / RESOURCE_EXHAUSTED, naming the job."""

    def __init__(self, shed: GoodputError, job_id: str) -> None:
        super().__init__(shed.message, param=shed.param, code=shed.code, retry_after_s=shed.retry_after_s)
        self.job_id = job_id
        self.extra_metadata = (*shed.extra_metadata, (JOB_ID_KEY, job_id))

    def openai_body(self) -> dict[str, Any]:
        body = super().openai_body()
        body["error"]["job_id"] = self.job_id
        return body


async def park(queue: JobQueue | None, err: ResourceExhausted, *, tenant: str,
               request: GenerationRequest, principal: Principal) -> ResourceExhausted:
    """Parks ``request`` (the caller's, parsed, its priority resolved) when it is batch (P2) work the scheduler shed
    for load (queue full or overloaded) and jobs are configured; returns the error to raise: :class:`Parked`
    naming the job, else ``err``. Best effort: the caller gets its honest 429 either way. The job runs under the
    limits of the caller's (``principal``) key and its tenant's, waits its turn with the tenant's weight and counts
    against the tenant's jobs quota."""
    if queue is None or err.code not in SHED_CODES or request.priority != types_pb2.PRIORITY_P2:
        return err
    route, body = to_body(request)
    delay = retry_delay(1, err.retry_after_s, base_s=queue.settings.jobs.retry_base_s,
                        cap_s=queue.settings.jobs.retry_cap_s)
    try:
        job = await asyncio.to_thread(queue.submit, tenant=tenant, route=route, body=body, delay_s=delay,
                                      error=f"ResourceExhausted: {err.message}",
                                      key=principal.key_id, weight=principal.weight, quota=principal.storage)
    except ResourceExhausted as full:  # the tenant's jobs quota (goodput_gateway.storage): not parked
        log.warning("a shed P2 request was not parked", extra={"tenant": tenant, "why": full.message})
        return err
    except Exception:  # noqa: BLE001
        log.exception("could not park a shed P2 request")
        return err
    return Parked(err, job.id)
