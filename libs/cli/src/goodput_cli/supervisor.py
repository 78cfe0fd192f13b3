"""Runs the whole platform on one machine, each service as its own child process, for `goodput up` and for tests.

Start order: Redis (only when nothing answers on ``GOODPUT_REDIS_URL``), the inference workers, the scheduler, the
embedder, the retriever and a Celery indexing worker (unless ``knowledge=False`` or ``GOODPUT_KNOWLEDGE=0``), the
gateway. Every child runs ``<python> -m goodput_<svc>`` in its own session, configured only through the environment
variables of docs/services.md, with stdout and stderr in ``<workdir>/logs/<name>.log``. ``start`` returns once
every gRPC server answers the standard health check with SERVING and the scheduler sees every worker healthy.

Example:
    >>> platform = Platform(workdir=tmp_path, workers=2, port_offset=1000)
    >>> platform.start()                      # ~2 minutes on CPU: the workers load vLLM
    >>> httpx.post(platform.gateway_http + "/v1/chat/completions",
    ...            headers={"Authorization": f"Bearer {platform.dev_key}"}, json={...})
    >>> platform.kill_worker(1)               # SIGKILL, like a crashed pod
    >>> platform.stop()

It is also a context manager (``with Platform(workdir=...) as p:`` starts and stops). Children never outlive the
supervisor: ``stop`` runs from ``finally``/``atexit``, and on Linux a child started from the main thread also gets
SIGTERM from the kernel when the supervisor dies without cleaning up.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.live import Live
from rich.table import Table

from goodput_cli.keys import read_dev_key, write_dev_keys, write_keys_file

__all__ = ["DEFAULT_REDIS_URL", "Platform", "PlatformError", "ServiceSpec", "cpu_bindings"]

HOST = "127.0.0.1"
GATEWAY_GRPC, GATEWAY_HTTP = 50051, 8080
SCHEDULER_GRPC, SCHEDULER_HTTP = 50052, 9102
WORKER_GRPC, WORKER_HTTP = 50061, 9161
EMBEDDER_GRPC, EMBEDDER_HTTP, INDEX_WORKER_HTTP = 50053, 9103, 9106
JOBS_WORKER_HTTP = 9107
RETRIEVER_GRPC, RETRIEVER_HTTP = 50054, 9104
CACHE_GRPC, CACHE_HTTP = 50055, 9105
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_KV_CACHE_SPACE_GB = "1"
LOG_TAIL_LINES = 40

# Short reconnect backoff: the default grows to minutes, which would hide a server that just came up.
_PROBE_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


class PlatformError(RuntimeError):
    """A service could not be started (it exited, or did not serve in time). The message ends with its log tail."""


@dataclass(frozen=True)
class ServiceSpec:
    """How one child process is started. ``env`` holds only the variables the supervisor sets for it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    grpc_addr: str | None
    log_path: Path


@dataclass
class _Proc:
    spec: ServiceSpec
    popen: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    state: str = "starting"


def cpu_bindings(workers: int, cpus: list[int] | None = None) -> list[str | None]:
    """Disjoint CPU sets (VLLM_CPU_OMP_THREADS_BIND syntax) for ``workers`` engines on this machine's CPUs.

    One worker keeps vLLM's own choice (None). With more workers than CPUs, workers share CPUs round-robin.

    >>> cpu_bindings(2, [0, 1])
    ['0', '1']
    >>> cpu_bindings(2, [0, 1, 2, 3, 4])
    ['0-1', '2-3']
    """
    if workers <= 1:
        return [None] * workers
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = len(cpus) // workers
    if per == 0:
        return [_cpu_list([cpus[i % len(cpus)]]) for i in range(workers)]
    return [_cpu_list(cpus[i * per:(i + 1) * per]) for i in range(workers)]


def _cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def _redis_ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    # "-NOAUTH ..." still means a Redis server is there.
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """Signals the child's whole process group (vLLM's engine core is a grandchild)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _check_health(channel: grpc.Channel, timeout_s: float = 1.0) -> str:
    """'serving', 'not serving' (the server answers but is not ready) or 'down'."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return "down"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not serving"


class Platform:
    """The local platform: Redis, ``workers`` inference workers, the scheduler and the gateway as child processes.

    ``env`` is added to every child's environment (after the supervisor's own environment); the ports, addresses
    and worker ids are always the supervisor's. ``api_keys`` are the entries of the gateway's key file; None
    creates a development key (``dev_key``, also in ``workdir/dev-key``) for tenant ``dev`` with P0 allowed.
    """

    def __init__(self, *, workdir: Path, workers: int = 1, port_offset: int = 0, env: dict[str, str] | None = None,
                 api_keys: list[dict[str, Any]] | None = None, python: str | None = None,
                 knowledge: bool | None = None, cache: bool | None = None, jobs: bool | None = None) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
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
        self._procs: dict[str, _Proc] = {}
        self._order: list[str] = []
        self._lock = threading.RLock()
        self._atexit_registered = False

    # --- addresses ------------------------------------------------------------------------------------------------
    @property
    def gateway_http(self) -> str:
        return f"http://{HOST}:{GATEWAY_HTTP + self.port_offset}"

    @property
    def gateway_grpc(self) -> str:
        return f"{HOST}:{GATEWAY_GRPC + self.port_offset}"

    @property
    def scheduler_grpc(self) -> str:
        return f"{HOST}:{SCHEDULER_GRPC + self.port_offset}"

    @property
    def scheduler_http(self) -> str:
        return f"http://{HOST}:{SCHEDULER_HTTP + self.port_offset}"

    def worker_grpc(self, i: int) -> str:
        self._check_worker(i)
        return f"{HOST}:{WORKER_GRPC + i + self.port_offset}"

    def worker_http(self, i: int) -> str:
        self._check_worker(i)
        return f"http://{HOST}:{WORKER_HTTP + i + self.port_offset}"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def api_keys_file(self) -> Path:
        return self.workdir / "api-keys.json"

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def _check_worker(self, i: int) -> None:
        if not 0 <= i < self.workers:
            raise IndexError(f"worker {i} does not exist (workers: 0..{self.workers - 1})")

    # --- what runs ------------------------------------------------------------------------------------------------
    def plan(self) -> list[ServiceSpec]:
        """The Goodput services in start order (Redis is not part of it: it is started only when missing)."""
        inherited = {**os.environ, **self.env}
        bindings = cpu_bindings(self.workers)
        specs: list[ServiceSpec] = []
        for i in range(self.workers):
            env = {
                "GOODPUT_INFERENCE_GRPC_PORT": str(WORKER_GRPC + i + self.port_offset),
                "GOODPUT_INFERENCE_HTTP_PORT": str(WORKER_HTTP + i + self.port_offset),
                "GOODPUT_INFERENCE_WORKER_ID": f"worker-{i}",
            }
            if "GOODPUT_INFERENCE_ENFORCE_EAGER" not in inherited:
                # On CPU, vLLM's graph compilation makes engine start ~4x slower (about 145 s instead of 35 s on
                # 2 cores) for a modest decode speed-up: a local platform starts eager unless told otherwise.
                env["GOODPUT_INFERENCE_ENFORCE_EAGER"] = "true"
            if "GOODPUT_INFERENCE_KV_CACHE_SPACE_GB" not in inherited:
                env["GOODPUT_INFERENCE_KV_CACHE_SPACE_GB"] = DEFAULT_KV_CACHE_SPACE_GB
            if bindings[i] is not None and "VLLM_CPU_OMP_THREADS_BIND" not in inherited:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(bindings[i])
            specs.append(self._spec(f"worker-{i}", "inference", env, self.worker_grpc(i)))
        specs.append(self._spec("scheduler", "scheduler", {
            "GOODPUT_SCHEDULER_GRPC_PORT": str(SCHEDULER_GRPC + self.port_offset),
            "GOODPUT_SCHEDULER_HTTP_PORT": str(SCHEDULER_HTTP + self.port_offset),
            "GOODPUT_SCHEDULER_WORKERS": ",".join(self.worker_grpc(i) for i in range(self.workers)),
            "GOODPUT_SCHEDULER_REDIS_URL": self.redis_url,
        }, self.scheduler_grpc))
        gateway_env = {
            "GOODPUT_GATEWAY_GRPC_PORT": str(GATEWAY_GRPC + self.port_offset),
            "GOODPUT_GATEWAY_HTTP_PORT": str(GATEWAY_HTTP + self.port_offset),
            "GOODPUT_GATEWAY_SCHEDULER_ADDR": self.scheduler_grpc,
            "GOODPUT_GATEWAY_API_KEYS_FILE": str(self.api_keys_file),
        }
        if self.knowledge:
            specs.extend(self._knowledge_plan())
            gateway_env["GOODPUT_GATEWAY_EMBEDDER_ADDR"] = self.embedder_grpc
            gateway_env["GOODPUT_GATEWAY_RETRIEVER_ADDR"] = self.retriever_grpc
        if self.cache:
            # Embeds in-process (no embedder hop or batching window on the lookup path).
            specs.append(self._spec("cache", "cache", {
                "GOODPUT_CACHE_GRPC_PORT": str(CACHE_GRPC + self.port_offset),
                "GOODPUT_CACHE_HTTP_PORT": str(CACHE_HTTP + self.port_offset),
                "GOODPUT_CACHE_REDIS_URL": self.redis_url,
            }, self.cache_grpc))
            gateway_env["GOODPUT_GATEWAY_CACHE_ADDR"] = self.cache_grpc
        if self.jobs:
            gateway_env["GOODPUT_GATEWAY_REDIS_URL"] = self.redis_url
            # The jobs worker runs parked requests through the gateway's own pipeline, so it shares its settings.
            jobs = self._spec("jobs-worker", "gateway", {
                **gateway_env, "GOODPUT_GATEWAY_JOBS_WORKER_HTTP_PORT": str(JOBS_WORKER_HTTP + self.port_offset)}, None)
            specs.append(ServiceSpec(name=jobs.name, env=jobs.env, grpc_addr=None, log_path=jobs.log_path, argv=[
                self.python, "-m", "celery", "-A", "goodput_gateway.jobs", "worker", "-Q",
                inherited.get("GOODPUT_GATEWAY_JOBS_QUEUE", "goodput-jobs"),
                "--pool", "solo", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                "--without-heartbeat"]))
        specs.append(self._spec("gateway", "gateway", gateway_env, self.gateway_grpc))
        return specs

    @property
    def embedder_grpc(self) -> str:
        return f"{HOST}:{EMBEDDER_GRPC + self.port_offset}"

    @property
    def cache_grpc(self) -> str:
        return f"{HOST}:{CACHE_GRPC + self.port_offset}"

    @property
    def retriever_grpc(self) -> str:
        return f"{HOST}:{RETRIEVER_GRPC + self.port_offset}"

    def _knowledge_plan(self) -> list[ServiceSpec]:
        """The embedder, the retriever (the owner of the embedded stores, under ``workdir/retriever-data``) and one
        Celery indexing worker (``--pool solo``: one process, so its metrics port sees every job)."""
        embedder = {"GOODPUT_EMBEDDER_GRPC_PORT": str(EMBEDDER_GRPC + self.port_offset),
                    "GOODPUT_EMBEDDER_HTTP_PORT": str(EMBEDDER_HTTP + self.port_offset),
                    "GOODPUT_EMBEDDER_WORKER_HTTP_PORT": str(INDEX_WORKER_HTTP + self.port_offset),
                    "GOODPUT_EMBEDDER_REDIS_URL": self.redis_url,
                    "GOODPUT_EMBEDDER_RETRIEVER_ADDR": self.retriever_grpc}
        celery = self._spec("index-worker", "embedder", embedder, None)
        celery = ServiceSpec(name=celery.name, env=celery.env, grpc_addr=None, log_path=celery.log_path, argv=[
            self.python, "-m", "celery", "-A", "goodput_embedder.jobs", "worker", "--pool", "solo",
            "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"])
        return [
            self._spec("embedder", "embedder", embedder, self.embedder_grpc),
            self._spec("retriever", "retriever", {
                "GOODPUT_RETRIEVER_GRPC_PORT": str(RETRIEVER_GRPC + self.port_offset),
                "GOODPUT_RETRIEVER_HTTP_PORT": str(RETRIEVER_HTTP + self.port_offset),
                "GOODPUT_RETRIEVER_EMBEDDER_ADDR": self.embedder_grpc,
                "GOODPUT_RETRIEVER_DATA_DIR": str(self.workdir / "retriever-data"),
            }, self.retriever_grpc),
            celery,
        ]

    def _spec(self, name: str, package: str, env: dict[str, str], grpc_addr: str | None) -> ServiceSpec:
        env = {"GOODPUT_REDIS_URL": self.redis_url, "PYTHONUNBUFFERED": "1", **env}
        return ServiceSpec(name=name, argv=[self.python, "-m", f"goodput_{package}"], env=env,
                           grpc_addr=grpc_addr, log_path=self.log_path(name))

    def child_env(self, spec: ServiceSpec) -> dict[str, str]:
        """The full environment of a child: the supervisor's, then ``env``, then the spec's wiring."""
        return {**os.environ, **self.env, **spec.env}

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
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.api_keys is None:
            self.dev_key = write_dev_keys(self.workdir)
        else:
            write_keys_file(self.workdir, self.api_keys)
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            self._ensure_redis(deadline)
            for spec in self.plan():
                self._spawn(spec)
            self._wait_ready(deadline, timeout_s, console)
        except BaseException:
            self.stop(grace_s=5)
            raise

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to every child (gateway first), up to ``grace_s`` to exit, then SIGKILL. Idempotent."""
        with self._lock:
            procs = [self._procs[name] for name in reversed(self._order) if name in self._procs]
            self._procs.clear()
            self._order.clear()
        for p in procs:
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            # Also reaches grandchildren left behind by a child that exited (vLLM's engine core).
            _signal_group(p.popen, signal.SIGKILL)
            p.popen.wait()
            p.state = "stopped"

    def kill_worker(self, i: int) -> None:
        """SIGKILLs worker ``i`` and its engine process at once (a crash, not a drain)."""
        self._check_worker(i)
        with self._lock:
            proc = self._procs.get(f"worker-{i}")
        if proc is None:
            raise PlatformError(f"worker-{i} is not running")
        _signal_group(proc.popen, signal.SIGKILL)
        proc.popen.wait()
        proc.state = "killed"

    def restart_worker(self, i: int, timeout_s: float = 900) -> None:
        """Starts worker ``i`` again (after ``kill_worker``) and waits until it serves."""
        self._check_worker(i)
        name = f"worker-{i}"
        with self._lock:
            old = self._procs.get(name)
        if old is not None and old.popen.poll() is None:
            raise PlatformError(f"{name} is still running")
        spec = next(s for s in self.plan() if s.name == name)
        self._spawn(spec, append_log=True)
        self._wait_ready(time.monotonic() + timeout_s, timeout_s, None, only=[name], check_scheduler=False)

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
    def _spawn(self, spec: ServiceSpec, *, append_log: bool = False) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        main_thread = threading.current_thread() is threading.main_thread()
        with spec.log_path.open("ab" if append_log else "wb") as log:
            popen = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
                spec.argv, env=self.child_env(spec), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.workdir,
                # PDEATHSIG fires when the forking *thread* ends: only safe from the main thread.
                preexec_fn=_die_with_parent if main_thread and sys.platform == "linux" else None)
        with self._lock:
            self._procs[spec.name] = _Proc(spec=spec, popen=popen)
            if spec.name not in self._order:
                self._order.append(spec.name)

    def _ensure_redis(self, deadline: float) -> None:
        url = urlsplit(self.redis_url)
        host, port = url.hostname or HOST, url.port or 6379
        if _redis_ping(host, port):
            return
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise PlatformError(f"no Redis answers at {self.redis_url} (GOODPUT_REDIS_URL)")
        binary = shutil.which("redis-server")
        if binary is None:
            raise PlatformError(f"no Redis answers at {self.redis_url} and redis-server is not installed "
                                "(make install installs it; or set GOODPUT_REDIS_URL)")
        spec = ServiceSpec(
            name="redis", env={},
            argv=[binary, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
                  "--daemonize", "no"],
            grpc_addr=None, log_path=self.log_path("redis"))
        self._spawn(spec)
        proc = self._procs["redis"]
        limit = min(deadline, time.monotonic() + 15)
        while not _redis_ping(host, port):
            if proc.popen.poll() is not None or time.monotonic() > limit:
                raise PlatformError(f"redis-server did not start on port {port}; last lines of "
                                    f"{spec.log_path}:\n{_log_tail(spec.log_path)}")
            time.sleep(0.1)
        proc.state = "serving"

    def _wait_ready(self, deadline: float, timeout_s: float, console: Console | None, *,
                    only: list[str] | None = None, check_scheduler: bool = True) -> None:
        with self._lock:
            procs = [p for p in self._procs.values()
                     if p.spec.grpc_addr and (only is None or p.spec.name in only)]
        channels = {p.spec.name: grpc.insecure_channel(str(p.spec.grpc_addr), options=_PROBE_OPTIONS) for p in procs}
        view = _Progress(console, procs)
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
                                                f"of {p.spec.log_path}:\n{_log_tail(p.spec.log_path)}")
                        health = _check_health(channels[p.spec.name])
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
                            f" to serve; last lines of {first.spec.log_path}:\n{_log_tail(first.spec.log_path)}")
                    if pending:
                        time.sleep(0.5)
                if check_scheduler and "scheduler" in channels:
                    self._wait_workers_healthy(channels["scheduler"], deadline, timeout_s, view)
        finally:
            for ch in channels.values():
                ch.close()

    def _wait_workers_healthy(self, channel: grpc.Channel, deadline: float, timeout_s: float,
                              view: _Progress) -> None:
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
                                    f"{sched.spec.log_path}:\n{_log_tail(sched.spec.log_path)}")
            if time.monotonic() > deadline:
                raise PlatformError(f"timed out after {timeout_s:.0f} s: the scheduler sees {max(healthy, 0)} of "
                                    f"{self.workers} workers healthy; see {sched.spec.log_path}")
            time.sleep(0.5)


class _Progress:
    """A live status table on a terminal; one line per state change elsewhere; nothing without a console."""

    def __init__(self, console: Console | None, procs: list[_Proc]) -> None:
        self.console = console
        self.procs = procs
        self.live: Live | None = None
        self.seen: dict[str, str] = {}
        if console is not None and console.is_terminal:
            self.live = Live(self._table(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> _Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(box=None, show_header=False, pad_edge=False)
        now = time.monotonic()
        for p in self.procs:
            style = "green" if p.state == "serving" else "red" if p.state.startswith("exited") else "yellow"
            table.add_row(p.spec.name, str(p.spec.grpc_addr), f"[{style}]{p.state}[/]",
                          f"{now - p.started_at:5.0f} s", str(p.spec.log_path))
        return table

    def update(self) -> None:
        if self.live is not None:
            self.live.update(self._table())
        elif self.console is not None:
            for p in self.procs:
                if self.seen.get(p.spec.name) != p.state:
                    self.seen[p.spec.name] = p.state
                    self.console.print(f"{p.spec.name} ({p.spec.grpc_addr}): {p.state}", markup=False,
                                       highlight=False)
