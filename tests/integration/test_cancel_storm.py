"""Many queued streams cancelled at once (clients that all give up together) leave the gateway's log clean — no
"Task was destroyed but it is pending", no "aclose(): asynchronous generator is already running" — and every lease
and queued request goes back (the scheduler holds nothing afterwards). Real processes on localhost with a simulated,
slowed worker that takes two requests at a time, so the rest wait in the scheduler's queue."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator

import httpx
import pytest
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_testing import async_wait_until

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 4600
API_KEY = "test-key-cancel-storm"
STREAMS = 40
BAD = ("Task was destroyed but it is pending", "asynchronous generator is already running", "Traceback")


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": '{"time_scale": 20}',
           "GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER": "2", "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    keys = [{"key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest(), "tenant": "storm", "max_priority": "P0"}]
    p = Platform(workdir=tmp_path_factory.mktemp("cancel-storm"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=False)
    with p:
        yield p


async def test_cancelling_many_queued_streams_leaves_the_log_clean(platform: Platform) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True, "max_tokens": 64}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Goodput-Priority": "P0"}
    limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS + 4)

    async def stream(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            async for _ in response.aiter_lines():
                pass

    channel = platform.internal_channel(platform.scheduler_grpc)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def held() -> int:
        listed = await asyncio.to_thread(stub.ListWorkers, scheduler_pb2.ListWorkersRequest(), timeout=2)
        return sum(w.inflight for w in listed.workers)

    before = platform.log_path("gateway").read_text(errors="replace")
    async with httpx.AsyncClient(base_url=platform.gateway_http, timeout=120, limits=limits) as http:
        tasks = [asyncio.ensure_future(stream(http)) for _ in range(STREAMS)]
        await async_wait_until(lambda: _equals(held(), 2), timeout=30, interval=0.1,
                               message="the worker's two places are taken, the rest queue")
        await asyncio.sleep(1.0)
        for t in tasks:  # every client gives up at once
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await async_wait_until(lambda: _equals(held(), 0), timeout=30, interval=0.1,
                           message="every lease returned after the cancellations")
    await asyncio.sleep(1.0)  # what the gateway logs while it cleans up
    channel.close()
    logged = platform.log_path("gateway").read_text(errors="replace")[len(before):]
    found = [line for line in logged.splitlines() if any(b in line for b in BAD)]
    assert not found, "\n".join(found[:5])


async def _equals(value: object, expected: int) -> bool:
    return await value == expected  # type: ignore[misc]
