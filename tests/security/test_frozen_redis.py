"""A frozen Redis during a scrape, black box: the gateway's `/metrics` is unauthenticated and its jobs gauges come
from Redis; a Redis that stops answering must cost neither the scrape nor the streams the same event loop serves.

The platform runs on a Redis of its own (a throwaway redis-server), which the test freezes with `CLIENT PAUSE ...
ALL` (every other client's command waits) while a stream is in flight and Prometheus scrapes. Simulated workers,
slowed so that one answer takes seconds.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from goodput_testing import RedisServer

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PORT_OFFSET = 3700
API_KEY = "test-key-frozen-redis"
FREEZE_S = 4


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, server: RedisServer) -> Iterator[Platform]:
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": '{"time_scale": 20}',
           "GOODPUT_REDIS_URL": server.url, "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    keys = [{"key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest(), "tenant": "ops", "max_priority": "P0"}]
    p = Platform(workdir=tmp_path_factory.mktemp("frozen-redis"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=True)
    with p:  # started here, stopped after the module's tests
        yield p


def test_a_frozen_redis_stalls_neither_a_scrape_nor_a_stream(platform: Platform, server: RedisServer) -> None:
    # the Redis-backed gauges are there
    assert "goodput_gateway_deferred_jobs" in httpx.get(platform.gateway_metrics, timeout=10).text
    arrivals: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                "max_tokens": 32, "temperature": 0}
        with httpx.stream("POST", platform.gateway_http + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                if line == "data: [DONE]":
                    done.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while not arrivals:
        time.sleep(0.05)
    frozen_at = time.monotonic()
    assert redis.Redis.from_url(server.url).execute_command("CLIENT", "PAUSE", FREEZE_S * 1000, "ALL")
    with pytest.raises(redis.TimeoutError):  # the freeze is real: a read waits
        redis.Redis.from_url(server.url, socket_timeout=0.5).get("any")
    started = time.monotonic()
    scrape = httpx.get(platform.gateway_metrics, timeout=FREEZE_S + 5)
    scrape_s = time.monotonic() - started
    reader.join(60)

    assert scrape.status_code == 200 and "goodput_gateway_deferred_jobs" in scrape.text
    assert scrape_s < FREEZE_S / 2, f"the scrape waited {scrape_s:.1f} s on the frozen Redis"
    during = [t for t in arrivals if frozen_at + 0.5 < t < frozen_at + FREEZE_S]
    assert during, "tokens kept streaming while Redis was frozen"
    assert done.is_set(), "the stream finished with [DONE]"
