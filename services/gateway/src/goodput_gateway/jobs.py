"""Deferred batch work: shed P2 requests are parked durably and finished later, with results fetchable by id.

* **Park.** A P2 request the scheduler sheds (RESOURCE_EXHAUSTED, queue full or overloaded) is stored as a job in
  Redis and the caller gets its 429 with ``Retry-After`` plus an ``X-Goodput-Job-Id`` header (and ``job_id`` in the
  error body). ``POST /v1/jobs`` submits batch work directly the same way.
* **Retry.** A Celery task (``celery -A goodput_gateway.jobs worker -Q goodput-jobs``, Redis broker) runs the job
  through the gateway's own pipeline (lease -> worker -> release) at P2. Shed again, or the scheduler unreachable
  (restarting), it is re-parked with :func:`retry_delay` — the scheduler's retry-after (from its drain rate) or an
  exponential backoff, whichever is longer, with jitter — until it completes or its deadline passes.
* **Fetch.** ``GET /v1/jobs/{id}`` (the caller's tenant only) returns the job and, once completed, the same
  OpenAI-shaped body the synchronous call would have returned.

State lives in Redis (a hash per job, a set per state), never in a scheduler or gateway process, so a job survives
restarts of either; the Celery message is acknowledged late, so it survives a worker crash as well.

A worker serves ``/metrics`` (any other path answers the same, so it doubles as the probes' ``/healthz``) on
``jobs_worker_http_port`` once it is ready: jobs by state and attempts by outcome, both read from Redis, so they
cover every worker process (the prefork children run the tasks, the parent serves the metrics).

Example:
    >>> queue = JobQueue(settings, redis.Redis.from_url(settings.redis_url))
    >>> job = queue.submit(tenant="acme", route="chat", body={"messages": [...]})
    >>> queue.get(job.id, tenant="acme").state
    'queued'
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from goodput_core.errors import (
    DeadlineExceeded,
    GoodputError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from goodput_core.metrics import SharedCounter

log = logging.getLogger("goodput.gateway.jobs")

__all__ = ["JOB_ID_KEY", "Job", "JobQueue", "JobsMetrics", "STATES", "install_routes", "park_shed", "retry_delay",
           "run_job", "serve_metrics"]

STATES = ("queued", "running", "parked", "completed", "failed", "expired")
TERMINAL = ("completed", "failed", "expired")
OUTCOMES = ("completed", "parked", "failed")  # where an attempt (a "running" job) ends
JOB_HEADER = "X-Goodput-Job-Id"
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
        out: dict[str, Any] = {"id": self.id, "object": "job", "status": self.state, "endpoint": _ENDPOINTS[self.route],
                               "created_at": int(self.created_at), "updated_at": int(self.updated_at),
                               "expires_at": int(self.deadline_at), "attempts": self.attempts}
        if self.state == "parked":
            out["next_attempt_at"] = int(self.next_attempt_at)
        if self.error:
            out["last_error"] = self.error
        if self.result is not None:
            out["response"] = self.result
        return out


_ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_ROUTES = {v: k for k, v in _ENDPOINTS.items()}


class JobsMetrics:
    def __init__(self, registry: CollectorRegistry | None, queue: JobQueue | None = None) -> None:
        self.transitions = Counter("goodput_gateway_deferred_job_transitions_total",
                                   "Deferred jobs entering a state (in this process).", ["state"], registry=registry)
        if registry is not None and queue is not None:
            jobs = Gauge("goodput_gateway_deferred_jobs", "Deferred jobs by state (from Redis, all processes).",
                         ["state"], registry=registry)
            for state in STATES:
                jobs.labels(state).set_function(_state_reader(queue, state))
            registry.register(SharedCounter("goodput_gateway_deferred_job_attempts",
                                            "Attempts of deferred jobs by outcome (from Redis, all processes).",
                                            "outcome", read=queue.attempts, known=OUTCOMES))


def _state_reader(queue: JobQueue, state: str) -> Callable[[], float]:
    def read() -> float:
        try:
            return float(queue.count(state))
        except Exception:  # noqa: BLE001 - a scrape must not fail because Redis blinked
            return float("nan")
    return read


class JobQueue:
    """Jobs in Redis and their Celery task. ``send`` enqueues the task (defaults to this module's Celery app)."""

    def __init__(self, settings: Any, redis_client: Any, *, registry: CollectorRegistry | None = None,
                 send: Callable[[str, float], None] | None = None) -> None:
        self.settings = settings
        self.redis = redis_client
        self.prefix = settings.jobs_prefix
        self._send = send or _celery_send(settings)
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
               error: str = "") -> Job:
        """Stores a new job and schedules its first attempt in ``delay_s`` seconds."""
        if route not in _ENDPOINTS:
            raise InvalidArgument(f"unknown route {route!r}", param="endpoint")
        now = time.time()
        body = {**body, "stream": False, "priority": "P2"}
        job = Job(id=f"job-{uuid.uuid4().hex}", tenant=tenant, route=route, body=body,
                  state="parked" if delay_s > 0 else "queued", deadline_at=now + self.settings.job_deadline_s,
                  next_attempt_at=now + delay_s, error=error)
        self.save(job)
        self._send(job.id, delay_s)
        return job

    def reschedule(self, job: Job, delay_s: float) -> None:
        self._send(job.id, delay_s)


def _celery_send(settings: Any) -> Callable[[str, float], None]:
    def send(job_id: str, delay_s: float) -> None:
        app = celery_app(settings)
        app.send_task("goodput.jobs.run", args=[job_id], countdown=max(delay_s, 0.0), queue=settings.jobs_queue)
    return send


# ---- execution (in the Celery worker) --------------------------------------------------------------------------


async def execute(settings: Any, job: Job) -> dict[str, Any]:
    """Runs the job once through the gateway's own pipeline at P2; returns the OpenAI-shaped response body."""
    from goodput.scheduler.v1 import scheduler_pb2_grpc

    from goodput_core.clients import make_channel

    from goodput_gateway.auth import ApiKeyStore, Principal
    from goodput_gateway.knowledge import Knowledge
    from goodput_gateway.pipeline import GatewayMetrics, Pipeline
    from goodput_gateway.rag import knowledge_base_from
    from goodput_gateway.requests import from_openai_chat, from_openai_completion
    from goodput_gateway.service import GatewayService

    p2 = 3  # goodput.common.v1.PRIORITY_P2
    channel = make_channel(settings.scheduler_addr, None)
    metrics = GatewayMetrics(CollectorRegistry())
    pipeline = Pipeline(settings, scheduler=scheduler_pb2_grpc.SchedulerStub(channel),
                        channel_factory=lambda addr: make_channel(addr, None), metrics=metrics)
    knowledge = Knowledge(settings, channel_factory=lambda addr: make_channel(addr, None))
    service = GatewayService(settings, keys=ApiKeyStore([]), pipeline=pipeline, metrics=metrics,
                             knowledge=knowledge)
    try:
        parse = from_openai_chat if job.route == "chat" else from_openai_completion
        gen = parse(job.body)
        principal = Principal(tenant=job.tenant, max_priority=p2, default_priority=p2)
        stream = await service.begin(principal, gen, request_id=f"req-{job.id.removeprefix('job-')}",
                                     knowledge_base=knowledge_base_from(job.body, None))
        text, end = await stream.collect()
        model = stream.start.model if stream.start else gen.model
        usage = {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
                 "total_tokens": end.prompt_tokens + end.completion_tokens}
        if job.route == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": end.finish_reason, "logprobs": None}
            obj, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "finish_reason": end.finish_reason, "logprobs": None}
            obj, prefix = "text_completion", "cmpl"
        return {"id": f"{prefix}-{job.id.removeprefix('job-')}", "object": obj, "created": int(time.time()),
                "model": model, "choices": [choice], "usage": usage}
    finally:
        await pipeline.close()
        await knowledge.close()
        await channel.close(grace=None)


def run_job(queue: JobQueue, job_id: str, *,
            runner: Callable[[Any, Job], Coroutine[Any, Any, dict[str, Any]]] = execute,
            rng: random.Random | None = None) -> Job | None:
    """One attempt of a job (the Celery task's body): completed, re-parked with a delay, or failed for good."""
    job = queue.load(job_id)
    if job is None or job.state in TERMINAL:
        return job
    now = time.time()
    if now >= job.deadline_at:
        previous, job.state, job.error = job.state, "expired", job.error or "the job's deadline passed"
        queue.save(job, previous=previous)
        return job
    previous, job.state = job.state, "running"
    job.attempts += 1
    queue.save(job, previous=previous)
    try:
        job.result = asyncio.run(runner(queue.settings, job))
    except RETRYABLE as err:
        delay = retry_delay(job.attempts, err.retry_after_s, base_s=queue.settings.job_retry_base_s,
                            cap_s=queue.settings.job_retry_cap_s, rng=rng)
        job.state, job.error, job.next_attempt_at = "parked", f"{type(err).__name__}: {err.message}", now + delay
        queue.save(job, previous="running")
        log.info("job parked", extra={"job": job.id, "delay_s": round(delay, 2), "error": job.error})
        queue.reschedule(job, delay)
        return job
    except GoodputError as err:
        job.state, job.error = "failed", f"{type(err).__name__}: {err.message}"
        queue.save(job, previous="running")
        return job
    job.state, job.error = "completed", ""
    queue.save(job, previous="running")
    return job


# ---- Celery ----------------------------------------------------------------------------------------------------

_apps: dict[tuple[str, str], Any] = {}


def celery_app(settings: Any) -> Any:
    """The Celery app for these settings (Redis broker; one per broker URL and queue in a process)."""
    key = (settings.redis_url, settings.jobs_queue)
    app = _apps.get(key)
    if app is None:
        from celery import Celery  # lazy: only processes that park or run jobs need Celery

        app = Celery("goodput_gateway.jobs", broker=settings.redis_url)
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                        task_default_queue=settings.jobs_queue, broker_connection_retry_on_startup=True,
                        # An ETA task waits in its worker; on a crash Redis redelivers it after this timeout.
                        broker_transport_options={"visibility_timeout": 3600})
        _register(app, settings)
        _apps[key] = app
    return app


def _register(app: Any, settings: Any) -> None:
    import redis
    from celery import signals

    client = redis.Redis.from_url(settings.redis_url)

    @app.task(name="goodput.jobs.run", ignore_result=True)
    def run(job_id: str) -> str:
        queue = JobQueue(settings, client, send=_celery_send(settings))
        job = run_job(queue, job_id)
        return job.state if job else "missing"

    @signals.worker_ready.connect(weak=False)
    def _metrics(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is app:  # signals are process-wide; only this app's worker serves
            serve_metrics(settings, client)


def serve_metrics(settings: Any, redis_client: Any) -> tuple[Any, Any] | None:
    """Starts a worker's metrics server on ``jobs_worker_http_port`` (0 = none) at ``grpc_host``: jobs by state and
    attempts by outcome (from Redis). Returns the server and its thread; called on Celery's ``worker_ready``."""
    if not settings.jobs_worker_http_port:
        return None
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    JobsMetrics(registry, JobQueue(settings, redis_client, send=_celery_send(settings)))
    server, thread = start_http_server(settings.jobs_worker_http_port, addr=settings.grpc_host, registry=registry)
    log.info("jobs worker metrics", extra={"addr": settings.grpc_host, "port": settings.jobs_worker_http_port})
    return server, thread


def _worker_app() -> Any:
    """`celery -A goodput_gateway.jobs worker -Q goodput-jobs` finds ``app`` here (settings from the environment)."""
    from goodput_gateway.config import GatewaySettings

    return celery_app(GatewaySettings())


def __getattr__(name: str) -> Any:  # lazy module attribute: importing this module builds no Celery app
    if name in ("app", "celery"):
        return _worker_app()
    raise AttributeError(name)


# ---- REST --------------------------------------------------------------------------------------------------------


def install_routes(app: Any, service: Any, read_json: Callable[[Any], Awaitable[Any]], queue: JobQueue) -> None:
    """Adds ``POST /v1/jobs`` and ``GET /v1/jobs/{id}`` to the gateway's REST app."""

    @app.post("/v1/jobs")
    async def create_job(request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("body"), dict):
            raise InvalidArgument("expected {'endpoint': '/v1/chat/completions', 'body': {...}}", param="body")
        route = _ROUTES.get(str(body.get("endpoint", "/v1/chat/completions")))
        if route is None:
            raise InvalidArgument(f"endpoint must be one of {', '.join(_ROUTES)}", param="endpoint")
        from goodput_gateway.requests import from_openai_chat, from_openai_completion

        (from_openai_chat if route == "chat" else from_openai_completion)(body["body"])  # validate now, not later
        job = await asyncio.to_thread(queue.submit, tenant=principal.tenant, route=route, body=body["body"])
        return JSONResponse(job.public(), status_code=202, headers={JOB_HEADER: job.id})

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        job = await asyncio.to_thread(queue.get, job_id, tenant=principal.tenant)
        return JSONResponse(job.public())


JOB_ID_KEY = "x-goodput-job-id"  # gRPC trailing metadata of a shed request that was parked


def _shed(err: GoodputError, route: str) -> bool:
    """The scheduler refused the request for load (queue full or overloaded), on a route jobs can replay."""
    return isinstance(err, ResourceExhausted) and err.code in SHED_CODES and route in _ENDPOINTS


async def park_shed(queue: JobQueue, err: GoodputError, *, principal: Any, gen: Any, route: str,
                    body: dict[str, Any]) -> Job | None:
    """Parks a request the scheduler shed as a job, when it is batch (P2) work; None otherwise. Both APIs use it:
    REST passes the caller's body, gRPC the request rewritten as one (``requests.to_openai_body``)."""
    if not _shed(err, route):
        return None
    if principal.resolve_priority(gen.priority) != 3:  # only batch (P2) work is parked
        return None
    delay = retry_delay(1, err.retry_after_s, base_s=queue.settings.job_retry_base_s,
                        cap_s=queue.settings.job_retry_cap_s)
    return await asyncio.to_thread(queue.submit, tenant=principal.tenant, route=route, body=body, delay_s=delay,
                                   error=f"ResourceExhausted: {err.message}")


async def park_if_shed(queue: JobQueue, service: Any, err: GoodputError, request: Any, route: str,
                       error_response: Callable[..., Any], request_id: str) -> Any:
    """The REST error response for ``err``; when it is a P2 request shed by the scheduler, the request is parked
    as a job first and the response names it (``X-Goodput-Job-Id``, ``error.job_id``)."""
    response = error_response(err, request_id)
    if not _shed(err, route):  # not worth reading and parsing the body again
        return response
    try:
        from goodput_gateway.requests import from_openai_chat, from_openai_completion

        principal = service.authenticate(request.headers.get("authorization"))
        body = json.loads(await request.body())
        parse = from_openai_chat if route == "chat" else from_openai_completion
        gen = parse(body, header_priority=request.headers.get("x-goodput-priority"))
        job = await park_shed(queue, err, principal=principal, gen=gen, route=route, body=body)
    except Exception:  # noqa: BLE001 - parking is best effort: the caller still gets its honest 429
        log.exception("could not park a shed P2 request")
        return response
    if job is None:
        return response
    payload = err.openai_body()
    payload["error"]["job_id"] = job.id
    return JSONResponse(payload, status_code=response.status_code,
                        headers={**{k: v for k, v in response.headers.items() if k.lower() != "content-length"},
                                 JOB_HEADER: job.id})
