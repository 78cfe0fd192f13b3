"""Reindex jobs as Celery tasks (Redis broker). Run a worker with::

    celery -A goodput_embedder.jobs worker --pool solo --concurrency 1

The task reads a source (a file, folder or JSONL under the source roots: :mod:`goodput_embedder.sources`) with the
same :class:`~goodput_embedder.indexer.Indexer` as the synchronous path, recording progress in Redis
(``<prefix>:job:<id>``, read by ``JobStatus``). Tasks are acknowledged late and re-queued when a worker dies, and
indexing is idempotent, so a job killed halfway finishes on re-run with no duplicates and nothing missing.

A worker serves ``/metrics`` on ``worker_http_port`` once ready; jobs by outcome are counted in Redis
(``<prefix>:jobs:outcomes``), so a prefork pool's children, which run the tasks, show up on the parent's endpoint.

``app`` is built on first access (``celery -A`` looks it up), from the GOODPUT_EMBEDDER_ settings; nothing
connects at import time.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis
from celery import Celery, signals
from prometheus_client import CollectorRegistry, start_http_server

from goodput_contracts.redis_access import celery_conf
from goodput_core.errors import GoodputError
from goodput_core.metrics import SharedCounter, StoreReadings
from goodput_core.settings import load_settings

from goodput_embedder.config import EmbedderSettings
from goodput_embedder.indexer import Doc, Indexer, IndexResult
from goodput_embedder.sources import SourceAccess

__all__ = ["JobStore", "JobInfo", "REINDEX_TASK", "create_app", "run_reindex"]

log = logging.getLogger("goodput.embedder.jobs")
REINDEX_TASK = "goodput_embedder.reindex"


@dataclass
class JobInfo:
    job_id: str
    state: str
    documents_done: int = 0
    documents_total: int = 0
    chunks_embedded: int = 0
    kb_version: int = 0
    error: str = ""


class JobStore:
    """Job status in Redis (a hash per job, expiring after ``job_ttl_s``)."""

    def __init__(self, client: redis.Redis, *, prefix: str, ttl_s: int) -> None:
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def create(self, tenant: str, kb: str, source: str, full_rebuild: bool) -> str:
        job_id = f"job-{uuid.uuid4().hex[:16]}"
        self.update(job_id, state="pending", tenant=tenant, knowledge_base=kb, source=source,
                    full_rebuild=int(full_rebuild), created=time.time())
        return job_id

    def update(self, job_id: str, **fields: Any) -> None:
        key = self._key(job_id)
        self.redis.hset(key, mapping={k: str(v) for k, v in fields.items()})
        self.redis.expire(key, self.ttl_s)

    def count_outcome(self, state: str) -> None:
        """One more job ended in ``state``, counted in Redis so that every worker process's jobs show up on the
        worker's /metrics (a prefork pool's children run the tasks; the parent serves the metrics)."""
        self.redis.hincrby(f"{self.prefix}:jobs:outcomes", state, 1)

    def outcomes(self) -> dict[str, int]:
        raw = self.redis.hgetall(f"{self.prefix}:jobs:outcomes")
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    def get(self, job_id: str) -> JobInfo | None:
        raw = self.redis.hgetall(self._key(job_id))
        if not raw:
            return None
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        counts = {f: int(d.get(f, 0)) for f in ("documents_done", "documents_total", "chunks_embedded", "kb_version")}
        return JobInfo(job_id=job_id, state=d.get("state", "pending"), error=d.get("error", ""), **counts)


def run_reindex(indexer: Indexer, jobs: JobStore, job_id: str, tenant: str, kb: str, source: str,
                full_rebuild: bool, *, sources: SourceAccess | None = None) -> IndexResult:
    """The task body (also called directly by tests). ``source`` is read only through ``sources`` (by default the
    indexer's settings): a path outside the source roots, a special file or one over the bound fails the job."""
    access = sources or SourceAccess.from_settings(indexer.settings)
    jobs.update(job_id, state="running", started=time.time(), error="")
    try:
        total = sum(1 for _ in access.read(source))
        jobs.update(job_id, documents_total=total)
        docs = (Doc(id=d.id, text=d.text, type=d.type, title=d.title, metadata=d.metadata) for d in access.read(source))

        def progress(done: int, result: IndexResult) -> None:
            jobs.update(job_id, documents_done=done, chunks_embedded=result.chunks_embedded)

        result = indexer.run_job(tenant, kb, docs, full_rebuild=full_rebuild, progress=progress)
    except (GoodputError, OSError) as err:
        message = err.message if isinstance(err, GoodputError) else str(err)
        jobs.update(job_id, state="failed", error=message, finished=time.time())
        log.warning("reindex failed", extra={"job_id": job_id, "error": message})
        return IndexResult()
    jobs.update(job_id, state="succeeded", documents_done=total, chunks_embedded=result.chunks_embedded,
                kb_version=result.kb_version, finished=time.time(), result=json.dumps(result.__dict__))
    return result


def create_app(settings: EmbedderSettings) -> Celery:
    app = Celery("goodput_embedder", broker=settings.redis_url, set_as_current=False)
    # Its own queue and broker keys (other Celery apps share the Redis); a job whose worker dies is redelivered and
    # re-run (indexing is idempotent); status lives in the job hash, not in a result backend.
    app.conf.update(celery_conf(settings.index_queue), task_ignore_result=True, worker_hijack_root_logger=False)
    registry = CollectorRegistry()
    scrape_store = JobStore(redis.Redis.from_url(settings.redis_url, socket_timeout=2.0), prefix=settings.key_prefix,
                            ttl_s=settings.job_ttl_s)
    # The metrics thread reads Redis when scraped, waiting half a second at most (then it serves the last values).
    readings = StoreReadings("embedder_jobs", registry, scrape_wait_s=0.5)
    registry.register(SharedCounter("goodput_embedder_jobs", "Reindex jobs by outcome (from Redis, every worker "
                                    "process).", "outcome", read=readings.add("outcomes", scrape_store.outcomes),
                                    known=("succeeded", "failed")))

    @cache
    def context() -> tuple[Indexer, JobStore]:
        from goodput_core.tls import channel_credentials

        from goodput_embedder.models import load_model
        from goodput_embedder.store_client import GrpcStoreWriter

        model = load_model(settings)
        client = redis.Redis.from_url(settings.redis_url)
        indexer = Indexer(settings, embed=model.embed,
                          store=GrpcStoreWriter(settings.retriever_addr, timeout_s=settings.write_timeout_s,
                                                credentials=channel_credentials(settings)),
                          redis_client=client)
        return indexer, JobStore(client, prefix=settings.key_prefix, ttl_s=settings.job_ttl_s)

    @app.task(name=REINDEX_TASK, bind=True)
    def reindex(self: Any, job_id: str, tenant: str, kb: str, source: str, full_rebuild: bool) -> dict[str, Any]:
        indexer, jobs = context()
        result = run_reindex(indexer, jobs, job_id, tenant, kb, source, full_rebuild)
        info = jobs.get(job_id)
        jobs.count_outcome(info.state if info else "unknown")
        return result.__dict__

    @signals.worker_ready.connect(weak=False)
    def _metrics(**_: Any) -> None:
        if settings.worker_http_port:
            start_http_server(settings.worker_http_port, addr=settings.grpc_host, registry=registry)

    return app


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        built = create_app(load_settings(EmbedderSettings))
        globals()["app"] = built
        return built
    raise AttributeError(name)
