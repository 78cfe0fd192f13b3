"""Tenants, black-box, against two gateway replicas sharing one real Redis: each tenant's limits hold exactly across
the replicas, a spent budget answers ``insufficient_quota``, a rotated key stops working without a restart (a stream
in flight finishes), usage is metered and each tenant reads only its own.

The platform is real processes on localhost (two gateways, the scheduler, a simulated inference worker:
``GOODPUT_INFERENCE_ENGINE=sim``, which reports ``max_tokens`` completion tokens and about 4 characters per prompt
token), so no model is needed. Quota and usage keys live under prefixes of this module's own, removed after it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
import redis
from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_testing import delete_keys, wait_until

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 3900
RPM, TPM, BUDGET, CONCURRENT = 6, 1000, 400, 2
KEYS = {name: f"test-key-{name}-{uuid.uuid4().hex[:8]}"
        for name in ("rpm", "tpm", "budget", "concurrent", "rotate", "rotated", "operator", "grpc")}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_document(*, rotated: bool = False) -> dict[str, Any]:
    """One tenant per limit under test, so the tests do not share counters; ``rotated``: the rotate tenant's key
    replaced by a new one, as an SRE's rotation does."""
    rotate_key = KEYS["rotated"] if rotated else KEYS["rotate"]
    return {
        "defaults": {"rpm": 1000},
        "tenants": {"rpm-team": {"rpm": RPM}, "tpm-team": {"tpm": TPM}, "budget-team": {"monthly_tokens": BUDGET},
                    "concurrent-team": {"max_concurrent": CONCURRENT}, "grpc-team": {"rpm": 1}},
        "keys": [{"id": name, "key_sha256": _sha(KEYS[name]), "tenant": f"{name}-team", "max_priority": "P0"}
                 for name in ("rpm", "tpm", "budget", "concurrent", "grpc")]
        + [{"id": "rotate", "key_sha256": _sha(rotate_key), "tenant": "rotate-team", "max_priority": "P0"},
           {"id": "ops", "key_sha256": _sha(KEYS["operator"]), "tenant": "ops", "operator": True}],
    }


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    run = uuid.uuid4().hex[:8]
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_SIM_CONFIG": json.dumps({"time_scale": 0.5}),
           "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5", "GOODPUT_GATEWAY_API_KEYS_RELOAD_S": "0.5",
           "GOODPUT_GATEWAY_QUOTAS__PREFIX": f"goodput:quota:test-{run}",
           "GOODPUT_GATEWAY_METERING__USAGE_PREFIX": f"goodput:usage:test-{run}",
           "GOODPUT_GATEWAY_METERING__FLUSH_S": "0.2"}
    p = Platform(workdir=tmp_path_factory.mktemp("tenancy"), workers=1, gateways=2, port_offset=PORT_OFFSET,
                 env=env, api_keys=keys_document(), knowledge=False, cache=False, jobs=False)
    with p:
        yield p
    for prefix in (env["GOODPUT_GATEWAY_QUOTAS__PREFIX"], env["GOODPUT_GATEWAY_METERING__USAGE_PREFIX"]):
        delete_keys(p.redis_url, prefix + ":")


def replicas(platform: Platform) -> list[str]:
    return [platform.gateway_http_at(0), platform.gateway_http_at(1)]


def chat(key: str, base_url: str, *, max_tokens: int = 4, stream: bool = False, timeout: float = 30) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": max_tokens, "stream": stream}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def assert_rate_limit_headers(resp: httpx.Response, kind: str, limit: int) -> None:
    assert resp.headers[f"x-ratelimit-limit-{kind}"] == str(limit)
    assert int(resp.headers[f"x-ratelimit-remaining-{kind}"]) >= 0
    reset = resp.headers[f"x-ratelimit-reset-{kind}"]
    assert reset.endswith(("ms", "s")) and reset[0].isdigit(), reset


def refusal(resp: httpx.Response, code: str) -> dict[str, Any]:
    assert resp.status_code == 429, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["code"] == code and error["type"] == "rate_limit_error", error
    assert int(resp.headers["retry-after"]) >= 1
    return error


def test_a_tenant_limited_to_n_per_minute_gets_exactly_n_across_two_replicas(platform: Platform) -> None:
    urls = replicas(platform)
    with ThreadPoolExecutor(max_workers=3 * RPM) as pool:  # 3N at once, spread over both replicas
        responses = list(pool.map(lambda i: chat(KEYS["rpm"], urls[i % 2]), range(3 * RPM)))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(admitted) == RPM, [r.status_code for r in responses]
    assert len(refused) == 2 * RPM
    for r in refused:
        refusal(r, "rate_limit_exceeded")
        assert_rate_limit_headers(r, "requests", RPM)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    for r in admitted:  # every admitted response carries the headers too
        assert_rate_limit_headers(r, "requests", RPM)
    # what was left when each was admitted (read just after its own hit, so concurrent ones may see the same)
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in admitted)
    assert remaining[0] == 0 and remaining[-1] <= RPM - 1
    # another tenant is not touched by this one's refusals
    assert chat(KEYS["tpm"], urls[0]).status_code == 200


def tpm_window(platform: Platform) -> tuple[float, int, int, int]:
    """The tpm-team's sliding-window counter in Redis: the seconds left in the current minute, its minute, and the
    current and previous minute's counts."""
    prefix = platform.env["GOODPUT_GATEWAY_QUOTAS__PREFIX"]
    with redis.Redis.from_url(platform.redis_url) as r:
        seconds, micros = r.time()
        counts = r.hgetall(f"{prefix}:tenant:tpm-team:tpm")
    now = seconds + micros / 1e6
    window = int(now // 60)
    return (window + 1) * 60 - now, window, int(counts.get(str(window).encode(), 0)), \
        int(counts.get(str(window - 1).encode(), 0))


def test_tokens_per_minute_count_the_tokens_really_used(platform: Platform) -> None:
    urls = replicas(platform)
    left_s, window, counted, _ = tpm_window(platform)
    if left_s < 30:  # the requests below settle within one minute's count (a few seconds in all)
        time.sleep(left_s + 0.1)
        left_s, window, counted, _ = tpm_window(platform)
    for i in range(TPM):  # bounded: each request uses well over one token
        resp = chat(KEYS["tpm"], urls[i % 2], max_tokens=150)
        if resp.status_code != 200:
            break
        assert_rate_limit_headers(resp, "tokens", TPM)
        usage = resp.json()["usage"]
        assert usage["completion_tokens"] == 150
        counted += usage["total_tokens"]
        # the minute's count holds what the worker reported (prompt + completion), not the reservation
        wait_until(lambda counted=counted: tpm_window(platform)[1:3] == (window, counted), timeout=10,
                   message=f"the tokens-per-minute counter never reached {counted} in its minute")
    error = refusal(resp, "rate_limit_exceeded")
    assert "tokens per minute" in error["message"]
    # refused only once what was used left no room for this request's reservation: 150 and a short prompt
    remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    assert remaining < 150 + 50 and remaining <= TPM - counted
    assert_rate_limit_headers(resp, "tokens", TPM)


def test_a_spent_monthly_budget_is_insufficient_quota_on_every_replica(platform: Platform) -> None:
    urls = replicas(platform)
    used = 0
    for i in range(40):
        resp = chat(KEYS["budget"], urls[i % 2], max_tokens=100)
        if resp.status_code == 429:
            if used >= BUDGET:
                break
            time.sleep(1.1)  # the previous answer's reservation, not yet settled, filled the month: try again
            continue
        assert resp.status_code == 200, resp.text
        used += resp.json()["usage"]["total_tokens"]
    assert BUDGET <= used <= BUDGET + 100 + 50  # passed by at most one reservation (100 and a short prompt)
    error = refusal(resp, "insufficient_quota")
    assert "monthly budget" in error["message"]
    refusal(chat(KEYS["budget"], urls[1], max_tokens=1), "insufficient_quota")
    # the budget is the tenant's alone: another tenant is served
    assert chat(KEYS["concurrent"], urls[1], max_tokens=1).status_code == 200


def test_concurrent_streams_are_bounded_across_replicas(platform: Platform) -> None:
    urls = replicas(platform)
    headers = {"Authorization": f"Bearer {KEYS['concurrent']}"}
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=60, headers=headers) as client:
        with client.stream("POST", urls[0] + "/v1/chat/completions", json=body) as s0, \
                client.stream("POST", urls[1] + "/v1/chat/completions", json=body) as s1:
            assert s0.status_code == 200 and s1.status_code == 200
            third = chat(KEYS["concurrent"], urls[0])
            error = refusal(third, "rate_limit_exceeded")
            assert f"{CONCURRENT} requests in flight" in error["message"]
        # both streams closed by the client: their places come back
        wait_until(lambda: chat(KEYS["concurrent"], urls[1]).status_code == 200, timeout=15,
                   message="the closed streams' places never came back")


def test_a_rotated_key_stops_working_without_a_restart_and_its_stream_finishes(platform: Platform) -> None:
    urls = replicas(platform)
    pids = (platform.pid("gateway"), platform.pid("gateway-1"))
    body = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 300, "stream": True}
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", urls[0] + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['rotate']}"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                started.set()
                if line:  # events are separated by blank lines
                    lines.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    platform.api_keys_file.write_text(json.dumps(keys_document(rotated=True)))  # the SRE's rotation
    for url in urls:
        wait_until(lambda url=url: chat(KEYS["rotate"], url).status_code == 401, timeout=10,
                   message=f"the old key still works on {url}")
        assert chat(KEYS["rotated"], url).status_code == 200
    reader.join(60)
    assert lines and lines[-1] == "data: [DONE]"  # the stream that began with the old key was not cut
    assert sum(1 for line in lines if line.startswith("data: {")) > 2
    assert (platform.pid("gateway"), platform.pid("gateway-1")) == pids  # no restart


def usage(platform: Platform, key: str, replica: int = 0, **params: str) -> httpx.Response:
    return httpx.get(platform.gateway_http_at(replica) + "/v1/usage", params=params, timeout=10,
                     headers={"Authorization": f"Bearer {key}"})


def test_usage_is_metered_per_tenant_and_readable_only_by_its_own(platform: Platform) -> None:
    before = time.time()
    for i in range(3):
        assert chat(KEYS["rotated"], platform.gateway_http_at(i % 2), max_tokens=7).status_code == 200

    def metered() -> dict[str, Any] | None:
        body = usage(platform, KEYS["rotated"], replica=1).json()
        rows = body["data"]
        return body if rows and rows[0]["requests"] >= 3 else None

    body = wait_until(metered, timeout=10, message="the requests were never metered")
    assert body["tenant"] == "rotate-team" and body["period"] == time.strftime("%Y-%m", time.gmtime(before))
    row = body["data"][0]
    assert row["tenant"] == "rotate-team" and row["model"]
    assert row["completion_tokens"] >= 3 * 7 and row["prompt_tokens"] > 0 and row["gpu_seconds"] > 0
    # another tenant's usage: refused by name for a tenant key, served for the operator's
    denied = usage(platform, KEYS["rotated"], tenant="rpm-team")
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "tenant"
    everyone = usage(platform, KEYS["operator"], tenant="*").json()
    tenants = {row["tenant"] for row in everyone["data"]}
    assert {"rotate-team", "rpm-team"} <= tenants
    assert usage(platform, KEYS["rotated"], period="2026-13").status_code == 400
    assert usage(platform, "not-a-key").status_code == 401


def test_grpc_refusals_carry_the_limits_in_trailing_metadata(platform: Platform) -> None:
    request = gateway_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(role="user", content="hi")],
                                          sampling=types_pb2.SamplingParams(max_tokens=2))
    md = (("authorization", f"Bearer {KEYS['grpc']}"),)
    with grpc.insecure_channel(platform.gateway_grpc_at(1)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        _, call = stub.Generate.with_call(request, metadata=md, timeout=30)
        trailing = dict(call.trailing_metadata() or ())
        assert trailing["x-ratelimit-limit-requests"] == "1" and trailing["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(request, metadata=md, timeout=30)
    err = refused.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.trailing_metadata() or ())
    assert trailing["goodput-error-code"] == "rate_limit_exceeded"
    assert float(trailing["retry-after"]) > 0
    assert trailing["x-ratelimit-limit-requests"] == "1" and trailing["x-ratelimit-remaining-requests"] == "0"
