"""Deferred P2 work, end to end with real processes: a simulated worker, the scheduler, a Celery worker and Redis.

Shed P2 work is parked, completes once load falls, survives a scheduler restart, and is fetchable by id over REST
(where the shed request itself got its 429 with Retry-After and the job's id)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
import redis
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_testing import async_wait_until, free_port

from goodput_gateway.__main__ import build as build_gateway
from goodput_gateway.config import GatewaySettings
from goodput_gateway.jobs import JobQueue
from goodput_gateway.jobs.messages import celery_send

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

API_KEY = "test-key-batch"
# Another key of the same tenant, with a tokens-per-minute limit of its own (the tenant has none).
CI_KEY = {"key": "test-key-batch-ci", "id": "batch-ci", "tenant": "batch", "tpm": 5}


class Procs:
    """A simulated worker, a scheduler (restartable) and a Celery jobs worker, as processes."""

    def __init__(self, redis_url: str, prefix: str, logdir: Path) -> None:
        self.redis_url = redis_url
        self.logdir = logdir
        self.worker_addr = f"127.0.0.1:{free_port()}"
        self.scheduler_port = free_port()
        self.scheduler_addr = f"127.0.0.1:{self.scheduler_port}"
        # The Celery queue (a Redis list) and the jobs' keys both under ``prefix``, so they are cleaned up after.
        self.jobs_env = {"GOODPUT_GATEWAY_REDIS_URL": redis_url, "GOODPUT_GATEWAY_JOBS__QUEUE": f"{prefix}-queue",
                         "GOODPUT_GATEWAY_JOBS__PREFIX": prefix,
                         # A parked job runs as its tenant, which needs a key; quota and usage keys under ``prefix``.
                         "GOODPUT_GATEWAY_API_KEYS": json.dumps({"keys": [{"key": API_KEY, "tenant": "batch"},
                                                                          CI_KEY]}),
                         "GOODPUT_GATEWAY_QUOTAS__PREFIX": f"{prefix}:quota",
                         "GOODPUT_GATEWAY_METERING__USAGE_PREFIX": f"{prefix}:usage",
                         "GOODPUT_GATEWAY_SCHEDULER_ADDR": self.scheduler_addr,
                         "GOODPUT_GATEWAY_JOBS__RETRY_BASE_S": "0.2", "GOODPUT_GATEWAY_JOBS__RETRY_CAP_S": "1.0",
                         "GOODPUT_GATEWAY_REQUEST_TIMEOUT_S": "20",
                         # A killed worker's claim lapses in 2 s; a message not started 3 s after it was due is
                         # sent again; the worker sweeps twice a second.
                         "GOODPUT_GATEWAY_JOBS__LEASE_S": "2", "GOODPUT_GATEWAY_JOBS__LOST_AFTER_S": "3",
                         "GOODPUT_GATEWAY_JOBS__SWEEP_INTERVAL_S": "0.5",
                         "GOODPUT_GATEWAY_JOBS__WORKER_HTTP_PORT": str(free_port())}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[name] = subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=log,
                                            stderr=subprocess.STDOUT)

    def start_worker(self) -> None:
        self.spawn("worker", ["-m", "goodput_inference"], {
            "GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_GRPC_PORT": self.worker_addr.rsplit(":", 1)[1],
            "GOODPUT_INFERENCE_HTTP_PORT": "0", "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps({"time_scale": 0.2}),
            "GOODPUT_INFERENCE_MAX_MODEL_LEN": "4096"})

    def start_scheduler(self) -> None:
        self.spawn("scheduler", ["-m", "goodput_scheduler"], {
            "GOODPUT_SCHEDULER_GRPC_PORT": str(self.scheduler_port), "GOODPUT_SCHEDULER_HTTP_PORT": "0",
            "GOODPUT_SCHEDULER_WORKERS": self.worker_addr, "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.2",
            "GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER": "1", "GOODPUT_SCHEDULER_SHED_P2_AT": "1.0",
            "GOODPUT_SCHEDULER_SHED_HYSTERESIS": "0.5", "GOODPUT_SCHEDULER_DRAIN_GRACE_S": "0.5"})

    def stop_scheduler(self) -> None:
        self.stop("scheduler")

    def start_celery(self) -> None:
        self.spawn("celery", ["-m", "celery", "-A", "goodput_gateway.worker", "worker", "-Q",
                              self.jobs_env["GOODPUT_GATEWAY_JOBS__QUEUE"], "--pool=solo", "--without-gossip",
                              "--without-mingle", "--without-heartbeat", "-l", "WARNING"], self.jobs_env)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self, name: str) -> None:
        """SIGKILL: the process dies mid-run, releasing nothing."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def settings(self, **kw: Any) -> GatewaySettings:
        base: dict[str, Any] = {}  # the jobs worker's environment as settings (GROUP__FIELD: a group's field)
        for key, value in self.jobs_env.items():
            name, _, field = key.removeprefix("GOODPUT_GATEWAY_").lower().partition("__")
            if field:
                base.setdefault(name, {})[field] = value
            else:
                base[name] = value
        return GatewaySettings(**{**base, **kw})


@pytest.fixture(scope="module")
def procs(redis_url: str, redis_session_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    # Module-scoped (the processes are started once), so under the session's prefix rather than a test's.
    p = Procs(redis_url, f"{redis_session_prefix}-jobs", tmp_path_factory.mktemp("jobs-logs"))
    p.start_worker()
    p.start_celery()
    yield p
    p.stop_all()
    # Celery's keys (the queue, its bindings, what a killed worker held unacknowledged) are under "<queue>:".
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{p.jobs_env['GOODPUT_GATEWAY_JOBS__QUEUE']}:*"):
        client.delete(key)
    client.close()


class Overload:
    """Holds the scheduler saturated: one P0 lease on its only slot and one P0 queued behind it, so the
    saturation signal is 1.0 and new P2 requests are shed."""

    def __init__(self, addr: str) -> None:
        self.channel = aio.insecure_channel(addr)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.out: asyncio.Queue[scheduler_pb2.LeaseMuxBatch | None] = asyncio.Queue()
        self.call: aio.StreamStreamCall | None = None

    async def _requests(self) -> AsyncIterator[scheduler_pb2.LeaseMuxBatch]:
        while (batch := await self.out.get()) is not None:
            yield batch

    async def __aenter__(self) -> Overload:
        # The scheduler and its worker may still be starting.
        await async_wait_until(lambda: has_healthy_worker(self.stub), timeout=30, interval=0.1,
                               message="the scheduler has no healthy worker")
        self.call = self.stub.LeaseBatches(self._requests())
        self.out.put_nowait(scheduler_pb2.LeaseMuxBatch(requests=[scheduler_pb2.LeaseMuxRequest(
            lease_id=f"hold-{i}", timeout_s=120, admit=scheduler_pb2.Admit(
                request_id=f"hold-{i}", tenant="interactive", priority=types_pb2.PRIORITY_P0)) for i in range(2)]))
        answered = 0
        while answered < 2:  # granted, then queued
            answered += len((await self.call.read()).events)
        return self

    async def release(self) -> None:
        if self.call is not None:  # the stream ends: the scheduler gives back both
            self.out.put_nowait(None)
            self.call.cancel()
            self.call = None

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
        await self.channel.close()


async def has_healthy_worker(scheduler: scheduler_pb2_grpc.SchedulerStub, *, idle: bool = False) -> bool:
    """True when the scheduler answers and has a healthy worker (with ``idle``: one holding no lease)."""
    try:
        resp = await scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return any(w.healthy and not (idle and w.inflight) for w in resp.workers)


def chat_body(text: str = "Summarise the quarterly report.") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 6}


async def wait_job(queue: JobQueue, job_id: str, predicate: Any, timeout: float = 60) -> Any:
    """The job once ``predicate`` holds for it (the Celery worker, another process, moves it along)."""
    seen: list[Any] = [None]

    async def reached() -> Any:
        seen[0] = job = await asyncio.to_thread(queue.load, job_id)
        return job if job is not None and predicate(job) else None

    try:
        return await async_wait_until(reached, timeout=timeout, interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"job did not reach the expected state: {seen[0]}") from e


@pytest.fixture
async def queue(procs: Procs) -> AsyncIterator[JobQueue]:
    procs.start_scheduler()
    settings = procs.settings()
    yield JobQueue(settings, redis.Redis.from_url(settings.redis_url))
    procs.stop_scheduler()


async def test_parked_p2_work_completes_after_load_falls(procs: Procs, queue: JobQueue) -> None:
    async with Overload(procs.scheduler_addr) as load:
        job = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=chat_body())
        parked = await wait_job(queue, job.id, lambda j: j.state == "parked" and j.attempts >= 2)
        assert "ResourceExhausted" in parked.error  # shed again while the overload lasts: not lost, re-parked
        await load.release()
        done = await wait_job(queue, job.id, lambda j: j.state == "completed")
    assert done.result["choices"][0]["message"]["content"].strip()
    assert done.result["usage"]["completion_tokens"] == 6
    assert queue.count("completed") >= 1


async def test_worker_serves_metrics_and_probes_on_its_http_port(procs: Procs, queue: JobQueue) -> None:
    # Started on Celery's worker_ready: what the chart's HTTP probes and ServiceMonitor use.
    base = f"http://127.0.0.1:{procs.jobs_env['GOODPUT_GATEWAY_JOBS__WORKER_HTTP_PORT']}"
    job = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=chat_body())
    await wait_job(queue, job.id, lambda j: j.state == "completed")
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        assert (await http.get("/healthz")).status_code == 200
        metrics = (await http.get("/metrics")).text
    # Read from Redis, so they include what the worker's task processes did.
    assert 'goodput_gateway_deferred_jobs{state="completed"}' in metrics
    completed = re.search(r'^goodput_gateway_deferred_job_attempts_total\{outcome="completed"\} (\S+)$', metrics,
                          re.MULTILINE)
    assert completed and float(completed.group(1)) >= 1, metrics
    assert queue.attempts()["completed"] >= 1


async def test_parked_p2_work_survives_a_scheduler_restart(procs: Procs, queue: JobQueue) -> None:
    async with Overload(procs.scheduler_addr):
        job = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=chat_body())
        await wait_job(queue, job.id, lambda j: j.state == "parked" and j.attempts >= 1)
        procs.stop_scheduler()  # the scheduler goes away with its queues (and the overload)
    attempts = (await asyncio.to_thread(queue.load, job.id)).attempts
    # While it is down, attempts fail as UNAVAILABLE and the job stays parked.
    unavailable = await wait_job(queue, job.id, lambda j: j.attempts > attempts and j.state == "parked")
    assert "Unavailable" in unavailable.error
    procs.start_scheduler()
    done = await wait_job(queue, job.id, lambda j: j.state == "completed")
    assert done.result["object"] == "chat.completion"


async def test_rest_sheds_p2_with_429_retry_after_and_a_job_to_fetch(procs: Procs, queue: JobQueue) -> None:
    keys = json.dumps({"keys": [{"key": API_KEY, "tenant": "batch", "max_priority": "P0"}]})
    http_port, metrics_port = free_port(), free_port()
    settings = procs.settings(api_keys=keys, grpc_port=0, http_port=http_port, metrics_port=metrics_port,
                              models_cache_s=0.0, drain_grace_s=0.5)
    runner = build_gateway(settings, CollectorRegistry(), None)
    await runner.start()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", headers=headers, timeout=30) as http:
            async with Overload(procs.scheduler_addr) as load:
                shed = await http.post("/v1/chat/completions", json={**chat_body(), "priority": "P2"})
                assert shed.status_code == 429, shed.text
                assert int(shed.headers["Retry-After"]) >= 1
                job_id = shed.headers["X-Goodput-Job-Id"]
                assert shed.json()["error"]["job_id"] == job_id and shed.json()["error"]["type"] == "rate_limit_error"
                submitted = await http.post("/v1/jobs", json={"endpoint": "/v1/chat/completions",
                                                              "body": chat_body("Translate the memo.")})
                assert submitted.status_code == 202 and submitted.json()["status"] in ("queued", "parked")
                assert (await http.get(f"/v1/jobs/{job_id}")).json()["status"] in ("parked", "running")
                await load.release()
                for jid in (job_id, submitted.json()["id"]):
                    async def completed(jid: str = jid) -> dict[str, Any] | None:
                        body: dict[str, Any] = (await http.get(f"/v1/jobs/{jid}")).json()
                        return body if body["status"] == "completed" else None
                    body = await async_wait_until(completed, timeout=60, interval=0.2,
                                                  message=f"job {jid} did not complete")
                    assert body["response"]["choices"][0]["message"]["content"]
            other = {"Authorization": "Bearer nope"}
            assert (await http.get(f"/v1/jobs/{job_id}", headers=other)).status_code == 401
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            assert 'goodput_gateway_deferred_jobs{state="completed"}' in metrics
    finally:
        await runner.stop()


def metered_tokens(procs: Procs) -> int:
    """Completion tokens metered to the jobs' tenant this month (the workers write them to Redis after each job)."""
    client = redis.Redis.from_url(procs.redis_url)
    month = time.strftime("%Y-%m", time.gmtime())
    usage = procs.jobs_env["GOODPUT_GATEWAY_METERING__USAGE_PREFIX"]
    raw = cast(dict[bytes, bytes], client.hgetall(f"{usage}:batch:{month}"))
    client.close()
    return sum(int(v) for k, v in raw.items() if k.endswith(b"|completion_tokens"))


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


async def scheduler_ready(procs: Procs) -> None:
    """Until the (just started) scheduler has an idle healthy worker, so a job's first attempt is not shed."""
    async with aio.insecure_channel(procs.scheduler_addr) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await async_wait_until(lambda: has_healthy_worker(stub, idle=True), timeout=30, interval=0.1,
                               message="the scheduler has no idle healthy worker")


async def test_celery_runs_a_message_delivered_twice_once(procs: Procs, queue: JobQueue) -> None:
    await scheduler_ready(procs)
    messages, attempts, metered = queue.tally("messages"), queue.attempts(), metered_tokens(procs)
    job = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=chat_body())
    # The broker hands the worker the same dispatch's message twice (a publisher's retry, a redelivery).
    await asyncio.to_thread(celery_send(procs.settings()), job.id, job.dispatch, 0.0)
    done = await wait_job(queue, job.id, lambda j: j.state == "completed")
    await async_wait_until(lambda: sum(delta(queue.tally("messages"), messages).values()) >= 2, timeout=30,
                           message="the second copy of the message was not handled")
    # One attempt completed (an earlier one may have been shed while the channel to the just-started scheduler
    # was still connecting, and parked: a retry, not a second run); the copy ran nothing.
    handled = delta(queue.tally("messages"), messages)
    assert handled.get("claimed") == done.attempts and handled.get("duplicate", 0) + handled.get("stale", 0) == 1
    ended = delta(queue.attempts(), attempts)
    assert ended.pop("completed") == 1 and ended.get("parked", 0) == done.attempts - 1 and set(ended) <= {"parked"}
    assert metered_tokens(procs) - metered == 6  # one generation's tokens metered, once
    assert (await asyncio.to_thread(queue.load, job.id)) == done  # the result was not written again


async def test_celery_worker_sweeps_a_lost_message_and_runs_the_job_once(procs: Procs, queue: JobQueue) -> None:
    await scheduler_ready(procs)
    recoveries, attempts = queue.tally("recoveries"), queue.attempts()
    lossy = JobQueue(queue.settings, queue.redis, send=lambda job_id, dispatch, delay_s: None)
    job = await asyncio.to_thread(lossy.submit, tenant="batch", route="chat", body=chat_body())
    # No message was sent: the worker's sweeper sends it JOBS__LOST_AFTER_S after it was due.
    done = await wait_job(queue, job.id, lambda j: j.state == "completed", timeout=60)
    assert done.result["usage"]["completion_tokens"] == 6
    assert delta(queue.tally("recoveries"), recoveries) == {"lost_message": 1}
    ended = delta(queue.attempts(), attempts)  # completed once (after attempts parked while it was shed, if any)
    assert ended.pop("completed") == 1 and ended.get("parked", 0) == done.attempts - 1 and set(ended) <= {"parked"}


async def test_a_celery_worker_killed_mid_run_lets_the_job_run_once_more(procs: Procs, queue: JobQueue) -> None:
    await scheduler_ready(procs)
    attempts, recoveries = queue.attempts(), queue.tally("recoveries")
    job = await asyncio.to_thread(queue.submit, tenant="batch", route="chat",
                                  body={**chat_body("Write a long story."), "max_tokens": 1500})
    await wait_job(queue, job.id, lambda j: j.state == "running", timeout=60)
    procs.kill("celery")  # mid-generation: no outcome written, the claim never released
    procs.start_celery()
    # The new worker's sweeper finds the claim lapsed (JOBS__LEASE_S) and queues the job again; it completes once.
    done = await wait_job(queue, job.id, lambda j: j.state == "completed", timeout=120)
    assert done.attempts >= 2 and done.result["usage"]["completion_tokens"] > 0
    ended = delta(queue.attempts(), attempts)
    assert ended["lost"] == 1 and ended["completed"] == 1 and set(ended) <= {"lost", "completed", "parked"}
    assert delta(queue.tally("recoveries"), recoveries).get("lease_expired") == 1
    stored = await asyncio.to_thread(queue.load, job.id)
    assert stored is not None and stored.result == done.result


async def test_a_job_runs_under_the_limits_of_the_key_that_submitted_it(procs: Procs, queue: JobQueue) -> None:
    await scheduler_ready(procs)
    body = {**chat_body(), "max_tokens": 6}  # more tokens than the CI key's tpm of 5 allows in one request
    by_ci = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=body, key="batch-ci")
    by_tenant = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=body)
    revoked = await asyncio.to_thread(queue.submit, tenant="batch", route="chat", body=body, key="gone")
    # no retry helps a request larger than its key's whole minute: the job fails at once, naming the key's limit
    refused = await wait_job(queue, by_ci.id, lambda j: j.state == "failed" and "RateLimited" in j.error)
    assert "API key 'batch-ci'" in refused.error and "5 tokens per minute" in refused.error
    done = await wait_job(queue, by_tenant.id, lambda j: j.state == "completed")  # the tenant itself has no tpm
    assert done.result["usage"]["completion_tokens"] == 6
    failed = await wait_job(queue, revoked.id, lambda j: j.state == "failed")
    assert failed.error.startswith("Unauthenticated") and "'gone'" in failed.error and "revoked" in failed.error


async def test_a_batch_runs_through_the_jobs_worker_to_its_output_file(procs: Procs, queue: JobQueue) -> None:
    keys = json.dumps({"keys": [{"key": API_KEY, "tenant": "batch", "max_priority": "P2"}]})
    http_port = free_port()
    runner = build_gateway(procs.settings(api_keys=keys, grpc_port=0, http_port=http_port, models_cache_s=0.0,
                                          drain_grace_s=0.5), CollectorRegistry(), None)
    await runner.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat_body()}
                     for i in range(3)]
            uploaded = await http.post("/v1/files", files={"file": ("in.jsonl", "".join(
                json.dumps(x) + "\n" for x in lines).encode())}, data={"purpose": "batch"})
            created = await http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                           "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"})
            assert created.status_code == 200, created.text

            async def finished() -> dict[str, Any] | None:
                body: dict[str, Any] = (await http.get(f"/v1/batches/{created.json()['id']}")).json()
                return body if body["status"] == "completed" else None
            done = await async_wait_until(finished, timeout=60, interval=0.2, message="the batch did not complete")
            assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
            out = (await http.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in out) == ["q0", "q1", "q2"]
            assert all(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] == 6 for x in out)
    finally:
        await runner.stop()


async def test_a_batch_files_check_leaves_another_tenants_stream_on_time(procs: Procs, queue: JobQueue) -> None:
    """Tenant A creates a batch from a 10,000-line, ~15 MiB file whose last line is bad while tenant B streams from
    the same gateway: the file is checked on the event loop in turns (goodput_gateway.api.batches.check_file), so
    B's largest gap between tokens while the batch is checked stays within 20 ms of its largest gap before."""
    keys = json.dumps({"keys": [{"key": "test-key-a", "tenant": "a", "max_priority": "P0"},
                                {"key": "test-key-b", "tenant": "b", "max_priority": "P0"}]})
    http_port = free_port()
    settings = procs.settings(api_keys=keys, grpc_port=0, http_port=http_port, models_cache_s=0.0,
                              drain_grace_s=0.5)
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {**chat_body("x" * 1450), "max_tokens": 4}}
    content = "".join(json.dumps({"custom_id": f"r{i}", **line}) + "\n" for i in range(9999)).encode()
    content += json.dumps({"custom_id": "last", **line, "body": {"messages": []}}).encode() + b"\n"
    assert 14 << 20 < len(content) < settings.limits.file_bytes
    a, b = {"Authorization": "Bearer test-key-a"}, {"Authorization": "Bearer test-key-b"}
    runner = build_gateway(settings, CollectorRegistry(), None)
    await runner.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            uploaded = await http.post("/v1/files", headers=a, files={"file": ("in.jsonl", content)},
                                       data={"purpose": "batch"})
            assert uploaded.status_code == 200, uploaded.text
            await scheduler_ready(procs)
            # A full collection of what this process (the test and its gateway) has built so far, now: its pause
            # (100 ms and more) is the heap's, not the batch's, and would otherwise fall in either window by chance.
            gc.collect()
            tokens: list[float] = []  # when each of B's chunks arrived
            checked: list[float] = []  # when A's batch was sent and answered

            async def stream() -> None:
                async with http.stream("POST", "/v1/chat/completions", headers=b, json={
                        **chat_body("Write a long story."), "max_tokens": 3000, "stream": True}) as resp:
                    assert resp.status_code == 200
                    async for sse in resp.aiter_lines():
                        if sse.startswith("data: {"):
                            tokens.append(time.perf_counter())
                        if len(checked) == 2 and tokens[-1] > checked[1] + 0.3:
                            return

            streaming = asyncio.create_task(stream())
            await async_wait_until(lambda: len(tokens) > 100 and tokens[-1] - tokens[0] > 1.5, timeout=30,
                                   interval=0.05, message="B's stream did not start")
            checked.append(time.perf_counter())
            refused = await http.post("/v1/batches", headers=a, json={
                "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})
            checked.append(time.perf_counter())
            await asyncio.wait_for(streaming, timeout=60)
    finally:
        await runner.stop()
    assert refused.status_code == 400 and "line 10000" in refused.json()["error"]["message"], refused.text
    gaps = [(t0, t1 - t0) for t0, t1 in zip(tokens, tokens[1:], strict=False)]
    before = max(gap for t0, gap in gaps[1:] if t0 + gap < checked[0])
    during = max(gap for t0, gap in gaps if t0 + gap > checked[0] and t0 < checked[1])
    assert tokens[-1] > checked[1], "B's stream ended before A's batch was checked"
    # A turn of checking is 2 ms plus one line (bounded as one request's body); a token's way through this one event
    # loop (the worker's stream read, the SSE write, this client's read) waits a turn at most at each step, so a few
    # turns at worst: within the 20 ms the issue allows. Measured against B's own gaps before, on this machine.
    assert during <= before + 0.020, (during, before, checked[1] - checked[0])


@contextlib.asynccontextmanager
async def grpc_gateway(procs: Procs, grpc_port: int) -> AsyncIterator[None]:
    """An in-process gateway serving gRPC on ``grpc_port`` in front of the test scheduler, with jobs enabled."""
    keys = json.dumps({"keys": [{"key": API_KEY, "tenant": "batch", "max_priority": "P0"}]})
    settings = procs.settings(api_keys=keys, grpc_port=grpc_port, http_port=0, models_cache_s=0.0,
                              drain_grace_s=0.5)
    runner = build_gateway(settings, CollectorRegistry(), None)
    await runner.start()
    try:
        yield
    finally:
        await runner.stop()


async def test_grpc_sheds_p2_with_resource_exhausted_retry_after_and_a_job(procs: Procs, queue: JobQueue) -> None:
    from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    await scheduler_ready(procs)
    grpc_port = free_port()
    async with grpc_gateway(procs, grpc_port):
        async with aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.GenerateRequest(
                messages=[types_pb2.ChatMessage(role="user", content="Classify these tickets.")],
                sampling=types_pb2.SamplingParams(max_tokens=5), priority=types_pb2.PRIORITY_P2)
            metadata = (("authorization", f"Bearer {API_KEY}"),)

            # gRPC shares subchannels between a process's channels of the same target and options: the previous
            # test's in-process gateway left the one to this (restarted) scheduler in its reconnect backoff (up to
            # 2 s), so this gateway's first calls may fail UNAVAILABLE. Until it lists the scheduler's models:
            async def reaches_the_scheduler() -> bool:
                try:
                    listed = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=5)
                except grpc.RpcError:
                    return False
                return bool(listed.models)
            await async_wait_until(reaches_the_scheduler, timeout=30, interval=0.2,
                                   message="the gateway never reached the scheduler")
            async with Overload(procs.scheduler_addr) as load:
                job_ids = []
                for call in (stub.Generate(request, metadata=metadata, timeout=20),
                             stub.GenerateStream(request, metadata=metadata, timeout=20)):
                    with pytest.raises(grpc.RpcError) as shed:
                        if isinstance(call, aio.UnaryStreamCall):
                            async for _ in call:
                                pass
                        else:
                            await call
                    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    trailers = dict(shed.value.trailing_metadata() or ())
                    assert float(trailers["retry-after"]) > 0
                    job_ids.append(trailers["x-goodput-job-id"])
                await load.release()
            for job_id in job_ids:  # not lost: both finish once the overload is gone, with the same answer shape
                done = await wait_job(queue, job_id, lambda j: j.state == "completed")
                assert done.tenant == "batch" and done.route == "chat"
                assert done.result["usage"]["completion_tokens"] == 5
            # a P0 request is never parked: shed or not, it is the caller's to retry
            assert "x-goodput-job-id" not in dict((await stub.Generate(
                gateway_pb2.GenerateRequest(messages=request.messages, sampling=request.sampling,
                                            priority=types_pb2.PRIORITY_P0),
                metadata=metadata, timeout=20, wait_for_ready=True).trailing_metadata()) or ())


async def test_grpc_stream_cancelled_after_its_start_message_releases_the_worker(procs: Procs, queue: JobQueue) -> None:
    """A caller that reads only the start message (e.g. to see the RAG sources) and cancels must not hold the
    worker's slot: the scheduler's only slot is free again at once, not when the generation would have ended."""
    from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    grpc_port = free_port()
    async with grpc_gateway(procs, grpc_port):
        async with aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, \
                aio.insecure_channel(procs.scheduler_addr) as sched_channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            scheduler = scheduler_pb2_grpc.SchedulerStub(sched_channel)
            request = gateway_pb2.GenerateRequest(
                messages=[types_pb2.ChatMessage(role="user", content="Write a long story.")],
                sampling=types_pb2.SamplingParams(max_tokens=3000), priority=types_pb2.PRIORITY_P0)
            async with Overload(procs.scheduler_addr) as hold:  # waits until the scheduler has a healthy worker
                await hold.release()
            # The released holds are gone from the scheduler's books: its only slot is free for this stream.
            await async_wait_until(lambda: has_healthy_worker(scheduler, idle=True), timeout=10,
                                   message="the scheduler's worker did not become idle")
            call = stub.GenerateStream(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)
            first = await call.read()
            assert first.HasField("start")

            async def inflight() -> int:
                resp = await scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
                return sum(w.inflight for w in resp.workers)
            assert await inflight() == 1
            call.cancel()

            async def released() -> bool:
                return await inflight() == 0
            await async_wait_until(released, timeout=5, interval=0.1,
                                   message="the cancelled stream still holds its lease")


async def test_job_bodies_are_checked_when_submitted(redis_url: str, redis_prefix: str) -> None:
    keys = json.dumps({"keys": [{"key": API_KEY, "tenant": "batch", "max_priority": "P2"}]})
    settings = GatewaySettings(redis_url=redis_url, api_keys=keys, grpc_port=0, http_port=0,
                               jobs={"prefix": redis_prefix}, quotas={"prefix": f"{redis_prefix}:quota"},
                               metering={"usage_prefix": f"{redis_prefix}:usage"})
    runner = build_gateway(settings, CollectorRegistry(), None)
    transport = httpx.ASGITransport(app=runner.http_app)  # the same app uvicorn serves
    async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for body, param, code in (
                ({"body": {**chat_body(), "audio": {"voice": "alloy"}}}, "body.audio", "unsupported_parameter"),
                ({"body": {"messages": []}}, "body.messages", "invalid_value"),
                ({"endpoint": "/v1/completions", "body": {"prompt": 5}}, "body.prompt", "invalid_type"),
                ({"endpoint": "/v1/embeddings", "body": {"input": "a"}}, "endpoint", "invalid_value"),
                ({"body": chat_body(), "callback_url": "http://x"}, "callback_url", "unsupported_parameter"),
                ({"endpoint": "/v1/chat/completions"}, "body", "missing_required_parameter")):
            resp = await http.post("/v1/jobs", json=body)
            assert resp.status_code == 400, resp.text
            assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)
