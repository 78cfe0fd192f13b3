"""Deferred batch work: shed P2 requests are parked durably and finished later, with results fetchable by id.

* **Park.** A P2 request the scheduler sheds (RESOURCE_EXHAUSTED, queue full or overloaded) is stored as a job in
  Redis and the caller gets its 429 with ``Retry-After`` plus an ``X-Goodput-Job-Id`` header (and ``job_id`` in the
  error body). ``POST /v1/jobs`` submits batch work directly the same way.
* **Retry.** A Celery task (``celery -A goodput_gateway.worker worker -Q goodput-jobs``, Redis broker) runs the job
  through the gateway's own pipeline (lease -> worker -> release) at P2, under the limits of the key that submitted
  it and its tenant's. Shed again, or the scheduler unreachable (restarting), it is re-parked with
  :func:`retry_delay` until it completes or its deadline passes. Jobs waiting to run are taken in weighted fair
  order across tenants, not first-in first-out (:mod:`.store`): one tenant's long batch does not hold up
  another's few lines.
* **Fetch.** ``GET /v1/jobs/{id}`` (the caller's tenant only) returns the job and, once completed, the same
  OpenAI-shaped body the synchronous call would have returned.

State lives in Redis (a key per job, a sorted set per state), never in a scheduler or gateway process, so a job
survives restarts of either. Each job runs effectively once, though its message may come twice or be lost and its
worker may die (:mod:`.store` tells how: claims, leases and a sweeper in the jobs workers).

A worker serves ``/metrics`` (any other path answers the same, so it doubles as the probes' ``/healthz``) on
``jobs_worker_http_port`` once it is ready: jobs by state, attempts, messages and recoveries, all read from Redis,
so they cover every worker process (the prefork children run the tasks, the parent serves the metrics and sweeps).

The package: :mod:`.records` (a job, its states, the retry policy), :mod:`.store` (jobs in Redis), :mod:`.messages`
(the Celery client), :mod:`.metrics`, :mod:`.parking` (a shed request becomes a job), :mod:`.batches` (OpenAI's Files
and Batch APIs); their REST routes are :mod:`goodput_gateway.api.jobs` and :mod:`goodput_gateway.api.batches`.
"""

from __future__ import annotations

from goodput_gateway.jobs.metrics import JobsMetrics
from goodput_gateway.jobs.parking import Parked, park
from goodput_gateway.jobs.records import JOB_HEADER, JOB_ID_KEY, STATES, Job, retry_delay
from goodput_gateway.jobs.store import JobQueue

__all__ = ["JOB_HEADER", "JOB_ID_KEY", "STATES", "Job", "JobQueue", "JobsMetrics", "Parked", "park", "retry_delay"]

