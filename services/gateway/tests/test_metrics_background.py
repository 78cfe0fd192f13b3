"""/metrics never waits on Redis: the jobs gauges are read in the background and a scrape serves the last values.

The hung store is a real TCP server that accepts connections and never answers (what a Redis stuck in a long
command or behind a dead network looks like to its clients), not a mock.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from goodput_testing import async_wait_until, free_port

from goodput_gateway.__main__ import build
from goodput_gateway.config import GatewaySettings
from goodput_gateway.jobs import JobQueue, JobsMetrics

API_KEY = "sk-metrics-test"


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """``redis://`` of a server that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in accepted:
            conn.close()
        listener.close()


def _settings(**overrides: Any) -> GatewaySettings:
    keys = json.dumps({"keys": [{"key": API_KEY, "tenant": "acme", "max_priority": "P0"}]})
    return GatewaySettings(**{"api_keys": keys, "grpc_port": 0, "http_port": free_port(), "metrics_port": free_port(),
                              "scheduler_addr": "127.0.0.1:1", "drain_grace_s": 0.5, **overrides})


def _queue(url: str, prefix: str, registry: CollectorRegistry) -> JobQueue:
    settings = _settings(redis_url=url, jobs={"prefix": prefix})
    return JobQueue(settings, redis.Redis.from_url(url, socket_timeout=2), registry=registry,
                    send=lambda job_id, dispatch, delay_s: None)


async def test_a_scrape_serves_the_last_values_at_once_while_redis_hangs(
        redis_url: str, redis_prefix: str, silent_redis: str) -> None:
    registry = CollectorRegistry()
    queue = _queue(redis_url, redis_prefix, registry)
    queue.submit(tenant="acme", route="chat", body={"messages": []})
    readings = queue.metrics.readings
    assert readings is not None
    readings.timeout_s, readings.interval_s = 0.2, 0.05
    assert await readings.refresh_async()
    assert registry.get_sample_value("goodput_gateway_deferred_jobs", {"state": "queued"}) == 1
    assert registry.get_sample_value("goodput_gateway_deferred_job_attempts_total", {"outcome": "completed"}) == 0

    queue.redis = redis.Redis.from_url(silent_redis, socket_timeout=2)  # the store now hangs on every command
    readings.start()
    try:
        await async_wait_until(
            lambda: registry.get_sample_value("goodput_store_readings_failures_total", {"source": "gateway_jobs"}),
            timeout=5, message="the hung reads were not given up")
        started = time.perf_counter()
        text = generate_latest(registry).decode()
        assert time.perf_counter() - started < 0.1  # memory only: the scrape does not wait for the socket timeout
        assert 'goodput_gateway_deferred_jobs{state="queued"} 1.0' in text  # the last value is kept
        age = registry.get_sample_value("goodput_store_readings_age_seconds", {"source": "gateway_jobs"})
        assert age is not None and age > 0.1  # and the scrape says how stale it is
    finally:
        await readings.stop()


def test_a_worker_scrape_reads_fresh_values_but_waits_a_bounded_time_on_a_hung_redis(
        redis_url: str, redis_prefix: str, silent_redis: str) -> None:
    # A jobs worker's metrics server is a thread of its own: a scrape starts a round and waits for it briefly.
    registry = CollectorRegistry()
    queue = _queue(redis_url, redis_prefix, CollectorRegistry())
    JobsMetrics(registry, queue, scrape_wait_s=0.3)
    queue.submit(tenant="acme", route="chat", body={"messages": []})
    assert registry.get_sample_value("goodput_gateway_deferred_jobs", {"state": "queued"}) == 1  # fresh
    queue.redis = redis.Redis.from_url(silent_redis, socket_timeout=2)
    for _ in range(3):  # one hung read is out at a time; every scrape still answers within its budget
        started = time.perf_counter()
        text = generate_latest(registry).decode()
        assert time.perf_counter() - started < 1.0
        assert 'goodput_gateway_deferred_jobs{state="queued"} 1.0' in text
    assert (registry.get_sample_value("goodput_store_readings_failures_total", {"source": "gateway_jobs"}) or 0) >= 3


async def test_gateway_metrics_and_probes_answer_at_once_while_redis_hangs(silent_redis: str) -> None:
    settings = _settings(redis_url=silent_redis, jobs={"park_shed_p2": True})
    registry = CollectorRegistry()
    runner = build(settings, registry, None)
    await runner.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.metrics_port}", timeout=10) as http:
            for _ in range(3):
                started = time.perf_counter()
                metrics = await http.get("/metrics")
                assert metrics.status_code == 200
                assert time.perf_counter() - started < 0.5
                # Never read: no value yet, and the age says so (inf), rather than a scrape that waits.
                assert 'goodput_gateway_deferred_jobs{state="queued"} NaN' in metrics.text
                assert 'goodput_store_readings_age_seconds{source="gateway_jobs"} +Inf' in metrics.text
                # The event loop is free meanwhile: other requests are answered at once.
                started = time.perf_counter()
                assert (await http.get("/healthz")).status_code == 200
                assert time.perf_counter() - started < 0.5
                await asyncio.sleep(0.3)
    finally:
        await runner.stop()


async def test_metrics_are_on_the_metrics_port_never_on_the_public_rest_port() -> None:
    # Tenants' and keys' counts are the operator's: by default the gateway has a metrics port apart from REST,
    # and one that is the REST port is refused at start.
    defaults = GatewaySettings.model_fields
    assert defaults["metrics_port"].default and defaults["metrics_port"].default != defaults["http_port"].default
    with pytest.raises(ValidationError, match="metrics_port 8080 is the public REST port"):
        GatewaySettings(http_port=8080, metrics_port=8080)
    settings = _settings()
    runner = build(settings, CollectorRegistry(), None)
    await runner.start()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            rest = f"http://127.0.0.1:{settings.http_port}"
            ops = f"http://127.0.0.1:{settings.metrics_port}"
            assert (await http.get(f"{rest}/metrics")).status_code == 404
            assert (await http.get(f"{rest}/healthz")).status_code == 200
            scraped = await http.get(f"{ops}/metrics")
            assert scraped.status_code == 200 and "goodput_gateway_requests_total" in scraped.text
            assert (await http.get(f"{ops}/healthz")).status_code == 200
    finally:
        await runner.stop()
