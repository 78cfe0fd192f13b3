"""Reindex jobs through a real Celery worker (Redis broker), writing through a real retriever; the finished job
publishes the knowledge base's new version on the pub/sub channel."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from goodput_testing import async_wait_until, free_port

from goodput_embedder.config import EmbedderSettings
from goodput_embedder.jobs import REINDEX_TASK, JobStore, create_app
from goodput_retriever.search import SearchQuery

pytestmark = pytest.mark.slow


@pytest.fixture
def worker(settings: EmbedderSettings, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A prefork worker, as the chart runs it: the task runs in a child process, /metrics is the parent's."""
    port = free_port()
    env = {**os.environ, "GOODPUT_EMBEDDER_REDIS_URL": settings.redis_url,
           "GOODPUT_EMBEDDER_RETRIEVER_ADDR": settings.retriever_addr,
           "GOODPUT_EMBEDDER_KEY_PREFIX": settings.key_prefix,
           "GOODPUT_EMBEDDER_VERSION_CHANNEL": settings.version_channel, "GOODPUT_EMBEDDER_WORKER_HTTP_PORT": str(port),
           "GOODPUT_EMBEDDER_SOURCE_ROOTS": str(tmp_path)}
    log = (tmp_path / "worker.log").open("wb")
    # A queue of its own, so that a platform's worker on the same Redis does not take this test's jobs.
    queue = f"{settings.key_prefix}-jobs"
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "goodput_embedder.jobs", "worker", "--pool",
                             "prefork", "--concurrency", "1", "-Q", queue, "--without-gossip", "--without-mingle",
                             "--without-heartbeat", "--loglevel", "INFO"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    yield queue, f"http://127.0.0.1:{port}/metrics"
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


async def _wait(jobs: JobStore, job_id: str, timeout_s: float = 120):  # type: ignore[no-untyped-def]
    """The job's final state, read from Redis (the worker is another process: nothing to wait on but its record)."""
    async def finished():  # type: ignore[no-untyped-def]
        info = await asyncio.to_thread(jobs.get, job_id)
        return info if info is not None and info.state in ("succeeded", "failed") else None

    return await async_wait_until(finished, timeout=timeout_s, interval=0.1, message=f"job {job_id} did not finish")


async def test_reindex_job_runs_on_a_celery_worker_and_publishes_the_version(settings, worker, retriever,
                                                                            tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"id": f"d{i}", "title": f"Note {i}", "text": f"The code word is word{i}."})
                                for i in range(10)) + "\n")
    client = redis.Redis.from_url(settings.redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(settings.version_channel)
    jobs = JobStore(client, prefix=settings.key_prefix, ttl_s=600)
    app = create_app(settings)
    queue, metrics_url = worker
    job_id = jobs.create("acme", "notes", str(source), False)
    app.send_task(REINDEX_TASK, args=[job_id, "acme", "notes", str(source), False], queue=queue)
    info = await _wait(jobs, job_id)
    assert info.state == "succeeded", info.error
    assert (info.documents_done, info.documents_total, info.chunks_embedded) == (10, 10, 10)
    announced = {"tenant": "acme", "knowledge_base": "notes", "version": info.kb_version}

    def next_announcement() -> bool:
        m = pubsub.get_message(timeout=0.1)
        return bool(m and m["type"] == "message" and json.loads(m["data"]) == announced)

    await async_wait_until(lambda: asyncio.to_thread(next_announcement), timeout=10, interval=0,
                           message="the new version was not announced")
    r = await retriever.retriever.search(SearchQuery(tenant="acme", kb="notes", query="word7", top_k=3))
    assert r.hits[0].document_id == "d7"
    # A second run of the unchanged source embeds nothing; a missing source fails the job with a clear error.
    job2 = jobs.create("acme", "notes", str(source), False)
    app.send_task(REINDEX_TASK, args=[job2, "acme", "notes", str(source), False], queue=queue)
    info2 = await _wait(jobs, job2)
    assert info2.state == "succeeded" and info2.chunks_embedded == 0 and info2.kb_version == info.kb_version + 1
    job3 = jobs.create("acme", "notes", str(tmp_path / "missing.jsonl"), False)
    app.send_task(REINDEX_TASK, args=[job3, "acme", "notes", str(tmp_path / "missing.jsonl"), False], queue=queue)
    info3 = await _wait(jobs, job3)
    assert info3.state == "failed" and "does not exist" in info3.error
    # the worker reads only under its source roots: a system file fails the job, naming why
    job4 = jobs.create("acme", "notes", "/etc/passwd", False)
    app.send_task(REINDEX_TASK, args=[job4, "acme", "notes", "/etc/passwd", False], queue=queue)
    info4 = await _wait(jobs, job4)
    assert info4.state == "failed" and "outside the source roots" in info4.error, info4.error
    # the jobs ran in the pool's child process; the parent's /metrics counts them all
    metrics = httpx.get(metrics_url, timeout=5).text
    assert 'goodput_embedder_jobs_total{outcome="succeeded"} 2.0' in metrics
    assert 'goodput_embedder_jobs_total{outcome="failed"} 2.0' in metrics
    pubsub.close()
    client.close()
