"""Runs the whole platform on one machine, each service as its own child process, for `goodput up` and for tests.

Start order: Redis (only when nothing answers on ``GOODPUT_REDIS_URL``), the inference workers, the scheduler, the
embedder, the retriever and a Celery indexing worker (unless ``knowledge=False`` or ``GOODPUT_KNOWLEDGE=0``), the
gateway. Every child runs ``<python> -m goodput_<svc>`` in its own session, configured only through the environment
variables of docs/services.md (wired from the one topology definition, :mod:`goodput_cli.plan`), with stdout and
stderr in ``<workdir>/logs/<name>.log``. ``start`` returns once every gRPC server answers the standard health check
with SERVING and the scheduler sees every worker healthy.

``workdir`` is the platform's state folder (key file, dev key, logs, the retriever's stores); a running platform
holds ``workdir/platform.lock``, so a second one on the same folder is refused. Two platforms on one machine need
their own state folders, ports (``port_offset``) and Redis database (``redis_db``: keys and Celery queues are
per database; the KB-version channel gets the database's number, since pub/sub is shared by all databases).

Internal gRPC is mutual TLS unless ``insecure_internal=True``: ``start`` makes (or reuses, while valid) a development
CA and one certificate per identity in ``workdir/tls`` — each service, the two Celery workers and the operator, whose
certificate the supervisor's own readiness checks and :meth:`Platform.internal_channel` present. The gateway's
public ports (REST and gRPC) stay plaintext with API keys.

Example::

    platform = Platform(workdir=tmp_path, workers=2, port_offset=1000)
    platform.start()                      # ~2 minutes on CPU: the workers load vLLM
    httpx.post(platform.gateway_http + "/v1/chat/completions",
               headers={"Authorization": f"Bearer {platform.dev_key}"}, json={...})
    with platform.internal_channel(platform.scheduler_grpc) as ch:   # mTLS as the operator
        SchedulerStub(ch).ListWorkers(ListWorkersRequest())
    platform.kill_worker(1)               # SIGKILL, like a crashed pod
    platform.stop()

Faults on purpose (the chaos suite, failure tests): ``kill(name)`` SIGKILLs a child and whatever it started,
``terminate(name)`` stops it as Kubernetes would (SIGTERM, then SIGKILL after a grace), ``restart(name)`` starts it
again from the same spec and waits until it serves, ``freeze(name)`` / ``thaw(name)`` SIGSTOP / SIGCONT it (a hung
process, e.g. a worker's engine: ``pids`` names a process of its group, see ``descendants``). Names are those of
``names()``: ``worker-0``, ``scheduler``, ``scheduler-1``, ``gateway-1``, ``jobs-worker``, ``redis``...

Scheduler replicas: ``Platform(scheduler_replicas=2)`` runs two schedulers electing their leader through the
platform's Redis (``leader()`` says which leads); the gateways and the jobs worker follow it. ``engine="sim"`` runs
the workers on the simulated engine (no model, starts in seconds). ``redis_persistent=True`` has the Redis the
platform starts itself keep an append-only file in the state folder, so that a restarted Redis comes back with its
data, as a production Redis does.

Model pools (:mod:`goodput_cli.pools`) replace ``workers``: ``Platform(workdir=..., pools=default_pools())`` runs each
pool's replicas, numbered in pool order (``pool_workers("batch")`` says which).

It is also a context manager (``with Platform(workdir=...) as p:`` starts and stops). Children never outlive the
supervisor: ``stop`` runs from ``finally``/``atexit``, and on Linux a child started from the main thread also gets
SIGTERM from the kernel when the supervisor dies without cleaning up.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import grpc
import redis
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from rich.console import Console

from goodput_contracts.access import IDENTITIES, OPERATOR
from goodput_core.clients import GRPC_EXPERIMENTS
from goodput_core.tls import TlsFiles, ensure_dev_pki, platform_prefix, tls_files, write_private

from goodput_cli import procs
from goodput_cli.keys import read_dev_key, write_dev_keys, write_keys_file
from goodput_cli.plan import HOST, Wiring, grpc_addr, http_port, metrics_port, plan, redis_db_url, version_channel
from goodput_cli.pools import Pool, worker_pools
from goodput_cli.procs import PlatformError, Proc, ServiceSpec, check_health, cpu_bindings, log_tail, signal_group
from goodput_cli.progress import Progress
from goodput_cli.redis_users import RedisUsers

__all__ = ["DEFAULT_REDIS_URL", "Platform", "PlatformError", "ServiceSpec", "cpu_bindings"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOCK_FILE = "platform.lock"  # held by the running supervisor of a state folder
TLS_DIR = "tls"  # the development CA and every identity's certificate, in the state folder
REDIS_DIR = "redis"  # the append-only file of a persistent Redis the platform started, in the state folder
JOBS_MAC_KEY_FILE = "jobs-mac-key"  # the key job records are sealed with (kept: jobs outlive a run)
SCHEDULER_SERVICE = "goodput.scheduler.v1.Scheduler"  # SERVING only at the leading replica
# Celery workers serve no gRPC: their readiness is /healthz on their metrics port.
_HTTP_READY = {"index-worker": "indexWorker", "jobs-worker": "jobsWorker"}

# Short reconnect backoff: the default grows to minutes, which would hide a server that just came up.
_PROBE_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


def own_secret(path: Path) -> str:
    """The secret kept in ``path`` (mode 0600), made the first time."""
    if not path.exists():
        write_private(path, secrets.token_hex(32).encode())
    return path.read_text().strip()


class Platform:
    """The local platform: Redis, ``workers`` inference workers, the scheduler and the gateway as child processes.

    ``env`` is added to every child's environment (after the supervisor's own environment); the ports, addresses
    and worker ids are always the supervisor's. ``api_keys`` are the entries of the gateway's key file (or its whole
    document: defaults, tenants, keys); None creates a development key (``dev_key``, also in ``workdir/dev-key``)
    for tenant ``dev`` with P0 allowed.
    ``insecure_internal`` runs internal gRPC in plaintext (every service warns at start); the default is mTLS.
    ``pools``: model pools whose replicas are the workers (``workers``, when given too, must be their sum); without,
    ``workers`` (default 1) identical workers of one pool serving every class.
    ``scheduler_replicas``: schedulers electing a leader through Redis (1: one scheduler, no election).
    ``engine``: the workers' engine (``sim``: simulated, no model); None: the worker's default or the environment's.
    ``redis_persistent``: a Redis the platform starts keeps an append-only file (survives ``restart("redis")``).
    ``redis_users``: every process that uses Redis connects as its own ACL user (:mod:`goodput_cli.redis_users`),
    created with ``GOODPUT_REDIS_URL``'s credentials; False gives them all that URL (a Redis without ACLs).
    """

    def __init__(self, *, workdir: Path, workers: int | None = None, port_offset: int = 0,
                 env: dict[str, str] | None = None, api_keys: list[dict[str, Any]] | dict[str, Any] | None = None,
                 python: str | None = None, knowledge: bool | None = None, cache: bool | None = None,
                 jobs: bool | None = None, redis_db: int | None = None, insecure_internal: bool = False,
                 gateways: int = 1, pools: Sequence[Pool] | None = None, scheduler_replicas: int = 1,
                 engine: str | None = None, redis_persistent: bool = False, redis_users: bool = True) -> None:
        self.pools = tuple(pools or ())
        replicas = sum(p.replicas for p in self.pools)
        if self.pools and workers is not None and workers != replicas:
            raise ValueError(f"workers={workers}, but the pools have {replicas} workers")
        workers = replicas if self.pools else (1 if workers is None else workers)
        if workers < 1 or gateways < 1 or scheduler_replicas < 1:
            raise ValueError("workers, gateways and scheduler_replicas must be at least 1")
        self.gateways = gateways
        self.scheduler_replicas = scheduler_replicas
        self.engine = engine or ""
        self.redis_persistent = redis_persistent
        self.workdir = Path(workdir).resolve()
        self.workers = workers
        self.port_offset = port_offset
        self.env: dict[str, str] = dict(env or {})
        self.api_keys = api_keys
        self.python = python or sys.executable
        # The embedder, its Celery indexing worker and the retriever (RAG, search); GOODPUT_KNOWLEDGE=0 leaves them out.
        self.knowledge = knowledge if knowledge is not None else os.environ.get("GOODPUT_KNOWLEDGE", "1") != "0"
        # The response cache (L1 exact + L2 semantic); GOODPUT_RESPONSE_CACHE=0 leaves it out (the gateway then runs
        # uncached).
        self.cache = cache if cache is not None else os.environ.get("GOODPUT_RESPONSE_CACHE", "1") != "0"
        # Deferred batch jobs: shed P2 requests parked in Redis and finished by a Celery worker (GOODPUT_JOBS=0: off).
        self.jobs = jobs if jobs is not None else os.environ.get("GOODPUT_JOBS", "1") != "0"
        self.dev_key: str | None = read_dev_key(self.workdir) if api_keys is None else None
        self.redis_url = self.env.get("GOODPUT_REDIS_URL") or os.environ.get("GOODPUT_REDIS_URL") or DEFAULT_REDIS_URL
        if redis_db is not None:
            self.redis_url = redis_db_url(self.redis_url, redis_db)
        self.insecure_internal = insecure_internal
        self._use_redis_users = redis_users
        self.redis_users: RedisUsers | None = None  # made at start, with the Redis URL then
        self._redis_urls: dict[str, str] = {}
        self._jobs_mac_key = ""
        self._lock_file: IO[str] | None = None
        self._procs: dict[str, Proc] = {}
        self._order: list[str] = []
        self._lock = threading.RLock()
        self._atexit_registered = False

    # --- addresses ------------------------------------------------------------------------------------------------
    @property
    def gateway_http(self) -> str:
        return self.gateway_http_at(0)

    @property
    def gateway_grpc(self) -> str:
        return self.gateway_grpc_at(0)

    def gateway_http_at(self, i: int) -> str:
        """The REST base URL of gateway replica ``i`` (0 is :attr:`gateway_http`)."""
        self._check_gateway(i)
        return f"http://{HOST}:{http_port('gateway', self.port_offset, i)}"

    @property
    def gateway_metrics(self) -> str:
        """The URL of gateway replica 0's ``/metrics``: on a port of its own, not the public REST port."""
        return self.gateway_metrics_at(0)

    def gateway_metrics_at(self, i: int) -> str:
        self._check_gateway(i)
        return f"http://{HOST}:{metrics_port('gateway', self.port_offset, i)}/metrics"

    def gateway_grpc_at(self, i: int) -> str:
        self._check_gateway(i)
        return grpc_addr("gateway", self.port_offset, i)

    @property
    def scheduler_grpc(self) -> str:
        return grpc_addr("scheduler", self.port_offset)

    def scheduler_grpc_at(self, i: int) -> str:
        """The address of scheduler replica ``i`` (0 is :attr:`scheduler_grpc`)."""
        if not 0 <= i < self.scheduler_replicas:
            raise IndexError(f"scheduler {i} does not exist (replicas: 0..{self.scheduler_replicas - 1})")
        return grpc_addr("scheduler", self.port_offset, i)

    @staticmethod
    def scheduler_name(i: int) -> str:
        """The process name of scheduler replica ``i`` (for kill, restart...)."""
        return "scheduler" if i == 0 else f"scheduler-{i}"

    @property
    def scheduler_http(self) -> str:
        return f"http://{HOST}:{http_port('scheduler', self.port_offset)}"

    @property
    def embedder_grpc(self) -> str:
        return grpc_addr("embedder", self.port_offset)

    @property
    def cache_grpc(self) -> str:
        return grpc_addr("cache", self.port_offset)

    def worker_grpc(self, i: int) -> str:
        self._check_worker(i)
        return grpc_addr("inference", self.port_offset, i)

    def worker_http(self, i: int) -> str:
        self._check_worker(i)
        return f"http://{HOST}:{http_port('inference', self.port_offset, i)}"

    def pool_workers(self, pool: str) -> list[int]:
        """The numbers of ``pool``'s workers (for worker_grpc, kill_worker...).

        >>> from goodput_cli.pools import Pool, worker_pools
        >>> Platform(workdir=Path("."), pools=[Pool(name="a", replicas=2), Pool(name="b")]).pool_workers("b")
        [2]
        """
        numbers = [i for i, p in enumerate(worker_pools(self.pools)) if p.name == pool]
        if not numbers:
            raise KeyError(f"no pool {pool!r} with workers (pools: {', '.join(p.name for p in self.pools) or 'none'})")
        return numbers

    def endpoints(self) -> dict[str, str]:
        """Where each service of this platform answers: gRPC addresses, and the metrics URL of the Celery workers
        (which serve no gRPC). What `goodput status` checks; written to ``up.json`` by `goodput up`."""
        out: dict[str, str] = {"gateway_http": self.gateway_http, "gateway_metrics": self.gateway_metrics}
        for spec in self.plan():
            if spec.name.startswith("worker-"):
                continue
            if spec.grpc_addr:
                out[spec.name] = spec.grpc_addr
            else:
                out[spec.name] = f"http://{HOST}:{http_port(_HTTP_READY[spec.name], self.port_offset)}"
        return out

    # --- identities (mutual TLS) ------------------------------------------------------------------------------------
    @property
    def tls_dir(self) -> Path | None:
        """The development CA's folder; None when internal gRPC is plaintext."""
        return None if self.insecure_internal else self.workdir / TLS_DIR

    def tls_files(self, identity: str = OPERATOR) -> TlsFiles:
        """The certificate, key and CA of ``identity`` (a topology key or ``operator``), made by ``start``."""
        if self.tls_dir is None:
            raise PlatformError("this platform runs internal gRPC in plaintext (insecure_internal=True)")
        return tls_files(self.tls_dir, identity)

    def credentials(self, identity: str = OPERATOR) -> grpc.ChannelCredentials | None:
        """Channel credentials presenting ``identity``'s certificate; None on a plaintext platform."""
        return None if self.tls_dir is None else self.tls_files(identity).channel_credentials()

    def internal_channel(self, address: str, *, identity: str = OPERATOR,
                         options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A (blocking) channel to an internal service of this platform, as ``identity`` (the operator by default),
        over mutual TLS; plaintext on a plaintext platform. The gateway's public port needs no certificate."""
        creds = self.credentials(identity)
        if creds is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, creds, options=options)

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def api_keys_file(self) -> Path:
        return self.workdir / "api-keys.json"

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def _check_gateway(self, i: int) -> None:
        if not 0 <= i < self.gateways:
            raise IndexError(f"gateway {i} does not exist (gateways: 0..{self.gateways - 1})")

    def _check_worker(self, i: int) -> None:
        if not 0 <= i < self.workers:
            raise IndexError(f"worker {i} does not exist (workers: 0..{self.workers - 1})")

    # --- what runs ------------------------------------------------------------------------------------------------
    def plan(self) -> list[ServiceSpec]:
        """The Goodput services in start order (Redis is not part of it: it is started only when missing)."""
        return plan(self._wiring())

    def _wiring(self) -> Wiring:
        return Wiring(workdir=self.workdir, workers=self.workers, port_offset=self.port_offset, python=self.python,
                      redis_url=self.redis_url, knowledge=self.knowledge, cache=self.cache, jobs=self.jobs,
                      gateways=self.gateways, inherited={**os.environ, **self.env}, tls_dir=self.tls_dir,
                      pools=self.pools, scheduler_replicas=self.scheduler_replicas, engine=self.engine,
                      redis_urls=self._redis_urls, jobs_mac_key=self._jobs_mac_key)

    def child_env(self, spec: ServiceSpec) -> dict[str, str]:
        """The full environment of a child: gRPC's experiments (:data:`goodput_core.clients.GRPC_EXPERIMENTS`), then
        the supervisor's environment, then ``env``, then the spec's wiring."""
        return {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS, **os.environ, **self.env, **spec.env}

    # --- lifecycle --------------------------------------------------------------------------------------------------
    def __enter__(self) -> Platform:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 900, *, console: Console | None = None) -> None:
        """Starts every service and waits until all serve; on failure stops what it started and raises PlatformError.

        ``console``: where to show progress (a live table on a terminal, one line per change otherwise); None is
        silent.
        """
        if self._procs:
            raise PlatformError("already started; stop() first")
        deadline = time.monotonic() + timeout_s
        self._claim_state()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.api_keys is None:
            self.dev_key = write_dev_keys(self.workdir)
        else:
            write_keys_file(self.workdir, self.api_keys)
        if self.tls_dir is not None:
            ensure_dev_pki(self.tls_dir, IDENTITIES, prefix=platform_prefix({**os.environ, **self.env}))
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            self._ensure_redis(deadline)
            self._create_redis_users()
            self._jobs_mac_key = own_secret(self.workdir / JOBS_MAC_KEY_FILE)
            for spec in self.plan():
                self._spawn(spec)
            self._wait_ready(deadline, timeout_s, console)
            if self.scheduler_replicas > 1:
                self.wait_leader(timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop(grace_s=5)
            raise

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to every child (gateway first), up to ``grace_s`` to exit, then SIGKILL. Idempotent."""
        with self._lock:
            running = [self._procs[name] for name in reversed(self._order) if name in self._procs]
            self._procs.clear()
            self._order.clear()
        _terminate(running, grace_s)
        if self.redis_users is not None and not any(p.spec.name == "redis" for p in running):
            with contextlib.suppress(redis.RedisError):
                self.redis_users.remove()
        self._release_state()

    def kill_worker(self, i: int) -> None:
        """SIGKILLs worker ``i`` and its engine process at once (a crash, not a drain)."""
        self._check_worker(i)
        self.kill(f"worker-{i}")

    def restart_worker(self, i: int, timeout_s: float = 900) -> None:
        """Starts worker ``i`` again (after ``kill_worker``) and waits until it serves."""
        self._check_worker(i)
        self.restart(f"worker-{i}", timeout_s=timeout_s)

    def names(self) -> list[str]:
        """The children's names, in start order (``redis`` first when the platform started it)."""
        with self._lock:
            return list(self._order)

    def kill(self, name: str) -> None:
        """SIGKILLs child ``name`` and every process of its group (a crash: no drain, no goodbye)."""
        proc = self._proc(name)
        signal_group(proc.popen, signal.SIGCONT)  # a frozen group dies all the same; this keeps its state tidy
        signal_group(proc.popen, signal.SIGKILL)
        proc.popen.wait()
        proc.state = "killed"

    def terminate(self, name: str, grace_s: float = 20) -> None:
        """Stops child ``name`` as Kubernetes stops a pod: SIGTERM, up to ``grace_s`` to exit, then SIGKILL."""
        _terminate([self._proc(name)], grace_s)

    def restart(self, name: str, timeout_s: float = 900) -> None:
        """Starts child ``name`` again (after it was killed, stopped or exited) from the same spec, its log appended
        to, and waits until it serves: a gRPC service's health SERVING, a Celery worker's /healthz, Redis's PING."""
        old = self._proc(name)
        if old.popen.poll() is None:
            raise PlatformError(f"{name} is still running")
        signal_group(old.popen, signal.SIGKILL)  # whatever it left behind in its group (vLLM's engine core)
        self._spawn(old.spec, append_log=True)
        deadline = time.monotonic() + timeout_s
        if name == "redis":
            self._wait_redis(deadline)
            if self.redis_users is not None:  # ACL users live in memory: an append-only file does not keep them
                self.redis_users.apply()
        elif old.spec.grpc_addr:
            self._wait_ready(deadline, timeout_s, None, only=[name], check_scheduler=False)
        elif name in _HTTP_READY:
            self._wait_http(name, f"http://{HOST}:{http_port(_HTTP_READY[name], self.port_offset)}/healthz",
                            deadline)

    def freeze(self, name: str, *, pids: Sequence[int] | None = None) -> list[int]:
        """SIGSTOPs child ``name``'s whole process group, or only ``pids`` (a worker's engine process: see
        :meth:`descendants`): a hung process, alive but doing nothing. Returns the pids stopped; ``thaw`` resumes
        them (``stop`` and ``kill`` too)."""
        return self._signal(name, signal.SIGSTOP, pids)

    def thaw(self, name: str, *, pids: Sequence[int] | None = None) -> list[int]:
        """SIGCONTs what ``freeze`` stopped."""
        return self._signal(name, signal.SIGCONT, pids)

    def descendants(self, name: str) -> list[tuple[int, str]]:
        """The processes child ``name`` started (pid, command line), e.g. vLLM's engine core (``VLLM::EngineCore``)
        under a worker; empty for a service that runs in one process (a worker on the simulated engine)."""
        return procs.descendants(self._proc(name).popen.pid)

    def _signal(self, name: str, sig: signal.Signals, pids: Sequence[int] | None) -> list[int]:
        proc = self._proc(name)
        if pids is None:
            signal_group(proc.popen, sig)
            return [proc.popen.pid]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return list(pids)

    def _proc(self, name: str) -> Proc:
        with self._lock:
            proc = self._procs.get(name)
        if proc is None:
            raise PlatformError(f"{name} is not a child of this platform (children: {', '.join(self.names())})")
        return proc

    def leader(self, timeout_s: float = 1.0) -> int | None:
        """The scheduler replica that leads now (its Scheduler service SERVING), or None while none does."""
        for i in range(self.scheduler_replicas):
            with self.internal_channel(self.scheduler_grpc_at(i)) as channel:
                if check_health(channel, timeout_s, service=SCHEDULER_SERVICE) == "serving":
                    return i
        return None

    def wait_leader(self, timeout_s: float = 30) -> int:
        """Waits until a scheduler replica leads; returns which."""
        deadline = time.monotonic() + timeout_s
        while (i := self.leader()) is None:
            if time.monotonic() > deadline:
                raise PlatformError(f"no scheduler replica leads after {timeout_s:.0f} s; see "
                                    f"{self.log_path('scheduler')}")
            time.sleep(0.2)
        return i

    def pid(self, name: str) -> int | None:
        with self._lock:
            proc = self._procs.get(name)
        return proc.popen.pid if proc is not None else None

    def exited(self) -> dict[str, int]:
        """Children that exited on their own, with their exit codes (kill_worker's victims included)."""
        with self._lock:
            procs = list(self._procs.values())
        return {p.spec.name: rc for p in procs if (rc := p.popen.poll()) is not None}

    # --- internals ----------------------------------------------------------------------------------------------------
    def _claim_state(self) -> None:
        """Holds ``workdir/platform.lock`` while this platform runs: a second platform on the same state folder
        would rewrite the first one's key file and mix its logs, so it is refused, naming the first one."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        f = (self.workdir / LOCK_FILE).open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise PlatformError(f"{self.workdir} is the state folder of a platform that is running ({holder}); "
                                "start this one with its own state folder (goodput up --state-dir DIR), ports "
                                "(--port-offset N) and Redis database (--redis-db N)") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, gateway {self.gateway_http}, redis {self.redis_url}\n")
        f.flush()
        self._lock_file = f

    def _release_state(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the lock
            self._lock_file = None

    def _spawn(self, spec: ServiceSpec, *, append_log: bool = False) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        main_thread = threading.current_thread() is threading.main_thread()
        with spec.log_path.open("ab" if append_log else "wb") as log:
            popen = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
                spec.argv, env=self.child_env(spec), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.workdir,
                # PDEATHSIG fires when the forking *thread* ends: only safe from the main thread.
                preexec_fn=procs.die_with_parent if main_thread and sys.platform == "linux" else None)
        with self._lock:
            self._procs[spec.name] = Proc(spec=spec, popen=popen)
            if spec.name not in self._order:
                self._order.append(spec.name)

    def _ensure_redis(self, deadline: float) -> None:
        url = urlsplit(self.redis_url)
        host, port = url.hostname or HOST, url.port or 6379
        if procs.redis_ping(host, port):
            return
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise PlatformError(f"no Redis answers at {self.redis_url} (GOODPUT_REDIS_URL)")
        binary = shutil.which("redis-server")
        if binary is None:
            raise PlatformError(f"no Redis answers at {self.redis_url} and redis-server is not installed "
                                "(make install installs it; or set GOODPUT_REDIS_URL)")
        argv = [binary, "--bind", host, "--port", str(port), "--save", "", "--daemonize", "no"]
        if self.redis_persistent:  # an append-only file in the state folder: a restart keeps the data
            (self.workdir / REDIS_DIR).mkdir(parents=True, exist_ok=True)
            argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.workdir / REDIS_DIR)]
        else:
            argv += ["--appendonly", "no"]
        spec = ServiceSpec(name="redis", env={}, argv=argv, grpc_addr=None, log_path=self.log_path("redis"))
        self._spawn(spec)
        self._wait_redis(min(deadline, time.monotonic() + 15))

    def _create_redis_users(self) -> None:
        """One ACL user per identity that uses Redis; their key prefixes and channel as the children will have them."""
        if not self._use_redis_users:
            return
        self.redis_users = RedisUsers(self.workdir, self.redis_url)
        channel = version_channel(self.redis_url)
        env = {**os.environ, **self.env, "GOODPUT_EMBEDDER_VERSION_CHANNEL": channel,
               "GOODPUT_CACHE_VERSION_CHANNEL": channel}
        try:
            users = [k for k in self._wiring().running() if k != "scheduler" or self.scheduler_replicas > 1]
            self._redis_urls = self.redis_users.create(users, env)
        except redis.ResponseError as err:
            raise PlatformError(f"could not create the platform's Redis users with the credentials of "
                                f"{urlsplit(self.redis_url).hostname} ({err}); give GOODPUT_REDIS_URL a user that may "
                                "run ACL SETUSER, or start with --no-redis-users") from None

    def _wait_redis(self, deadline: float) -> None:
        proc = self._proc("redis")
        url = urlsplit(self.redis_url)
        host, port = url.hostname or HOST, url.port or 6379
        while not procs.redis_ping(host, port):
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise PlatformError(f"redis-server did not start on port {port}; last lines of "
                                    f"{proc.spec.log_path}:\n{log_tail(proc.spec.log_path)}")
            time.sleep(0.1)
        proc.state = "serving"

    def _wait_http(self, name: str, url: str, deadline: float) -> None:
        import httpx

        proc = self._proc(name)
        while True:
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    proc.state = "serving"
                    return
            except httpx.HTTPError:
                pass
            if proc.popen.poll() is not None:
                raise PlatformError(f"{name} exited with code {proc.popen.returncode} while starting; last lines of "
                                    f"{proc.spec.log_path}:\n{log_tail(proc.spec.log_path)}")
            if time.monotonic() > deadline:
                raise PlatformError(f"{name} did not answer {url} in time; see {proc.spec.log_path}")
            time.sleep(0.2)

    def _wait_ready(self, deadline: float, timeout_s: float, console: Console | None, *,
                    only: list[str] | None = None, check_scheduler: bool = True) -> None:
        with self._lock:
            procs = [p for p in self._procs.values()
                     if p.spec.grpc_addr and (only is None or p.spec.name in only)]
        channels = {p.spec.name: self._probe_channel(p.spec) for p in procs}
        view = Progress(console, procs)
        try:
            with view:
                pending = list(procs)
                while pending:
                    for p in list(pending):
                        rc = p.popen.poll()
                        if rc is not None:
                            p.state = f"exited ({rc})"
                            view.update()
                            raise PlatformError(f"{p.spec.name} exited with code {rc} while starting; last lines "
                                                f"of {p.spec.log_path}:\n{log_tail(p.spec.log_path)}")
                        health = check_health(channels[p.spec.name])
                        if health == "serving":
                            # Twice in a row: a server answers SERVING for "" for an instant before it marks
                            # itself NOT_SERVING to load its model.
                            if p.state == "serving":
                                pending.remove(p)
                            p.state = "serving"
                        elif health == "not serving":
                            p.state = "loading" if p.spec.name.startswith("worker-") else "not serving"
                        else:
                            p.state = "starting"
                    view.update()
                    if pending and time.monotonic() > deadline:
                        first = pending[0]
                        raise PlatformError(
                            f"timed out after {timeout_s:.0f} s waiting for {', '.join(p.spec.name for p in pending)}"
                            f" to serve; last lines of {first.spec.log_path}:\n{log_tail(first.spec.log_path)}")
                    if pending:
                        time.sleep(0.5)
                if check_scheduler and "scheduler" in channels:
                    self._wait_workers_healthy(channels["scheduler"], deadline, timeout_s, view)
        finally:
            for ch in channels.values():
                ch.close()

    def _probe_channel(self, spec: ServiceSpec) -> grpc.Channel:
        """Health checks as the operator over mTLS (the gateway's public port: plaintext)."""
        if spec.tls:
            return self.internal_channel(str(spec.grpc_addr), options=_PROBE_OPTIONS)
        return grpc.insecure_channel(str(spec.grpc_addr), options=_PROBE_OPTIONS)

    def _wait_workers_healthy(self, channel: grpc.Channel, deadline: float, timeout_s: float,
                              view: Progress) -> None:
        """Waits until the scheduler has seen every worker healthy, so the first request is placed at once."""
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        sched = self._procs["scheduler"]
        while True:
            try:
                reply = stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                healthy = -1
            else:
                healthy = sum(1 for w in reply.workers if w.healthy)
            if healthy >= self.workers:
                sched.state = "serving"
                view.update()
                return
            sched.state = f"serving, {max(healthy, 0)}/{self.workers} workers healthy"
            view.update()
            if sched.popen.poll() is not None:
                raise PlatformError(f"scheduler exited with code {sched.popen.returncode}; last lines of "
                                    f"{sched.spec.log_path}:\n{log_tail(sched.spec.log_path)}")
            if time.monotonic() > deadline:
                raise PlatformError(f"timed out after {timeout_s:.0f} s: the scheduler sees {max(healthy, 0)} of "
                                    f"{self.workers} workers healthy; see {sched.spec.log_path}")
            time.sleep(0.5)


def _terminate(running: Sequence[Proc], grace_s: float) -> None:
    """SIGTERM to each child still running, up to ``grace_s`` for all of them to exit, then SIGKILL."""
    for p in running:
        if p.popen.poll() is None:
            signal_group(p.popen, signal.SIGCONT)  # a frozen child would not act on SIGTERM
            signal_group(p.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in running:
        # Also reaches grandchildren left behind by a child that exited (vLLM's engine core).
        signal_group(p.popen, signal.SIGKILL)
        p.popen.wait()
        p.state = "stopped"
