"""The supervisor: wiring from docs/services.md, and the lifecycle of real child processes (fake services that only
serve gRPC health, so no vLLM is involved)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import textwrap
from pathlib import Path

import pytest

from goodput_core.clients import GRPC_EXPERIMENTS
from goodput_testing import wait_until

from goodput_cli.supervisor import Platform, PlatformError, cpu_bindings


def test_addresses_follow_the_port_offset(tmp_path):
    p = Platform(workdir=tmp_path, workers=2, port_offset=100)

    assert p.gateway_http == "http://127.0.0.1:8180"
    assert p.gateway_grpc == "127.0.0.1:50151"
    assert p.scheduler_grpc == "127.0.0.1:50152"
    assert [p.worker_grpc(0), p.worker_grpc(1)] == ["127.0.0.1:50161", "127.0.0.1:50162"]
    assert [p.worker_http(0), p.worker_http(1)] == ["http://127.0.0.1:9261", "http://127.0.0.1:9262"]
    with pytest.raises(IndexError):
        p.worker_grpc(2)


def test_each_service_gets_its_ports_and_peers(tmp_path, monkeypatch):
    monkeypatch.delenv("GOODPUT_INFERENCE_KV_CACHE_SPACE_GB", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("goodput_cli.plan.cpu_bindings", lambda n: cpu_bindings(n, [0, 1]))
    p = Platform(workdir=tmp_path, workers=2, port_offset=100, env={"GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.2"})

    specs = {s.name: s for s in p.plan()}

    assert list(specs) == ["worker-0", "worker-1", "scheduler", "embedder", "retriever", "index-worker", "cache",
                           "jobs-worker", "gateway"]
    jobs = specs["jobs-worker"]
    assert jobs.argv[1:5] == ["-m", "celery", "-A", "goodput_gateway.worker"] and "goodput-jobs" in jobs.argv
    assert jobs.env["GOODPUT_GATEWAY_REDIS_URL"] == specs["gateway"].env["GOODPUT_GATEWAY_REDIS_URL"]
    assert jobs.env["GOODPUT_GATEWAY_JOBS__WORKER_HTTP_PORT"] == "9207"  # /metrics, shifted like every port
    assert specs["cache"].env["GOODPUT_CACHE_GRPC_PORT"] == "50155"
    assert specs["gateway"].env["GOODPUT_GATEWAY_CACHE_ADDR"] == "127.0.0.1:50155"
    w1 = specs["worker-1"].env
    assert w1["GOODPUT_INFERENCE_GRPC_PORT"] == "50162"
    assert w1["GOODPUT_INFERENCE_HTTP_PORT"] == "9262"
    assert w1["GOODPUT_INFERENCE_WORKER_ID"] == "worker-1"
    assert w1["GOODPUT_INFERENCE_KV_CACHE_SPACE_GB"] == "1"
    assert [specs[f"worker-{i}"].env["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)] == ["0", "1"]
    assert specs["worker-0"].argv[1:] == ["-m", "goodput_inference"]
    sched = specs["scheduler"].env
    assert sched["GOODPUT_SCHEDULER_GRPC_PORT"] == "50152"
    assert sched["GOODPUT_SCHEDULER_HTTP_PORT"] == "9202"
    assert sched["GOODPUT_SCHEDULER_WORKERS"] == "127.0.0.1:50161,127.0.0.1:50162"
    gw = specs["gateway"].env
    assert gw["GOODPUT_GATEWAY_GRPC_PORT"] == "50151"
    assert gw["GOODPUT_GATEWAY_HTTP_PORT"] == "8180"
    assert gw["GOODPUT_GATEWAY_SCHEDULER_ADDR"] == "127.0.0.1:50152"
    assert gw["GOODPUT_GATEWAY_API_KEYS_FILE"] == str(tmp_path / "api-keys.json")
    assert gw["GOODPUT_GATEWAY_EMBEDDER_ADDR"] == "127.0.0.1:50153"
    assert gw["GOODPUT_GATEWAY_RETRIEVER_ADDR"] == "127.0.0.1:50154"
    assert specs["retriever"].env["GOODPUT_RETRIEVER_EMBEDDER_ADDR"] == "127.0.0.1:50153"
    assert specs["embedder"].env["GOODPUT_EMBEDDER_RETRIEVER_ADDR"] == "127.0.0.1:50154"
    assert specs["index-worker"].argv[1:5] == ["-m", "celery", "-A", "goodput_embedder.jobs"]
    assert specs["index-worker"].grpc_addr is None
    # Extra env reaches every child; the wiring always wins over it.
    full = p.child_env(specs["scheduler"])
    assert full["GOODPUT_SCHEDULER_HEALTH_INTERVAL_S"] == "0.2"
    assert p.child_env(specs["worker-0"])["GOODPUT_INFERENCE_GRPC_PORT"] == "50161"


def test_every_child_starts_with_the_platforms_grpc_experiments_unless_the_environment_sets_them(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    p = Platform(workdir=tmp_path, workers=1)
    for spec in p.plan():
        assert p.child_env(spec)["GRPC_EXPERIMENTS"] == GRPC_EXPERIMENTS, spec.name
    # An operator's (or a benchmark variant's) value wins, an empty one (gRPC's defaults) included.
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    assert all(p.child_env(s)["GRPC_EXPERIMENTS"] == "" for s in p.plan())
    given = Platform(workdir=tmp_path, workers=1, env={"GRPC_EXPERIMENTS": "-event_engine_listener"})
    assert all(given.child_env(s)["GRPC_EXPERIMENTS"] == "-event_engine_listener" for s in given.plan())


def test_every_process_gets_its_own_identity_and_mtls_is_on_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("GOODPUT_INSECURE_INTERNAL", "true")  # the supervisor's own environment does not decide
    specs = {s.name: s for s in Platform(workdir=tmp_path, workers=2).plan()}
    tls = tmp_path.resolve() / "tls"

    assert {s.env["GOODPUT_INSECURE_INTERNAL"] for s in specs.values()} == {"false"}
    assert specs["worker-1"].env["GOODPUT_INFERENCE_TLS_CERT_FILE"] == str(tls / "inference.pem")
    assert specs["scheduler"].env["GOODPUT_SCHEDULER_TLS_KEY_FILE"] == str(tls / "scheduler-key.pem")
    assert specs["cache"].env["GOODPUT_CACHE_TLS_CA_FILE"] == str(tls / "ca.pem")
    # The Celery workers share their service's prefix, not its identity.
    assert specs["jobs-worker"].env["GOODPUT_GATEWAY_TLS_CERT_FILE"] == str(tls / "jobsWorker.pem")
    assert specs["gateway"].env["GOODPUT_GATEWAY_TLS_CERT_FILE"] == str(tls / "gateway.pem")
    assert specs["index-worker"].env["GOODPUT_EMBEDDER_TLS_CERT_FILE"] == str(tls / "indexWorker.pem")
    # Probed over mTLS, but for the gateway's public port.
    assert [n for n, s in specs.items() if s.tls] == ["worker-0", "worker-1", "scheduler", "embedder", "retriever",
                                                      "cache"]

    plain = {s.name: s for s in Platform(workdir=tmp_path, insecure_internal=True).plan()}
    assert plain["scheduler"].env["GOODPUT_INSECURE_INTERNAL"] == "true"
    assert "GOODPUT_SCHEDULER_TLS_CERT_FILE" not in plain["scheduler"].env
    assert not any(s.tls for s in plain.values())


def test_one_worker_is_not_pinned_and_explicit_settings_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("GOODPUT_INFERENCE_KV_CACHE_SPACE_GB", "3")
    spec = Platform(workdir=tmp_path, workers=1).plan()[0]

    assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env
    assert "GOODPUT_INFERENCE_KV_CACHE_SPACE_GB" not in spec.env  # inherited as 3


@pytest.mark.parametrize(("workers", "cpus", "expected"), [
    (1, [0, 1], [None]),
    (2, [0, 1], ["0", "1"]),
    (2, [0, 1, 2, 3, 4, 5, 6, 7], ["0-3", "4-7"]),
    (3, [0, 1], ["0", "1", "0"]),
    (2, [0, 2, 4, 6], ["0,2", "4,6"]),
])
def test_workers_get_disjoint_cpus(workers, cpus, expected):
    assert cpu_bindings(workers, cpus) == expected


# --- lifecycle with fake services ----------------------------------------------------------------------------------

FAKE = textwrap.dedent('''
    import os, signal, sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    def main(prefix):
        if os.environ.get("FAKE_FAIL") == prefix:
            print("boom: cannot start", flush=True)
            sys.exit(3)
        server = grpc.server(futures.ThreadPoolExecutor(4))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = "127.0.0.1:" + os.environ[prefix + "GRPC_PORT"]
        if os.environ.get(prefix + "TLS_CERT_FILE") and prefix != "GOODPUT_GATEWAY_":  # the gateway's is public
            def read(name):
                with open(os.environ[prefix + name], "rb") as f:
                    return f.read()
            creds = grpc.ssl_server_credentials([(read("TLS_KEY_FILE"), read("TLS_CERT_FILE"))],
                                                root_certificates=read("TLS_CA_FILE"), require_client_auth=True)
            server.add_secure_port(address, creds)
        else:
            server.add_insecure_port(address)
        server.start()
        time.sleep(float(os.environ.get("FAKE_DELAY", "0")))  # the behaviour under test: a service slow to serve
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        print("serving", flush=True)
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        while True:
            time.sleep(1)
''')


def _ports_free(offset: int) -> bool:
    for port in (50051, 50052, 50061, 50062):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + offset))
            except OSError:
                return False
    return True


@pytest.fixture
def fake_services(tmp_path):
    root = tmp_path / "fake"
    (root).mkdir()
    (root / "fake_service.py").write_text(FAKE)
    for svc in ("inference", "scheduler", "gateway"):
        pkg = root / f"goodput_{svc}"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "__main__.py").write_text(f"import fake_service\nfake_service.main('GOODPUT_{svc.upper()}_')\n")
    return root


def _platform(tmp_path: Path, fake: Path, *, redis_users: bool = True, **env: str) -> Platform:
    offset = next(o for o in (random.randrange(1000, 9000) for _ in range(50)) if _ports_free(o))
    redis_port = offset + 6379
    return Platform(workdir=tmp_path / "work", workers=2, port_offset=offset, knowledge=False, cache=False, jobs=False,
                    redis_users=redis_users,
                    env={"PYTHONPATH": str(fake), "GOODPUT_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", **env})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make install)")
def test_start_waits_for_every_service_and_stop_leaves_no_process(tmp_path, fake_services):
    platform = _platform(tmp_path, fake_services, FAKE_DELAY="1")
    platform.start(timeout_s=60)
    try:
        pids = {name: platform.pid(name) for name in ("redis", "worker-0", "worker-1", "scheduler", "gateway")}
        assert all(pids.values())
        assert "serving" in platform.log_path("gateway").read_text()
        # The scheduler serves mTLS: the operator's certificate passes, no certificate does not.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with platform.internal_channel(platform.scheduler_grpc) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        import grpc

        with grpc.insecure_channel(platform.scheduler_grpc) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert platform.dev_key and (tmp_path / "work" / "dev-key").read_text().strip() == platform.dev_key

        platform.kill_worker(1)
        assert platform.exited() == {"worker-1": -9}
        platform.restart_worker(1, timeout_s=30)
        assert platform.exited() == {}
        pids["worker-1"] = platform.pid("worker-1")
    finally:
        platform.stop(grace_s=5)
    wait_until(lambda: not [name for name, pid in pids.items() if pid and _alive(pid)], timeout=5,
               message="a child outlived stop")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make install)")
def test_a_service_that_exits_fails_start_with_its_log(tmp_path, fake_services):
    platform = _platform(tmp_path, fake_services, FAKE_FAIL="GOODPUT_SCHEDULER_")

    with pytest.raises(PlatformError, match=r"(?s)scheduler exited with code 3.*boom: cannot start"):
        platform.start(timeout_s=60)
    assert platform.exited() == {}  # everything stopped


def test_timeout_names_the_slow_service(tmp_path, fake_services):
    platform = _platform(tmp_path, fake_services, FAKE_DELAY="30", redis_users=False)
    platform.redis_url = "redis://127.0.0.1:1/0"
    # Pretend Redis answers so the test does not need one.
    import goodput_cli.procs as sup

    real = sup.redis_ping
    sup.redis_ping = lambda host, port, timeout_s=0.5: True  # type: ignore[assignment]
    try:
        with pytest.raises(PlatformError, match="timed out after 2 s waiting for worker-0, worker-1, scheduler"):
            platform.start(timeout_s=2)
    finally:
        sup.redis_ping = real


def _pids_with_env(marker: str) -> list[int]:
    """Processes whose environment contains ``marker`` (the fake services' PYTHONPATH)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(shutil.which("redis-server") is None or not Path("/proc").is_dir(),
                    reason="needs redis-server (make install) and /proc")
def test_goodput_up_prints_working_examples_and_ctrl_c_stops_everything(tmp_path, fake_services):
    """`goodput up` as a user runs it: its own process, Ctrl-C (SIGINT) to stop. (In its own process so the signal
    and gRPC's fork handling never touch the test runner.)"""
    import signal
    import subprocess
    import sys

    probe = _platform(tmp_path, fake_services)
    env = {**os.environ, "PYTHONPATH": str(fake_services), "GOODPUT_REDIS_URL": probe.redis_url,
           "GOODPUT_KNOWLEDGE": "0", "GOODPUT_RESPONSE_CACHE": "0", "GOODPUT_JOBS": "0"}  # no fakes of those
    up = subprocess.Popen([sys.executable, "-m", "goodput_cli.main", "up", "--workers", "2", "--port-offset",
                           str(probe.port_offset)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    up_file = tmp_path / ".goodput" / "up.json"  # written once `up` has printed its examples
    try:
        wait_until(lambda: up_file.exists() or up.poll() is not None, timeout=90, interval=0.1,
                   message="goodput up did not print its examples")
        seen_running = _pids_with_env(f"PYTHONPATH={fake_services}")
    finally:
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)

    key = (tmp_path / ".goodput" / "dev-key").read_text().strip()
    assert up.returncode == 0, output
    assert f"curl -N {probe.gateway_http}/v1/chat/completions" in output
    assert f"Authorization: Bearer {key}" in output
    assert f'OpenAI(base_url="{probe.gateway_http}/v1", api_key="{key}")' in output
    assert "stopped." in output
    assert not up_file.exists()
    assert len(seen_running) >= 4  # two workers, scheduler, gateway (and `up` itself)
    assert _pids_with_env(f"PYTHONPATH={fake_services}") == []


# --- two platforms on one machine -------------------------------------------------------------------------------------

def test_a_second_platform_on_the_same_state_folder_is_refused_naming_the_first(tmp_path):
    first = Platform(workdir=tmp_path, knowledge=False, cache=False, jobs=False)
    first._claim_state()
    try:
        second = Platform(workdir=tmp_path, port_offset=100)
        with pytest.raises(PlatformError, match=rf"(?s)state folder of a platform that is running \(pid {os.getpid()}"
                                                r".*--state-dir"):
            second.start(timeout_s=5)
    finally:
        first._release_state()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())  # the second started nothing


def test_a_platform_on_its_own_redis_database_gets_its_own_keys_queues_and_version_channel(tmp_path):
    p = Platform(workdir=tmp_path, redis_db=3, env={"GOODPUT_REDIS_URL": "redis://127.0.0.1:6379/0"})
    specs = {s.name: s for s in p.plan()}

    assert p.redis_url == "redis://127.0.0.1:6379/3"
    for name, prefix in (("embedder", "GOODPUT_EMBEDDER_"), ("index-worker", "GOODPUT_EMBEDDER_"),
                         ("cache", "GOODPUT_CACHE_"), ("jobs-worker", "GOODPUT_GATEWAY_")):
        assert specs[name].env[prefix + "REDIS_URL"] == "redis://127.0.0.1:6379/3", name
    assert specs["embedder"].env["GOODPUT_EMBEDDER_VERSION_CHANNEL"] == "goodput:kb-version:db3"
    assert specs["cache"].env["GOODPUT_CACHE_VERSION_CHANNEL"] == "goodput:kb-version:db3"
    assert Platform(workdir=tmp_path).plan()[-2].env.get("GOODPUT_GATEWAY_REDIS_URL", "").endswith("/0")


# --- scheduler replicas, the simulated engine, faults on purpose ------------------------------------------------------

def test_scheduler_replicas_elect_a_leader_in_the_platforms_redis_and_every_caller_knows_them_all(tmp_path):
    p = Platform(workdir=tmp_path, workers=1, port_offset=100, scheduler_replicas=2, gateways=2,
                 env={"GOODPUT_REDIS_URL": "redis://127.0.0.1:6379/2"})
    specs = {s.name: s for s in p.plan()}

    assert [p.scheduler_grpc_at(0), p.scheduler_grpc_at(1)] == ["127.0.0.1:50152", "127.0.0.1:50202"]
    assert p.endpoints()["scheduler-1"] == "127.0.0.1:50202"
    replicas = [specs["scheduler"], specs["scheduler-1"]]
    assert [s.env["GOODPUT_SCHEDULER_GRPC_PORT"] for s in replicas] == ["50152", "50202"]
    assert [s.env["GOODPUT_SCHEDULER_HTTP_PORT"] for s in replicas] == ["9202", "9252"]
    for s in replicas:  # one lock per platform, in its own Redis database
        assert s.env["GOODPUT_SCHEDULER_LEADER_ELECTION"] == "redis"
        assert s.env["GOODPUT_SCHEDULER_LEADER_REDIS_URL"] == "redis://127.0.0.1:6379/2"
        assert s.env["GOODPUT_SCHEDULER_LEADER_KEY"] == "goodput:scheduler:leader:50152"
    for caller in ("gateway", "gateway-1", "jobs-worker"):
        assert specs[caller].env["GOODPUT_GATEWAY_SCHEDULER_ADDR"] == "127.0.0.1:50152,127.0.0.1:50202", caller
    # one replica: no election, one address (as before)
    single = {s.name: s for s in Platform(workdir=tmp_path, workers=1).plan()}
    assert "GOODPUT_SCHEDULER_LEADER_ELECTION" not in single["scheduler"].env
    assert single["gateway"].env["GOODPUT_GATEWAY_SCHEDULER_ADDR"] == "127.0.0.1:50052"


def test_the_engine_option_reaches_every_worker_unless_its_pool_names_one(tmp_path):
    from goodput_cli.pools import Pool

    sim = {s.name: s.env for s in Platform(workdir=tmp_path, workers=2, engine="sim").plan()}
    assert sim["worker-0"]["GOODPUT_INFERENCE_ENGINE"] == sim["worker-1"]["GOODPUT_INFERENCE_ENGINE"] == "sim"
    pooled = {s.name: s.env for s in Platform(workdir=tmp_path, engine="sim",
                                              pools=[Pool(name="a"), Pool(name="b", engine="vllm")]).plan()}
    assert [pooled["worker-0"]["GOODPUT_INFERENCE_ENGINE"], pooled["worker-1"]["GOODPUT_INFERENCE_ENGINE"]] == \
        ["sim", "vllm"]
    assert "GOODPUT_INFERENCE_ENGINE" not in {s.name: s.env for s in Platform(workdir=tmp_path).plan()}["worker-0"]


def _state(pid: int) -> str:
    """The process's state letter (T: stopped)."""
    return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])


@pytest.mark.skipif(shutil.which("redis-server") is None or not Path("/proc").is_dir(),
                    reason="needs redis-server (make install) and /proc")
def test_any_child_can_be_killed_frozen_thawed_stopped_and_restarted_and_a_persistent_redis_keeps_its_data(
        tmp_path, fake_services):
    import redis

    platform = _platform(tmp_path, fake_services)
    platform.redis_persistent = True
    platform.start(timeout_s=60)
    try:
        assert platform.names()[0] == "redis" and "scheduler" in platform.names()
        # SIGSTOP / SIGCONT: alive but doing nothing, then going on
        (pid,) = platform.freeze("scheduler")
        wait_until(lambda: _state(pid) == "T", timeout=5, message="the scheduler was not stopped")
        platform.thaw("scheduler")
        wait_until(lambda: _state(pid) != "T", timeout=5, message="the scheduler did not resume")
        # SIGKILL, then the same spec again: it serves once restart returns
        before = platform.pid("gateway")
        platform.kill("gateway")
        assert platform.exited() == {"gateway": -9}
        platform.restart("gateway", timeout_s=30)
        assert platform.exited() == {} and platform.pid("gateway") not in (None, before)
        with pytest.raises(PlatformError, match="still running"):
            platform.restart("gateway")
        with pytest.raises(PlatformError, match="not a child of this platform"):
            platform.kill("nothing")
        # Redis stopped as Kubernetes stops a pod and started again: its append-only file brings the data back
        client = redis.Redis.from_url(platform.redis_url)
        client.set("chaos:kept", "yes")
        platform.terminate("redis")
        assert platform.exited() == {"redis": 0}
        platform.restart("redis", timeout_s=30)
        assert client.get("chaos:kept") == b"yes"
        client.close()
    finally:
        platform.stop(grace_s=5)
