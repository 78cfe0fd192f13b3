"""Which child processes a local platform runs and how each is wired, from the one topology definition
(:mod:`goodput_contracts.topology`: ports, env prefixes, peers), so the supervisor cannot drift from the chart.

Every port is the topology's plus ``port_offset`` (the n-th inference worker's also ``+ n``); every peer a service
has in the topology gets the peer's local address in its setting when the peer runs here. One local choice departs
from the cluster: the cache embeds in-process (no embedder hop or batching window on the lookup path).

Internal gRPC is mutual TLS: with ``tls_dir`` (the development CA's folder) every process gets its own identity's
certificate (``<PREFIX>TLS_CERT_FILE``, ``_KEY_FILE``, ``_CA_FILE``; the jobs worker its own, not the gateway's,
though it shares the gateway's prefix) and ``GOODPUT_INSECURE_INTERNAL=false``; without it, plaintext
(``GOODPUT_INSECURE_INTERNAL=true``, which every service logs as a warning).

Example:
    >>> wiring = Wiring(workdir=Path(".goodput"), workers=2, port_offset=0, python="python3",
    ...                 redis_url="redis://127.0.0.1:6379/0")
    >>> [s.name for s in plan(wiring)][:3]
    ['worker-0', 'worker-1', 'scheduler']

Model pools (:mod:`goodput_cli.pools`): with ``pools``, the workers are the pools' replicas in order (a pool's workers
are consecutive: ``worker-0`` is the first pool's first), and each gets its pool's settings on top of every worker's:

    >>> from goodput_cli.pools import default_pools
    >>> pooled = Wiring(workdir=Path(".goodput"), workers=2, port_offset=0, python="python3",
    ...                 redis_url="redis://127.0.0.1:6379/0", pools=tuple(default_pools()))
    >>> [(s.name, s.env["GOODPUT_INFERENCE_POOL"], s.env["GOODPUT_INFERENCE_POOL_CLASSES"]) for s in plan(pooled)[:2]]
    [('worker-0', 'interactive', 'P0,P1'), ('worker-1', 'batch', 'P2')]

Scheduler replicas (``scheduler_replicas`` > 1) run active-passive as in the chart: each on its own ports
(``SCHEDULER_PORT_STRIDE`` apart), electing their leader through a lock key in the platform's Redis (one key per
platform: it names the first replica's port); the gateways and the jobs worker get every replica's address and follow
the leader (client-side health checking):

    >>> ha = Wiring(workdir=Path(".goodput"), workers=1, port_offset=0, python="python3",
    ...             redis_url="redis://127.0.0.1:6379/0", scheduler_replicas=2)
    >>> specs = {s.name: s for s in plan(ha)}
    >>> specs["scheduler-1"].grpc_addr, specs["scheduler-1"].env["GOODPUT_SCHEDULER_LEADER_KEY"]
    ('127.0.0.1:50102', 'goodput:scheduler:leader:50052')
    >>> specs["gateway"].env["GOODPUT_GATEWAY_SCHEDULER_ADDR"]
    '127.0.0.1:50052,127.0.0.1:50102'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from goodput_contracts import DEFAULT_CHANNEL, SERVICES
from goodput_core.tls import tls_files

from goodput_cli.pools import Pool, worker_pools
from goodput_cli.procs import ServiceSpec, cpu_bindings

__all__ = ["HOST", "SCHEDULER_PORT_STRIDE", "Wiring", "grpc_addr", "http_port", "metrics_port", "plan", "redis_db_url",
           "version_channel"]

HOST = "127.0.0.1"
DEFAULT_KV_CACHE_SPACE_GB = "1"
# Peers the local platform deliberately leaves unwired (the service then works without them).
LOCAL_CHOICES = {("cache", "embedder")}
# Process names of the services that are not one per topology entry.
_NAMES = {"inference": "worker", "indexWorker": "index-worker", "jobsWorker": "jobs-worker"}
_CELERY_FLAGS = ["--pool", "solo", "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]


# A gateway replica's ports are the first's plus this many per replica (the workers' ports follow theirs one by one,
# so a stride of 1 would land a second gateway on the scheduler's port).
GATEWAY_PORT_STRIDE = 20
# A scheduler replica's likewise: 50 lands between the gateways' (+20n) and clear of the workers' HTTP ports
# (9161 + n), and of the platforms other tests run at offsets a multiple of 100 away.
SCHEDULER_PORT_STRIDE = 50
STRIDES = {"gateway": GATEWAY_PORT_STRIDE, "scheduler": SCHEDULER_PORT_STRIDE}
LEADER_KEY_PREFIX = "goodput:scheduler:leader"
# The latency profile of a local platform (goodput_gateway.profile): SLOs for the dev model on CPU cores.
LOCAL_LATENCY_PROFILE = ('{"P0": {"slo": {"ttft_s": 30, "tpot_s": 1.0}}, "P1": {"slo": {"ttft_s": 60, "tpot_s": 2.0}}, '
                         '"P2": {"slo": {"ttft_s": 240, "tpot_s": 4.0}}}')


def _shift(key: str, instance: int) -> int:
    return instance * STRIDES.get(key, 1)


def grpc_addr(key: str, port_offset: int, instance: int = 0) -> str:
    """The local address of the ``instance``-th process of ``key``.

    >>> grpc_addr("inference", 0, 1), grpc_addr("gateway", 0, 1), grpc_addr("scheduler", 0, 1)
    ('127.0.0.1:50062', '127.0.0.1:50071', '127.0.0.1:50102')
    """
    return f"{HOST}:{SERVICES[key].grpc_port + port_offset + _shift(key, instance)}"


def http_port(key: str, port_offset: int, instance: int = 0) -> int:
    return SERVICES[key].http_port + port_offset + _shift(key, instance)


def metrics_port(key: str, port_offset: int, instance: int = 0) -> int:
    """The port of ``key``'s ``/metrics``: its own where it has one (the gateway's REST port is public), else the
    HTTP port.

    >>> metrics_port("gateway", 0, 1), metrics_port("scheduler", 0)
    (8110, 9102)
    """
    own = SERVICES[key].metrics_port
    return own + port_offset + _shift(key, instance) if own else http_port(key, port_offset, instance)


def redis_db_url(url: str, db: int) -> str:
    """``url`` with its database number replaced.

    >>> redis_db_url("redis://127.0.0.1:6379/0", 3)
    'redis://127.0.0.1:6379/3'
    """
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def version_channel(redis_url: str) -> str:
    """The KB-version channel of a platform on this Redis database. Pub/sub channels are shared by every database
    of a server, so a platform on another database gets its own channel (``goodput:kb-version:db3``).

    >>> version_channel("redis://127.0.0.1:6379/0"), version_channel("redis://127.0.0.1:6379/3")
    ('goodput:kb-version', 'goodput:kb-version:db3')
    """
    path = urlsplit(redis_url).path.strip("/")
    db = int(path) if path.isdigit() else 0
    return DEFAULT_CHANNEL if db == 0 else f"{DEFAULT_CHANNEL}:db{db}"


@dataclass(frozen=True)
class Wiring:
    """What the plan depends on. ``inherited`` is the environment the children inherit (explicit settings there
    are kept)."""

    workdir: Path
    workers: int
    port_offset: int
    python: str
    redis_url: str
    knowledge: bool = True
    cache: bool = True
    jobs: bool = True
    # Gateway replicas (the first on the topology's ports, the n-th GATEWAY_PORT_STRIDE * n above), sharing the
    # scheduler, the key file and the quota counters in Redis.
    gateways: int = 1
    inherited: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # The development CA's folder (goodput_core.tls.ensure_dev_pki); None = plaintext internal gRPC.
    tls_dir: Path | None = None
    # Model pools (goodput_cli.pools): their replicas add up to ``workers``; empty = ``workers`` identical workers of
    # the worker's own default pool (every class).
    pools: tuple[Pool, ...] = ()
    # Scheduler replicas (the first on the topology's ports, the n-th SCHEDULER_PORT_STRIDE * n above); more than one
    # elect their leader through Redis.
    scheduler_replicas: int = 1
    # The workers' engine (GOODPUT_INFERENCE_ENGINE: vllm, sim, triton) unless their pool names one; empty = the
    # worker's default (or what the environment says).
    engine: str = ""
    # Each identity's own Redis URL (its ACL user: goodput_contracts.redis_access); one missing gets ``redis_url``.
    redis_urls: dict[str, str] = field(default_factory=dict)
    # The key the gateways and the jobs worker seal job and batch records with (JOBS__MAC_KEY); "" = not set here.
    jobs_mac_key: str = ""

    def __post_init__(self) -> None:
        if self.pools and sum(p.replicas for p in self.pools) != self.workers:
            raise ValueError(f"the pools have {sum(p.replicas for p in self.pools)} workers, not {self.workers}")
        if self.scheduler_replicas < 1:
            raise ValueError("scheduler_replicas must be at least 1")

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def redis_for(self, key: str) -> str:
        return self.redis_urls.get(key, self.redis_url)

    def running(self) -> list[str]:
        """Topology keys of the services this platform runs, in start order."""
        keys = ["inference", "scheduler"]
        if self.knowledge:
            keys += ["embedder", "retriever", "indexWorker"]
        if self.cache:
            keys.append("cache")
        if self.jobs:
            keys.append("jobsWorker")
        return [*keys, "gateway"]


def _peers(key: str, w: Wiring, running: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    svc = SERVICES[key]
    for peer in svc.peers:
        if peer.service not in running or (key, peer.service) in LOCAL_CHOICES:
            continue
        if peer.service == "inference":
            value = ",".join(grpc_addr("inference", w.port_offset, i) for i in range(w.workers))
        elif peer.service == "scheduler":  # every replica: the callers' channels follow the leader
            value = ",".join(grpc_addr("scheduler", w.port_offset, i) for i in range(w.scheduler_replicas))
        else:
            value = grpc_addr(peer.service, w.port_offset)
        env[svc.env(peer.setting)] = value
    return env


def _service_env(key: str, w: Wiring, running: list[str], instance: int = 0) -> dict[str, str]:
    svc = SERVICES[key]
    env = {"PYTHONUNBUFFERED": "1"}
    if svc.grpc_port:
        env[svc.env("GRPC_PORT")] = str(svc.grpc_port + w.port_offset + _shift(key, instance))
    env[svc.env(svc.http_port_setting)] = str(http_port(key, w.port_offset, instance))
    if svc.metrics_port:
        env[svc.env("METRICS_PORT")] = str(metrics_port(key, w.port_offset, instance))
    # The gateway's REDIS_URL holds parked jobs only: it gets it when the jobs worker runs. Its quota counters and
    # usage are always in Redis, so that every replica (and the jobs worker) counts against the same limits.
    if "redis" in svc.external and (svc.prefix != SERVICES["gateway"].prefix or w.jobs):
        env[svc.env("REDIS_URL")] = w.redis_for(key)
    if svc.prefix == SERVICES["gateway"].prefix:
        env[svc.env("QUOTA_REDIS_URL")] = w.redis_for(key)
        if w.jobs_mac_key:
            env[svc.env("JOBS__MAC_KEY")] = w.jobs_mac_key
    if key in ("embedder", "indexWorker", "cache"):
        env[svc.env("VERSION_CHANNEL")] = version_channel(w.redis_url)
    env.update(_peers(key, w, running))
    env.update(_tls_env(key, w))
    return env


def _tls_env(key: str, w: Wiring) -> dict[str, str]:
    """The process's identity (its topology key) as certificate settings, or the explicit plaintext switch."""
    if w.tls_dir is None:
        return {"GOODPUT_INSECURE_INTERNAL": "true"}
    svc, files = SERVICES[key], tls_files(w.tls_dir, key)
    return {"GOODPUT_INSECURE_INTERNAL": "false", svc.env("TLS_CERT_FILE"): str(files.cert),
            svc.env("TLS_KEY_FILE"): str(files.key), svc.env("TLS_CA_FILE"): str(files.ca)}


def _leader_env(w: Wiring) -> dict[str, str]:
    """Leader election of scheduler replicas: a lock key in the platform's Redis, named after the first replica's
    port so that two platforms on one Redis database never share it (an explicit LEADER_KEY is kept)."""
    svc = SERVICES["scheduler"]
    env = {svc.env("LEADER_ELECTION"): "redis", svc.env("LEADER_REDIS_URL"): w.redis_for("scheduler")}
    if svc.env("LEADER_KEY") not in w.inherited:
        env[svc.env("LEADER_KEY")] = f"{LEADER_KEY_PREFIX}:{svc.grpc_port + w.port_offset}"
    return env


def _spec(name: str, argv: list[str], env: dict[str, str], grpc: str | None, w: Wiring, *,
          public: bool = False) -> ServiceSpec:
    return ServiceSpec(name=name, argv=argv, env=env, grpc_addr=grpc, log_path=w.log_path(name),
                       tls=grpc is not None and not public and w.tls_dir is not None)


def plan(w: Wiring) -> list[ServiceSpec]:
    """The Goodput services in start order (Redis is not part of it: it is started only when missing)."""
    running = w.running()
    bindings = cpu_bindings(w.workers)
    specs: list[ServiceSpec] = []
    for key in running:
        svc = SERVICES[key]
        argv = [w.python, "-m", svc.package]
        if key == "inference":
            pools = worker_pools(w.pools)
            for i in range(w.workers):
                own = pools[i].worker_env() if pools else {}  # the pool's settings win over inherited ones
                env = {**own, **_service_env(key, w, running, i), svc.env("WORKER_ID"): f"worker-{i}"}
                if w.engine and svc.env("ENGINE") not in own:
                    env[svc.env("ENGINE")] = w.engine
                explicit = {**w.inherited, **own}
                if svc.env("ENFORCE_EAGER") not in explicit:
                    # On CPU, vLLM's graph compilation makes engine start ~4x slower (about 145 s instead of 35 s
                    # on 2 cores) for a modest decode speed-up: a local platform starts eager unless told otherwise.
                    env[svc.env("ENFORCE_EAGER")] = "true"
                if svc.env("KV_CACHE_SPACE_GB") not in explicit:
                    env[svc.env("KV_CACHE_SPACE_GB")] = DEFAULT_KV_CACHE_SPACE_GB
                if bindings[i] is not None and "VLLM_CPU_OMP_THREADS_BIND" not in explicit:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = str(bindings[i])
                specs.append(_spec(f"worker-{i}", argv, env, grpc_addr(key, w.port_offset, i), w))
            continue
        if key == "gateway":
            for i in range(w.gateways):
                env = {**_service_env(key, w, running, i), svc.env("API_KEYS_FILE"): str(w.workdir / "api-keys.json")}
                if svc.env("LATENCY_PROFILE") not in w.inherited:
                    # The built-in SLOs are a GPU fleet's; a 135M model on a few CPU cores gets its own, so a local
                    # platform's degradation ladder moves on real trouble, not on the CPU's ordinary pace.
                    env[svc.env("LATENCY_PROFILE")] = LOCAL_LATENCY_PROFILE
                specs.append(_spec("gateway" if i == 0 else f"gateway-{i}", argv, env, grpc_addr(key, w.port_offset, i),
                                   w, public=True))
            continue
        if key == "scheduler":
            for i in range(w.scheduler_replicas):
                env = _service_env(key, w, running, i)
                if w.scheduler_replicas > 1:
                    env.update(_leader_env(w))
                specs.append(_spec("scheduler" if i == 0 else f"scheduler-{i}", argv, env,
                                   grpc_addr(key, w.port_offset, i), w))
            continue
        env = _service_env(key, w, running)
        name = _NAMES.get(key, key)
        if key == "retriever":
            env[svc.env("DATA_DIR")] = str(w.workdir / "retriever-data")
        if svc.is_celery_worker:
            if key == "jobsWorker":
                # The jobs worker runs parked requests through the gateway's own pipeline: the gateway's settings.
                env = {**_service_env("gateway", w, running), **env,
                       svc.env("API_KEYS_FILE"): str(w.workdir / "api-keys.json")}
            celery = [w.python, "-m", "celery", "-A", svc.celery_app, "worker"]
            if key == "jobsWorker":
                celery += ["-Q", w.inherited.get(svc.env(svc.queue_setting), svc.default_queue)]
            # --pool solo: one process, so its metrics port sees every job.
            specs.append(_spec(name, celery + _CELERY_FLAGS, env, None, w))
        else:
            specs.append(_spec(name, argv, env, grpc_addr(key, w.port_offset), w))
    return specs
