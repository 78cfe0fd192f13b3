"""The jobs worker: ``celery -A goodput_gateway.jobs worker -Q goodput-jobs`` runs each job through the gateway's
own composition root (:func:`goodput_gateway.__main__.compose`, built once per worker process on one event loop
that lives as long as the process) at P2, as the tenant that submitted it.

Shed again, or the scheduler unreachable (restarting), a job is re-parked with :func:`retry_delay` until it
completes or its deadline passes.

Example (in a worker process, with the scheduler and the jobs' Redis up)::

    runner = JobRunner(settings)
    run_job(queue, "job-1f2e...", runner=runner)     # one attempt: completed, parked again or failed
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry

from goodput_core.errors import GoodputError

from goodput_gateway.jobs.store import RETRYABLE, TERMINAL, Job, JobQueue, JobsMetrics, celery_send, retry_delay

if TYPE_CHECKING:
    from goodput_gateway.__main__ import Wiring

__all__ = ["JobRunner", "celery_app", "run_job", "serve_metrics"]

log = logging.getLogger("goodput.gateway.jobs")


class JobRunner:
    """Runs one job at a time through the gateway's composition root, built on first use. Its event loop stays
    open between jobs, so the channels to the scheduler, workers, cache and retriever are reused."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self._loop = asyncio.Runner()
        self._wiring: Wiring | None = None

    def __call__(self, job: Job) -> dict[str, Any]:
        return self._loop.run(self._execute(job))

    async def _execute(self, job: Job) -> dict[str, Any]:
        from goodput_gateway.rest import completion_body
        from goodput_gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
        from goodput_gateway.service import Call

        if self._wiring is None:
            from goodput_gateway.__main__ import compose

            self._wiring = compose(self.settings, CollectorRegistry(), None)
        p2 = types_pb2.PRIORITY_P2
        schema = ChatCompletionRequest if job.route == "chat" else CompletionRequest

        async def parse_body() -> Any:
            return parse(schema, job.body).to_request()

        # The job runs as its tenant, under the tenant's limits and budget (not around them).
        principal = self._wiring.service.keys.tenant_principal(job.tenant, priority=p2)
        call = Call(parse=parse_body, principal=principal, request_id=f"req-{job.id.removeprefix('job-')}")
        try:
            async with await self._wiring.service.open(call) as generation:
                text, end = await generation.collect()
        finally:
            await self._wiring.settle()  # the lease's release is sent before this job's attempt ends
        return completion_body(generation.opened, text, end, route=job.route,
                               response_id=job.id.removeprefix("job-"), logprobs=generation.logprobs,
                               answers=generation.answers, prompt_logprobs=generation.prompt_logprobs)

    def close(self) -> None:
        if self._wiring is not None:
            self._loop.run(self._wiring.close())
        self._loop.close()


def run_job(queue: JobQueue, job_id: str, *, runner: Callable[[Job], dict[str, Any]],
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
        job.result = runner(job)
    except RETRYABLE as err:
        if err.code == "insufficient_quota":  # the tenant's monthly budget is spent: no retry helps this month
            job.state, job.error = "failed", f"{type(err).__name__}: {err.message}"
            queue.save(job, previous="running")
            return job
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
    runners: list[JobRunner] = []  # one per process that runs tasks (a prefork child), made on its first task

    @app.task(name="goodput.jobs.run", ignore_result=True)
    def run(job_id: str) -> str:
        if not runners:
            runners.append(JobRunner(settings))
        queue = JobQueue(settings, client, send=celery_send(settings))
        job = run_job(queue, job_id, runner=runners[0])
        return job.state if job else "missing"

    @signals.worker_ready.connect(weak=False)
    def _metrics(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is app:  # signals are process-wide; only this app's worker serves
            serve_metrics(settings, client)

    @signals.worker_process_shutdown.connect(weak=False)
    def _close(**_: Any) -> None:
        while runners:
            runners.pop().close()


def serve_metrics(settings: Any, redis_client: Any) -> tuple[Any, Any] | None:
    """Starts a worker's metrics server on ``jobs_worker_http_port`` (0 = none) at ``grpc_host``: jobs by state and
    attempts by outcome (from Redis). Returns the server and its thread; called on Celery's ``worker_ready``."""
    if not settings.jobs_worker_http_port:
        return None
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    # Its own thread serves the scrape: it reads Redis then, but waits half a second at most (then the last values).
    JobsMetrics(registry, JobQueue(settings, redis_client, send=celery_send(settings)), scrape_wait_s=0.5)
    server, thread = start_http_server(settings.jobs_worker_http_port, addr=settings.grpc_host, registry=registry)
    log.info("jobs worker metrics", extra={"addr": settings.grpc_host, "port": settings.jobs_worker_http_port})
    return server, thread
