"""Jobs in Redis: a hash per job, a set per state, attempts per outcome; and the retry policy of parked work.

Example (with a Redis at ``settings.redis_url``)::

    queue = JobQueue(settings, redis.Redis.from_url(settings.redis_url))
    job = queue.submit(tenant="acme", route="chat", body={"messages": [...]})
    queue.get(job.id, tenant="acme").state    # 'queued'

What ``GET /v1/jobs/{id}`` answers for a job, in OpenAI's shape:

    >>> public = Job(id="job-1", tenant="acme", route="chat", body={}, deadline_at=400.0).public()
    >>> public["object"], public["status"], public["endpoint"], public["expires_at"]
    ('job', 'queued', '/v1/chat/completions', 400)
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_core.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from goodput_core.metrics import SharedCounter, StoreReadings

__all__ = ["ENDPOINTS", "JOB_HEADER", "JOB_ID_KEY", "OUTCOMES", "RETRYABLE", "ROUTES", "SHED_CODES", "STATES",
           "TERMINAL", "Job", "JobQueue", "JobsMetrics", "celery_send", "retry_delay"]

STATES = ("queued", "running", "parked", "completed", "failed", "expired")
TERMINAL = ("completed", "failed", "expired")
OUTCOMES = ("completed", "parked", "failed")  # where an attempt (a "running" job) ends
JOB_HEADER = "X-Goodput-Job-Id"
JOB_ID_KEY = "x-goodput-job-id"  # gRPC trailing metadata of a shed request that was parked
# Worth retrying later: shed, scheduler or workers unreachable, expired in the queue.
RETRYABLE = (ResourceExhausted, Unavailable, DeadlineExceeded)
SHED_CODES = ("overloaded", "queue_full")


def retry_delay(attempt: int, retry_after_s: float | None, *, base_s: float = 1.0, cap_s: float = 60.0,
                rng: random.Random | None = None) -> float:
    """Seconds before re-submitting shed work: the scheduler's retry-after (from its drain rate) or an exponential
    backoff, whichever is longer, capped, with jitter so parked work does not return all at once.

    >>> 1.0 <= retry_delay(1, None, rng=random.Random(0)) <= 1.5
    True
    >>> 8.0 <= retry_delay(2, 8.0, rng=random.Random(0)) <= 12.0
    True
    """
    rng = rng or random.Random()
    backoff = min(cap_s, base_s * 2 ** max(attempt - 1, 0))
    return min(max(backoff, retry_after_s or 0.0), cap_s) * rng.uniform(1.0, 1.5)


@dataclass
class Job:
    id: str
    tenant: str
    route: str  # "chat" or "completions"
    body: dict[str, Any]
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    deadline_at: float = 0.0
    attempts: int = 0
    next_attempt_at: float = 0.0
    error: str = ""
    result: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        """The REST shape (an OpenAI-style object)."""
        out: dict[str, Any] = {"id": self.id, "object": "job", "status": self.state, "endpoint": ENDPOINTS[self.route],
                               "created_at": int(self.created_at), "updated_at": int(self.updated_at),
                               "expires_at": int(self.deadline_at), "attempts": self.attempts}
        if self.state == "parked":
            out["next_attempt_at"] = int(self.next_attempt_at)
        if self.error:
            out["last_error"] = self.error
        if self.result is not None:
            out["response"] = self.result
        return out


ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ROUTES = {v: k for k, v in ENDPOINTS.items()}


class JobsMetrics:
    """Transitions counted in this process; jobs by state and attempts by outcome read from Redis off the scrape
    path (``readings``: the gateway starts them on its event loop; a worker's metrics thread reads on a scrape,
    waiting ``scrape_wait_s`` at most), so that a scrape never waits on Redis."""

    def __init__(self, registry: CollectorRegistry | None, queue: JobQueue | None = None, *,
                 scrape_wait_s: float = 0.0) -> None:
        self.transitions = Counter("goodput_gateway_deferred_job_transitions_total",
                                   "Deferred jobs entering a state (in this process).", ["state"], registry=registry)
        self.readings: StoreReadings | None = None
        if registry is not None and queue is not None:
            self.readings = StoreReadings("gateway_jobs", registry, scrape_wait_s=scrape_wait_s)
            jobs = Gauge("goodput_gateway_deferred_jobs", "Deferred jobs by state (from Redis, all processes; "
                         "NaN until first read).", ["state"], registry=registry)
            for state in STATES:
                jobs.labels(state).set_function(_last_count(self.readings.add(state, _counter(queue, state))))
            attempts = self.readings.add("attempts", queue.attempts)
            registry.register(SharedCounter("goodput_gateway_deferred_job_attempts",
                                            "Attempts of deferred jobs by outcome (from Redis, all processes).",
                                            "outcome", read=attempts, known=OUTCOMES))


def _counter(queue: JobQueue, state: str) -> Callable[[], int]:
    return lambda: queue.count(state)


def _last_count(last: Callable[[], Any]) -> Callable[[], float]:
    def read() -> float:
        value = last()
        return float("nan") if value is None else float(value)
    return read


class JobQueue:
    """Jobs in Redis and their Celery task. ``send`` enqueues the task (defaults to this module's Celery app)."""

    def __init__(self, settings: Any, redis_client: Any, *, registry: CollectorRegistry | None = None,
                 send: Callable[[str, float], None] | None = None) -> None:
        self.settings = settings
        self.redis = redis_client
        self.prefix = settings.jobs_prefix
        self._send = send or celery_send(settings)
        self.metrics = JobsMetrics(registry, self)

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _state_key(self, state: str) -> str:
        return f"{self.prefix}:state:{state}"

    def count(self, state: str) -> int:
        return int(self.redis.scard(self._state_key(state)))

    def attempts(self) -> dict[str, int]:
        """Attempts ever ended per outcome (completed, parked, failed), over every worker."""
        raw = self.redis.hgetall(f"{self.prefix}:attempts")
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    def save(self, job: Job, *, previous: str | None = None) -> None:
        job.updated_at = time.time()
        ttl = int(max(job.deadline_at - time.time(), 0) + self.settings.job_result_ttl_s)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self._key(job.id), json.dumps(asdict(job)), ex=max(ttl, 60))
        if previous and previous != job.state:
            pipe.srem(self._state_key(previous), job.id)
        pipe.sadd(self._state_key(job.state), job.id)
        if previous == "running" and job.state in OUTCOMES:
            pipe.hincrby(f"{self.prefix}:attempts", job.state, 1)
        pipe.execute()
        if previous != job.state:
            self.metrics.transitions.labels(job.state).inc()

    def load(self, job_id: str) -> Job | None:
        raw = self.redis.get(self._key(job_id))
        if raw is None:
            return None
        return Job(**json.loads(raw))

    def get(self, job_id: str, *, tenant: str) -> Job:
        job = self.load(job_id)
        if job is None or job.tenant != tenant:
            raise NotFound(f"no job {job_id!r}", param="job_id", code="job_not_found")
        return job

    def submit(self, *, tenant: str, route: str, body: dict[str, Any], delay_s: float = 0.0,
               error: str = "", deadline_at: float | None = None) -> Job:
        """Stores a new job and schedules its first attempt in ``delay_s`` seconds; it expires at ``deadline_at``
        (default: ``job_deadline_s`` from now)."""
        if route not in ENDPOINTS:
            raise InvalidArgument(f"unknown route {route!r}", param="endpoint")
        now = time.time()
        body = {**body, "stream": False, "priority": "P2"}
        job = Job(id=f"job-{uuid.uuid4().hex}", tenant=tenant, route=route, body=body,
                  state="parked" if delay_s > 0 else "queued",
                  deadline_at=deadline_at if deadline_at is not None else now + self.settings.job_deadline_s,
                  next_attempt_at=now + delay_s, error=error)
        self.save(job)
        self._send(job.id, delay_s)
        return job

    def reschedule(self, job: Job, delay_s: float) -> None:
        self._send(job.id, delay_s)


def celery_send(settings: Any) -> Callable[[str, float], None]:
    def send(job_id: str, delay_s: float) -> None:
        from goodput_gateway.jobs.worker import celery_app  # lazy: only processes that park or run jobs need Celery

        app = celery_app(settings)
        app.send_task("goodput.jobs.run", args=[job_id], countdown=max(delay_s, 0.0), queue=settings.jobs_queue)
    return send
