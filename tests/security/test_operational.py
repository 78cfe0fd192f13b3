"""Operational safety: a gateway told to stop (SIGTERM, as Kubernetes does on a rollout) finishes the streams it is
serving within its drain grace and refuses new work meanwhile.

The platform is real processes on localhost with simulated inference workers (``GOODPUT_INFERENCE_ENGINE=sim``,
slowed down so that one answer takes several seconds), so no model is needed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PORT_OFFSET = 3200
API_KEY = "test-key-operational"
# 12 ms a decode step x 20: ~0.25 s a token, so 32 tokens stream for ~8 s (past the 5 s that used to cut them).
SIM = '{"time_scale": 20}'
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    import hashlib

    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": SIM,
           "GOODPUT_GATEWAY_DRAIN_GRACE_S": "30", "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    keys = [{"key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest(), "tenant": "ops", "max_priority": "P0"}]
    p = Platform(workdir=tmp_path_factory.mktemp("operational"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=False)
    with p:  # started here, stopped after the module's tests
        yield p


def _body() -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": MAX_TOKENS, "temperature": 0}


def test_sigterm_lets_rest_and_grpc_streams_finish_and_refuses_new_requests(platform: Platform) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    lines: list[str] = []
    errors: list[BaseException] = []
    first_chunk = threading.Event()

    def stream() -> None:
        try:
            with httpx.Client(base_url=platform.gateway_http, headers=headers, timeout=60) as http:
                with http.stream("POST", "/v1/chat/completions", json=_body()) as response:
                    assert response.status_code == 200, response.read()
                    for line in response.iter_lines():
                        if line:
                            lines.append(line)
                            first_chunk.set()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)
            first_chunk.set()

    grpc_events: list[str] = []
    grpc_first = threading.Event()

    def grpc_stream() -> None:
        request = gateway_pb2.GenerateRequest(
            messages=[types_pb2.ChatMessage(role="user", content="Tell me a long story.")],
            sampling=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        try:
            with grpc.insecure_channel(platform.gateway_grpc) as ch:
                for event in gateway_pb2_grpc.GatewayStub(ch).GenerateStream(
                        request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60):
                    grpc_events.append(event.WhichOneof("kind") or "")
                    grpc_first.set()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)
            grpc_first.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    grpc_reader = threading.Thread(target=grpc_stream, daemon=True)
    grpc_reader.start()
    assert first_chunk.wait(30), "the stream did not start"
    assert grpc_first.wait(30), "the gRPC stream did not start"
    time.sleep(1.0)  # well inside the answer: tokens are still coming
    gateway = platform.pid("gateway")
    assert gateway is not None
    signalled = time.monotonic()
    os.kill(gateway, signal.SIGTERM)

    with httpx.Client(base_url=platform.gateway_http, headers=headers, timeout=10) as http:
        # Readiness turns off at once, so Kubernetes takes the pod out of the Service's endpoints...
        health = wait_until(lambda: (r := http.get("/healthz")).status_code == 503 and r, timeout=5,
                            message="/healthz did not turn 503 on SIGTERM")
        assert health.json()["status"] == "not ready"
        # ...and a request that still arrives is refused with a retryable 503, not started.
        refused = http.post("/v1/chat/completions", json={**_body(), "stream": False})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "unavailable"
        assert refused.headers["Retry-After"]

    reader.join(timeout=60)
    grpc_reader.join(timeout=60)
    assert not reader.is_alive() and not grpc_reader.is_alive() and not errors, errors
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert grpc_events[-1] == "end" and grpc_events.count("delta") > 1, grpc_events[-3:]  # gRPC finished too
    assert time.monotonic() - signalled > 5.0  # the stream outlived the old 5 s cut, within the 30 s grace
    proc_exited = wait_until(lambda: "gateway" in platform.exited() and platform.exited()["gateway"] == 0 or None,
                             timeout=30, message="the gateway did not exit cleanly after the drain")
    assert proc_exited
    log = Path(platform.log_path("gateway")).read_text()
    assert "InvalidStateError" not in log and "RPC already finished" not in log
