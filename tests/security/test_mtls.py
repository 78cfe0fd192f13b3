"""The internal trust boundary, black box: a real local platform (simulated inference worker, so it starts in
seconds) whose internal gRPC ports serve mutual TLS and authorize every call by the caller's certificate.

What an attacker on the network can try: call an internal service without a certificate, with a certificate from
another CA, with a stolen certificate of one service on a method it may not call (a fake worker registration, a
generation asked by the scheduler). Each is refused, and a refusal by identity is counted.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest
from goodput.cache.v1 import cache_pb2, cache_pb2_grpc
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from goodput_core.tls import ensure_dev_pki
from goodput_testing import delete_keys

from goodput_cli.plan import HOST, http_port
from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 2300
API_KEY = "test-key-mtls"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    import hashlib

    # The response cache runs too (its own Redis keys, removed at the end): the gateway's lookups and stores go
    # over mTLS, and it is where a tenant named by the wrong peer is refused.
    cache_prefix = f"goodput:cache:mtls-{uuid.uuid4().hex[:8]}"
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5",
           "GOODPUT_CACHE_KEY_PREFIX": cache_prefix}
    keys = [{"key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest(), "tenant": "mtls", "max_priority": "P0"}]
    p = Platform(workdir=tmp_path_factory.mktemp("mtls"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=True, jobs=False)
    try:
        with p:  # started here, stopped after the module's tests
            yield p
    finally:
        delete_keys(p.redis_url, cache_prefix + ":")


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def _denied(metrics_url: str, service: str, method: str, peer: str, reason: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    pattern = (rf'^goodput_authz_denied_total\{{(?=[^}}]*service="{service}")(?=[^}}]*method="{method}")'
               rf'(?=[^}}]*peer="{peer}")(?=[^}}]*reason="{reason}")[^}}]*\}} (\S+)$')
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_legit_path_works_over_mtls(platform: Platform) -> None:
    reply = httpx.post(platform.gateway_http + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    with platform.internal_channel(platform.scheduler_grpc) as ch:  # the operator's certificate
        workers = scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
    assert [w.healthy for w in workers.workers] == [True]
    # The gateway's public gRPC port needs no certificate (product teams use API keys).
    with grpc.insecure_channel(platform.gateway_grpc) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", ["scheduler", "worker"])
def test_a_call_without_a_certificate_is_refused_at_the_handshake(platform: Platform, service: str) -> None:
    address = platform.scheduler_grpc if service == "scheduler" else platform.worker_grpc(0)
    with grpc.insecure_channel(address) as ch:
        assert _code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                  timeout=3)) == grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the server but presents no client certificate: refused too.
    ca = platform.tls_files().ca.read_bytes()
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
        assert _code(lambda: scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=3)) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(platform: Platform, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A "gateway" certificate made by someone else's CA, presented to a client that trusts the platform's CA.
    forged = ensure_dev_pki(tmp_path, ["gateway"])["gateway"]
    cert, key, _ = forged.read()
    creds = grpc.ssl_channel_credentials(root_certificates=platform.tls_files().ca.read_bytes(), private_key=key,
                                         certificate_chain=cert)
    with grpc.secure_channel(platform.scheduler_grpc, creds) as ch:
        assert _code(lambda: scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=3)) == grpc.StatusCode.UNAVAILABLE


def test_a_fake_worker_registration_with_the_gateways_certificate_is_denied(platform: Platform) -> None:
    before = _denied(platform.scheduler_http + "/metrics", "scheduler", "RegisterWorker", "gateway", "not_allowed")
    with platform.internal_channel(platform.scheduler_grpc, identity="gateway") as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        assert _code(lambda: stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address="127.0.0.1:1"),
                                                 timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        # The gateway may list the workers, and the fake one is not among them.
        workers = stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers
    assert "127.0.0.1:1" not in [w.address for w in workers]
    after = _denied(platform.scheduler_http + "/metrics", "scheduler", "RegisterWorker", "gateway", "not_allowed")
    assert after == before + 1


def test_a_worker_certificate_cannot_register_another_address_nor_take_a_worker_out(platform: Platform) -> None:
    with platform.internal_channel(platform.scheduler_grpc, identity="inference") as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        # Tenants' prompts pointed at another host: refused, it connects from 127.0.0.1.
        assert _code(lambda: stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address="10.255.0.9:50061"),
                                                 timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    with platform.internal_channel(platform.scheduler_grpc) as ch:  # the operator
        workers = scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
    assert "10.255.0.9:50061" not in [w.address for w in workers.workers]


def test_another_services_certificate_may_not_generate_and_the_refusal_is_counted(platform: Platform) -> None:
    metrics = platform.worker_http(0) + "/metrics"
    before = _denied(metrics, "inference", "Generate", "scheduler", "not_allowed")
    request = inference_pb2.GenerateRequest(request_id="mtls-stolen", prompt="hello", tenant="mtls")
    with platform.internal_channel(platform.worker_grpc(0), identity="scheduler") as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        assert _code(lambda: list(stub.Generate(request, timeout=10))) == grpc.StatusCode.PERMISSION_DENIED
        # What the scheduler may do there: read the worker's load.
        stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
    assert _denied(metrics, "inference", "Generate", "scheduler", "not_allowed") == before + 1
    # The operator may read the model's facts but not generate either.
    with platform.internal_channel(platform.worker_grpc(0)) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=5)
        assert _code(lambda: list(stub.Generate(request, timeout=10))) == grpc.StatusCode.PERMISSION_DENIED


def test_a_tenant_named_by_a_peer_that_does_not_act_for_tenants_is_denied(platform: Platform) -> None:
    metrics = f"http://{HOST}:{http_port('cache', platform.port_offset)}/metrics"
    before = _denied(metrics, "cache", "Stats", "operator", "tenant")
    with platform.internal_channel(platform.cache_grpc) as ch:  # the operator: totals yes, a tenant's numbers no
        stub = cache_pb2_grpc.CacheStub(ch)
        stub.Stats(cache_pb2.StatsRequest(), timeout=5)
        assert _code(lambda: stub.Stats(cache_pb2.StatsRequest(tenant="mtls"),
                                        timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    assert _denied(metrics, "cache", "Stats", "operator", "tenant") == before + 1
    # A stolen retriever certificate cannot read another tenant's cached answers.
    lookup = cache_pb2.LookupRequest(key=cache_pb2.CacheKeyParts(tenant="mtls", model="m", prompt="hello"))
    with platform.internal_channel(platform.cache_grpc, identity="retriever") as ch:
        assert _code(lambda: cache_pb2_grpc.CacheStub(ch).Lookup(lookup, timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
