"""Mutual TLS and authorization by identity, in process: the development CA, a real ServiceRunner serving mTLS, and
the interceptor's decisions (allowed, wrong identity, no identity, tenant named by a peer not acting for tenants)."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from goodput_contracts.access import ACCESS, IDENTITIES, OPEN_SERVICES, TENANT_ACTORS, Rule
from goodput_core import tls
from goodput_core.authz import AuthzInterceptor
from goodput_core.clients import make_channel
from goodput_core.server import ServiceRunner
from goodput_core.settings import ServiceSettings, service_config
from goodput_core.tls import (
    TlsConfigError,
    TlsFiles,
    channel_credentials,
    ensure_dev_pki,
    identity_of,
    identity_prefix,
    tls_files,
)


class Settings(ServiceSettings):
    model_config = service_config("GOODPUT_TEST_")


def _settings(files: TlsFiles | None) -> Settings:
    if files is None:
        return Settings(grpc_port=0, insecure_internal=True)
    return Settings(grpc_port=0, insecure_internal=False, tls_cert_file=str(files.cert), tls_key_file=str(files.key),
                    tls_ca_file=str(files.ca))


# --- the development CA ------------------------------------------------------------------------------------------

def test_dev_pki_names_each_identity_keeps_keys_private_and_is_reused(tmp_path):
    files = ensure_dev_pki(tmp_path, ["scheduler", "jobsWorker"])

    cert = x509.load_pem_x509_certificate(files["jobsWorker"].cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://goodput/default/jobsWorker"]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "goodput.internal"]  # the last is what clients check
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert identity_of(files["scheduler"].cert.read_bytes()) == "scheduler"
    for path in (files["scheduler"].key, files["jobsWorker"].key, tmp_path / "ca-key.pem"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    ensure_dev_pki(tmp_path, ["scheduler", "jobsWorker"])

    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_invalid_certificate_is_issued_again_and_a_new_ca_reissues_all(tmp_path):
    files = ensure_dev_pki(tmp_path, ["cache", "retriever"])
    cache_cert, retriever_cert = files["cache"].cert.read_bytes(), files["retriever"].cert.read_bytes()
    # Someone else's certificate under the cache's name: it does not name the cache.
    files["cache"].cert.write_bytes(retriever_cert)

    ensure_dev_pki(tmp_path, ["cache", "retriever"])

    assert identity_of(files["cache"].cert.read_bytes()) == "cache"
    assert files["cache"].cert.read_bytes() != cache_cert
    assert files["retriever"].cert.read_bytes() == retriever_cert

    (tmp_path / "ca.pem").unlink()
    ensure_dev_pki(tmp_path, ["cache", "retriever"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    leaf = x509.load_pem_x509_certificate(files["retriever"].cert.read_bytes())
    leaf.verify_directly_issued_by(ca)
    assert leaf.not_valid_after_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=30)


def test_tls_is_on_unless_plaintext_is_asked_for(tmp_path):
    with pytest.raises(TlsConfigError, match="GOODPUT_TEST_TLS_CERT_FILE.*GOODPUT_TEST_INSECURE_INTERNAL=true"):
        channel_credentials(Settings(insecure_internal=False))
    assert channel_credentials(Settings(insecure_internal=True)) is None
    files = ensure_dev_pki(tmp_path, ["x"])["x"]
    assert files == tls_files(tmp_path, "x")
    assert channel_credentials(_settings(files)) is not None


def test_the_common_switch_turns_plaintext_on(monkeypatch):
    monkeypatch.setenv("GOODPUT_INSECURE_INTERNAL", "false")
    assert Settings().insecure_internal is False
    monkeypatch.setenv("GOODPUT_INSECURE_INTERNAL", "true")
    assert Settings().insecure_internal is True
    monkeypatch.setenv("GOODPUT_TEST_INSECURE_INTERNAL", "false")  # the service's own setting wins
    assert Settings().insecure_internal is False


def test_the_identity_prefix_is_the_trust_domain_and_release_of_the_settings(monkeypatch):
    assert identity_prefix(Settings()) == "spiffe://goodput/default/"
    monkeypatch.setenv("GOODPUT_TLS_TRUST_DOMAIN", "example.org")
    monkeypatch.setenv("GOODPUT_TLS_RELEASE", "prod/goodput")
    assert identity_prefix(Settings()) == "spiffe://example.org/prod/goodput/"
    monkeypatch.setenv("GOODPUT_TEST_TLS_RELEASE", "staging")  # the service's own setting wins
    assert identity_prefix(Settings()) == "spiffe://example.org/staging/"
    for bad in ("../prod", "prod//x", "a/b/c/d/e", "pr od", ""):
        with pytest.raises(ValidationError):
            Settings(tls_release=bad)
    with pytest.raises(ValidationError):
        Settings(tls_trust_domain="Example.org/x")


def test_the_access_table_names_known_identities_and_believes_streamed_tenants_only_from_tenant_actors():
    for service, rules in ACCESS.items():
        for method, rule in rules.items():
            assert method.startswith("/goodput."), method
            assert rule.callers <= set(IDENTITIES), (service, method)
            assert rule.tenant_from <= rule.callers, (service, method)
    # A stream's tenant is not checked per message: every caller of LeaseBatches must be one that acts for tenants.
    assert ACCESS["scheduler"]["/goodput.scheduler.v1.Scheduler/LeaseBatches"].callers <= TENANT_ACTORS


# --- a real server under mTLS --------------------------------------------------------------------------------------

class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def ListWorkers(self, request, context):  # noqa: N802
        return scheduler_pb2.ListWorkersResponse()

    async def RegisterWorker(self, request, context):  # noqa: N802
        return scheduler_pb2.RegisterWorkerResponse()


@pytest.fixture
def pki(tmp_path):
    files = ensure_dev_pki(tmp_path / "tls", ["scheduler", "gateway", "inference", "operator"])
    other = ensure_dev_pki(tmp_path / "other-ca", ["gateway"])
    return files, other


@pytest.fixture
async def scheduler(pki):
    files, _ = pki
    registry = CollectorRegistry()
    runner = ServiceRunner(name="scheduler", settings=_settings(files["scheduler"]), registry=registry, provider=None)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, _Scheduler(), "goodput.scheduler.v1.Scheduler")
    await runner.start()
    yield f"127.0.0.1:{runner.grpc_port}", registry
    await runner.server.stop(None)


def _denied(registry: CollectorRegistry, method: str, peer: str, reason: str) -> float:
    return registry.get_sample_value("goodput_authz_denied_total", {
        "service": "scheduler", "method": method, "peer": peer, "reason": reason}) or 0.0


def _dial(address: str, files: TlsFiles) -> aio.Channel:
    return make_channel(address, None, credentials=channel_credentials(_settings(files)))


async def test_an_allowed_peer_is_served_and_a_wrong_identity_is_refused_and_counted(scheduler, pki):
    address, registry = scheduler
    files, _ = pki
    async with _dial(address, files["gateway"]) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(address="1.2.3.4:1"),
                                      timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "gateway may not call" in (err.value.details() or "")
        # Health is open to any peer with a certificate from the CA.
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _denied(registry, "RegisterWorker", "gateway", "not_allowed") == 1

    async with _dial(address, files["inference"]) as ch:
        await scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(scheduler_pb2.RegisterWorkerRequest(), timeout=5)


async def test_a_certificate_of_the_same_ca_for_another_release_names_nobody(scheduler, pki, tmp_path):
    # A shared issuer: the same CA signs a "gateway" of the release "staging" (and an "operator" with a common
    # name only, as a hand-made certificate might be); this scheduler serves the release "default".
    address, registry = scheduler
    files, _ = pki
    shared = tmp_path / "staging"
    shared.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        (shared / name).write_bytes((files["gateway"].ca.parent / name).read_bytes())
    staging = ensure_dev_pki(shared, ["gateway"], prefix="spiffe://goodput/staging/")["gateway"]
    assert identity_of(staging.cert.read_bytes()) is None
    assert identity_of(staging.cert.read_bytes(), "spiffe://goodput/staging/") == "gateway"
    async with _dial(address, staging) as ch:
        with pytest.raises(grpc.RpcError) as err:
            await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "spiffe://goodput/default/" in (err.value.details() or "")
    assert _denied(registry, "ListWorkers", "none", "no_identity") == 1


async def test_no_certificate_or_another_ca_is_refused_at_the_handshake(scheduler, pki):
    address, _ = scheduler
    files, other = pki
    async with aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    ca = files["gateway"].ca.read_bytes()
    async with aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A "gateway" certificate from another CA, trusting the server's CA: the server refuses the client.
    cert, key, _ = other["gateway"].read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    async with aio.secure_channel(address, creds) as ch:
        with pytest.raises(grpc.RpcError) as err:
            await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _expired_gateway_cert(folder: Path) -> tuple[bytes, bytes]:
    """A "gateway" certificate signed by the platform's own CA, whose validity ended yesterday."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((folder / "ca-key.pem").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=30)).not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("spiffe://goodput/default/gateway")]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_an_expired_certificate_from_the_right_ca_is_refused(scheduler, pki):
    address, _ = scheduler
    files, _ = pki
    cert, key = _expired_gateway_cert(files["gateway"].ca.parent)
    creds = grpc.ssl_channel_credentials(root_certificates=files["gateway"].ca.read_bytes(), private_key=key,
                                         certificate_chain=cert)
    async with aio.secure_channel(address, creds) as ch:
        with pytest.raises(grpc.RpcError) as err:
            await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# --- the interceptor's decisions, with a table of its own ----------------------------------------------------------

class _Ctx:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise aio.AbortError()


def _spiffe(identity: str, prefix: str = "spiffe://goodput/default/") -> dict[str, list[bytes]]:
    return {"peer_spiffe_id": [f"{prefix}{identity}".encode()]}


async def _call(interceptor: AuthzInterceptor, method: str, request: object, ctx: _Ctx) -> str:
    async def behaviour(request: object, context: object) -> str:
        return "served"

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(behaviour)

    class Details:
        pass

    details = Details()
    details.method = method  # type: ignore[attr-defined]
    handler = await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
    try:
        return await handler.unary_unary(request, ctx)
    except aio.AbortError:
        assert ctx.aborted is not None
        return ctx.aborted[0].name


async def test_a_tenant_is_believed_only_from_a_peer_allowed_to_act_for_tenants():
    from goodput.cache.v1 import cache_pb2

    registry = CollectorRegistry()
    method = "/goodput.cache.v1.Cache/Stats"
    authz = AuthzInterceptor("cache", registry, table={method: Rule(frozenset({"gateway", "operator"}), "tenant")})
    acme = cache_pb2.StatsRequest(tenant="acme")

    assert await _call(authz, method, acme, _Ctx(_spiffe("gateway"))) == "served"
    assert await _call(authz, method, cache_pb2.StatsRequest(), _Ctx(_spiffe("operator"))) == "served"
    assert await _call(authz, method, acme, _Ctx(_spiffe("operator"))) == "PERMISSION_DENIED"
    assert await _call(authz, method, acme, _Ctx(_spiffe("scheduler"))) == "PERMISSION_DENIED"
    assert await _call(authz, method, acme, _Ctx({})) == "UNAUTHENTICATED"
    assert await _call(authz, "/goodput.cache.v1.Cache/Lookup", acme, _Ctx(_spiffe("gateway"))) == "PERMISSION_DENIED"
    assert await _call(authz, f"/{OPEN_SERVICES[0]}/Check", acme, _Ctx(_spiffe("scheduler"))) == "served"
    # Only this release's URI names an identity: a common name, another release's or trust domain's URI, or a
    # path below an identity name nobody.
    for other in ({"x509_common_name": [b"gateway"]}, _spiffe("gateway", "spiffe://goodput/staging/"),
                  _spiffe("gateway", "spiffe://example.org/default/"), _spiffe("x/gateway")):
        assert await _call(authz, method, acme, _Ctx(other)) == "UNAUTHENTICATED"

    def count(peer: str, reason: str, m: str = "Stats") -> float:
        return registry.get_sample_value("goodput_authz_denied_total", {
            "service": "cache", "method": m, "peer": peer, "reason": reason}) or 0.0

    assert count("operator", "tenant") == 1
    assert count("scheduler", "not_allowed") == 1
    assert count("none", "no_identity") == 5
    assert count("gateway", "not_allowed", "Lookup") == 1


def test_every_internal_rpc_of_the_protos_has_a_rule_and_every_rule_an_rpc():
    from goodput.cache.v1 import cache_pb2
    from goodput.embedder.v1 import embedder_pb2
    from goodput.inference.v1 import inference_pb2
    from goodput.retriever.v1 import retriever_pb2

    protos = {"scheduler": scheduler_pb2, "inference": inference_pb2, "embedder": embedder_pb2,
              "retriever": retriever_pb2, "cache": cache_pb2}
    for service, module in protos.items():
        methods = {f"/{svc.full_name}/{m.name}" for svc in module.DESCRIPTOR.services_by_name.values()
                   for m in svc.methods}
        assert set(ACCESS[service]) == methods, service


async def test_plaintext_is_logged_as_a_warning_at_start(caplog):
    with caplog.at_level("WARNING", logger="goodput.tls"):
        ServiceRunner(name="scheduler", settings=_settings(None), registry=CollectorRegistry(), provider=None)
    assert "PLAINTEXT (GOODPUT_TEST_INSECURE_INTERNAL=true)" in caplog.text


# --- certificates that rotate ---------------------------------------------------------------------------------------

def _served_serial(address: str, client: TlsFiles) -> int:
    """The serial of the certificate the server presents to a new connection."""
    ctx = ssl.create_default_context(cafile=str(client.ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname="goodput.internal") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_certificate_renewed_on_disk_is_served_without_a_restart_and_its_expiry_exported(scheduler, pki,
                                                                                               monkeypatch):
    monkeypatch.setattr(tls, "CLIENT_CHECK_S", 0.0)
    address, registry = scheduler
    files, _ = pki
    own = files["scheduler"]
    first = x509.load_pem_x509_certificate(own.cert.read_bytes())
    assert await asyncio.to_thread(_served_serial, address, files["gateway"]) == first.serial_number
    def expiry(use: str) -> float | None:
        return registry.get_sample_value("goodput_tls_certificate_expiry_timestamp_seconds", {"use": use})
    assert expiry("serve") == expiry("dial") == first.not_valid_after_utc.timestamp()
    # cert-manager renews the Secret: a new key and certificate replace the files the server was started with.
    own.cert.unlink()
    ensure_dev_pki(own.ca.parent, ["scheduler"])
    renewed = x509.load_pem_x509_certificate(own.cert.read_bytes())
    assert renewed.serial_number != first.serial_number
    assert await asyncio.to_thread(_served_serial, address, files["gateway"]) == renewed.serial_number
    assert expiry("serve") == renewed.not_valid_after_utc.timestamp()
    assert expiry("dial") == renewed.not_valid_after_utc.timestamp()  # its channels take the same files
    async with _dial(address, files["gateway"]) as ch:  # and calls go on over the renewed one
        await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)


class _Recorder(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def ListWorkers(self, request, context):  # noqa: N802
        self.seen.append(context.auth_context()["x509_pem_cert"][0])
        return scheduler_pb2.ListWorkersResponse()


async def test_a_client_certificate_renewed_on_disk_is_dialled_with_without_a_restart(pki, monkeypatch):
    monkeypatch.setattr(tls, "CLIENT_CHECK_S", 0.0)
    files, _ = pki
    recorder = _Recorder()
    runner = ServiceRunner(name="scheduler", settings=_settings(files["scheduler"]), registry=CollectorRegistry(),
                           provider=None)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, recorder, "goodput.scheduler.v1.Scheduler")
    await runner.start()
    own = files["gateway"]
    certificates = channel_credentials(_settings(own))
    assert certificates is channel_credentials(_settings(own))  # one per process: every channel follows the same
    try:
        async with _dial(f"127.0.0.1:{runner.grpc_port}", own) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)  # made once, as services make theirs
            first = own.cert.read_bytes()
            await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
            assert recorder.seen == [first]
            own.cert.unlink()  # renewed: a new key and certificate in the same files
            ensure_dev_pki(own.ca.parent, ["gateway"])
            renewed = own.cert.read_bytes()
            assert renewed != first
            await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
            assert recorder.seen == [first, renewed]
            assert certificates is not None
            assert certificates.expiry() == x509.load_pem_x509_certificate(renewed).not_valid_after_utc.timestamp()
    finally:
        await runner.server.stop(None)


async def test_a_certificate_caught_half_written_is_not_served(scheduler, pki, tmp_path):
    address, _ = scheduler
    files, _ = pki
    own = files["scheduler"]
    served = x509.load_pem_x509_certificate(own.cert.read_bytes()).serial_number
    # A key of another certificate beside this one (the kubelet's swap seen between two files): kept as it was.
    own.key.write_bytes(ensure_dev_pki(tmp_path / "elsewhere", ["scheduler"])["scheduler"].key.read_bytes())
    assert await asyncio.to_thread(_served_serial, address, files["gateway"]) == served
