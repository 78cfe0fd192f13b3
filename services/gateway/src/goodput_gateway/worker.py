"""The jobs worker, the gateway's second entry point beside :mod:`goodput_gateway.__main__`:
``celery -A goodput_gateway.worker worker -Q goodput-jobs`` runs each job through the gateway's
own composition root (:func:`goodput_gateway.__main__.compose`, built once per worker process on one event loop
that lives as long as the process) at P2, as the API key that submitted it (its limits and its tenant's).

A message is a turn: it runs the next queued job in fair order across tenants (:mod:`goodput_gateway.jobs.store`).
An attempt starts only by claiming the job (:meth:`JobQueue.claim`); the claim's lease is renewed while
the attempt runs (:class:`Heartbeat`) and the outcome is written only under that claim (:mod:`goodput_gateway.jobs`
tells the whole policy). The worker's main process also runs the :class:`Sweeper`.

Example (in a worker process, with the scheduler and the jobs' Redis up)::

    runner = JobRunner(settings)
    run_job(queue, "job-1f2e...", runner=runner, dispatch=1)   # one attempt: completed, parked again or failed
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry

from goodput_core.errors import GoodputError

from goodput_gateway.__main__ import Wiring, compose
from goodput_gateway.config import GatewaySettings
from goodput_gateway.generation import Call
from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest
from goodput_gateway.jobs.messages import celery_client
from goodput_gateway.jobs.metrics import JobsMetrics
from goodput_gateway.jobs.records import FINAL_CODES, RETRYABLE, Job, retry_delay
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.schemas import parse
from goodput_gateway.wire import completion_body

__all__ = ["Heartbeat", "JobRunner", "Sweeper", "celery_app", "run_job", "serve_metrics"]

log = logging.getLogger("goodput.gateway.jobs")


class JobRunner:
    """Runs one job at a time through the gateway's composition root, built on first use. Its event loop stays
    open between jobs, so the channels to the scheduler, workers, cache and retriever are reused."""

    def __init__(self, settings: Any, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = REGISTRY if registry is None else registry  # the gateway's metrics of the answers
        self._loop = asyncio.Runner()
        self._wiring: Wiring | None = None

    def __call__(self, job: Job) -> dict[str, Any]:
        return self._loop.run(self._execute(job))

    async def _execute(self, job: Job) -> dict[str, Any]:
        if self._wiring is None:  # SLO, goodput and the rest of its answers' metrics: on this worker's /metrics
            own = CollectorRegistry()  # joined once whole: a composition that failed half-way leaves nothing behind
            self._wiring = compose(self.settings, own, None)
            self.registry.register(own)
        schema = ChatCompletionRequest if job.route == "chat" else CompletionRequest

        async def parse_body() -> Any:
            return parse(schema, job.body).to_request()

        # The job runs as the key that submitted it, under the key's limits and its tenant's (not around them), as
        # the keys file says now: a key revoked since fails its jobs (Unauthenticated).
        keys = self._wiring.service.keys
        principal = (keys.key_principal(job.key, tenant=job.tenant, priority=types_pb2.PRIORITY_P2) if job.key
                     else keys.tenant_principal(job.tenant, priority=types_pb2.PRIORITY_P2))
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


# Most turns one message spends on entries that name nothing to run before it gives up its turn.
EMPTY_TURNS = 100


def run_job(queue: JobQueue, job_id: str, *, runner: Callable[[Job], dict[str, Any]], dispatch: int) -> Job | None:
    """What one delivered message of the job's ``dispatch`` does (the Celery task's body): a turn. A job parked under
    it queues now (:meth:`JobQueue.wake`); the next queued job in fair order across tenants is taken (this one when
    its tenant's turn has come; :mod:`goodput_gateway.jobs.store`) and claimed, and one attempt runs (completed,
    re-parked with a delay, or failed for good). With nothing queued the message's own job is claimed, which does
    nothing when it is running under a live claim, finished or waiting for a later dispatch. Returns the job
    claimed (or found) as stored afterwards."""
    own = queue.wake(job_id, dispatch)
    for _ in range(EMPTY_TURNS):
        taken = queue.take(prefer=(own.tenant if own else "", job_id, dispatch))
        target = taken or (job_id, dispatch)
        verdict, job = queue.claim(*target)
        # A turn that found nothing to run (its record gone, or forged and deleted) does not spend this message: the
        # next is taken (past EMPTY_TURNS, the message's own job waits for the sweeper to send it again).
        if taken is None or taken[0] == job_id or verdict not in ("missing", "forged"):
            break
    if verdict != "claimed" or job is None:
        if verdict in ("duplicate", "stale"):
            log.info("job message ignored", extra={"job": target[0], "dispatch": target[1], "verdict": verdict})
        return job
    try:
        with Heartbeat(queue, job):  # renews the claim's lease while the attempt runs
            result = runner(job)
    except RETRYABLE as err:
        error = f"{type(err).__name__}: {err.message}"
        if err.code in FINAL_CODES:  # a spent budget, a request larger than its limit: no retry helps
            return queue.finish(job, "failed", error=error)[0]
        delay = retry_delay(job.attempts, err.retry_after_s, base_s=queue.settings.jobs.retry_base_s,
                            cap_s=queue.settings.jobs.retry_cap_s)
        log.info("job parked", extra={"job": job.id, "delay_s": round(delay, 2), "error": error})
        return queue.finish(job, "parked", error=error, delay_s=delay)[0]
    except GoodputError as err:
        return queue.finish(job, "failed", error=f"{type(err).__name__}: {err.message}")[0]
    except Exception as err:  # a fault of this worker (not of the request): retried later, like a shed attempt
        log.exception("job attempt failed", extra={"job": job.id})
        delay = retry_delay(job.attempts, None, base_s=queue.settings.jobs.retry_base_s,
                            cap_s=queue.settings.jobs.retry_cap_s)
        return queue.finish(job, "parked", error=f"Internal: {type(err).__name__}", delay_s=delay)[0]
    return queue.finish(job, "completed", result=result)[0]


class Heartbeat:
    """Renews a claim's lease every third of ``job_lease_s`` while the attempt runs (a thread of its own, so a
    long generation keeps its claim); a worker that dies stops renewing, and the claim lapses."""

    def __init__(self, queue: JobQueue, job: Job) -> None:
        self.queue, self.job = queue, job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job.id}", daemon=True)

    def _run(self) -> None:
        every = max(self.queue.settings.jobs.lease_s / 3, 0.05)
        while not self._stop.wait(every):
            try:
                if not self.queue.renew(self.job):
                    log.warning("job claim lost while running; its outcome will be dropped", extra={"job": self.job.id})
                    return
            except Exception as err:  # noqa: BLE001 - Redis blinked: the lease has room for the next try
                log.warning("job lease not renewed", extra={"job": self.job.id, "error": repr(err)[:200]})

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Sweeper:
    """Runs :meth:`JobQueue.sweep` every ``job_sweep_interval_s`` in a thread of the jobs worker's main process,
    when this process holds the turn (:meth:`JobQueue.lead`): one sweep per interval over every worker replica.

    It lives in the jobs workers because they are what the sweep feeds (a message sent again is theirs to run),
    and off the gateway's request path; any replica may sweep, and overlapping sweeps would be harmless (every step
    is a compare-and-set), so there is no leader to elect or lose.
    """

    def __init__(self, queue: JobQueue, *, interval_s: float) -> None:
        self.queue, self.interval_s = queue, interval_s
        self.owner = f"sweeper-{uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_once(self) -> dict[str, int] | None:
        """One turn: the sweep's counts, or None when another process holds this interval's turn."""
        if not self.queue.lead(self.interval_s * 0.9, self.owner):
            return None
        return self.queue.sweep()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception as err:  # noqa: BLE001 - Redis blinked: the next turn tries again
                log.warning("jobs sweep failed", extra={"error": repr(err)[:200]})

    def start(self) -> None:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jobs-sweeper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# ---- Celery ----------------------------------------------------------------------------------------------------

REGISTRY = CollectorRegistry()  # this process's metrics: the jobs' (from Redis) and the gateway's of their answers
_registered: set[int] = set()


def celery_app(settings: Any) -> Any:
    """The Celery app for these settings with the jobs' task and the worker's hooks registered (one per broker URL
    and queue in a process)."""
    app = celery_client(settings)
    if id(app) not in _registered:
        _register(app, settings)
        _registered.add(id(app))
    return app


def __getattr__(name: str) -> Any:
    """``celery -A goodput_gateway.worker worker -Q goodput-jobs`` finds ``app`` here (settings from the
    environment); a lazy attribute, so importing this module builds no Celery app."""
    if name in ("app", "celery"):
        return celery_app(GatewaySettings())
    raise AttributeError(name)


def _register(app: Any, settings: Any) -> None:
    import redis
    from celery import signals

    client = redis.Redis.from_url(settings.redis_url)
    runners: list[JobRunner] = []  # one per process that runs tasks (a prefork child), made on its first task
    sweepers: list[Sweeper] = []  # the worker's main process sweeps (it also serves the metrics)

    @app.task(name="goodput.jobs.run", ignore_result=True)
    def run(job_id: str, dispatch: int) -> str:
        if not runners:
            runners.append(JobRunner(settings))
        job = run_job(JobQueue(settings, client), job_id, runner=runners[0], dispatch=dispatch)
        return job.state if job else "missing"

    @signals.worker_ready.connect(weak=False)
    def _ready(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is app:  # signals are process-wide; only this app's worker serves
            serve_metrics(settings, client)
            sweeper = Sweeper(JobQueue(settings, client), interval_s=settings.jobs.sweep_interval_s)
            sweeper.start()
            sweepers.append(sweeper)

    @signals.worker_shutdown.connect(weak=False)
    def _shutdown(sender: Any = None, **_: Any) -> None:
        while sweepers:
            sweepers.pop().stop()

    @signals.worker_process_shutdown.connect(weak=False)
    def _close(**_: Any) -> None:
        while runners:
            runners.pop().close()


def serve_metrics(settings: Any, redis_client: Any) -> None:
    """Starts a worker's metrics server on ``jobs_worker_http_port`` (0 = none) at ``grpc_host``: jobs by state and
    attempts by outcome (from Redis); called on Celery's ``worker_ready``."""
    if not settings.jobs.worker_http_port:
        return
    from prometheus_client import start_http_server

    # Its own thread serves the scrape: it reads Redis then, but waits half a second at most (then the last values).
    JobsMetrics(REGISTRY, JobQueue(settings, redis_client), scrape_wait_s=0.5)
    start_http_server(settings.jobs.worker_http_port, addr=settings.grpc_host, registry=REGISTRY)
    log.info("jobs worker metrics", extra={"addr": settings.grpc_host, "port": settings.jobs.worker_http_port})
