"""The supervisor's process plumbing: what a child is (:class:`ServiceSpec`), how it is signalled, probed and
pinned to CPUs, and how its log is read back. No knowledge of which services exist (that is :mod:`goodput_cli.plan`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["PlatformError", "Proc", "ServiceSpec", "check_health", "cpu_bindings", "descendants", "die_with_parent",
           "log_tail", "redis_ping", "signal_group"]

LOG_TAIL_LINES = 40


class PlatformError(RuntimeError):
    """A service could not be started (it exited, or did not serve in time). The message ends with its log tail."""


@dataclass(frozen=True)
class ServiceSpec:
    """How one child process is started. ``env`` holds only the variables the supervisor sets for it. ``tls``: its
    gRPC port serves mutual TLS (an internal service), so it is probed with the operator's certificate."""

    name: str
    argv: list[str]
    env: dict[str, str]
    grpc_addr: str | None
    log_path: Path
    tls: bool = False


@dataclass
class Proc:
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
    return [_cpu_list(cpus[i * per:(i + 1) * per] if per else [cpus[i % len(cpus)]]) for i in range(workers)]


def _cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": runs of consecutive CPUs (a constant CPU minus position) as ranges."""
    runs = [[c for _, c in run] for _, run in itertools.groupby(enumerate(cpus), lambda ic: ic[1] - ic[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def redis_ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    # "-NOAUTH ..." still means a Redis server is there.
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """Signals the child's whole process group (vLLM's engine core is a grandchild)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below ``pid`` (children first, then theirs), each with its command line; Linux only (empty
    elsewhere, or once ``pid`` is gone).

    >>> import sys
    >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    >>> try:
    ...     [p for p, _ in descendants(os.getpid())].count(child.pid)
    ... finally:
    ...     child.kill(); _ = child.wait()
    1
    """
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        children: list[int] = []
        try:
            for task in Path(f"/proc/{parent}/task").iterdir():
                children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append((child, cmdline.strip()))
            todo.append(child)
    return out


def die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def check_health(channel: grpc.Channel, timeout_s: float = 1.0, *, service: str = "") -> str:
    """'serving', 'not serving' (the server answers but is not ready) or 'down', for ``service`` ("": the server)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s)
    except grpc.RpcError:
        return "down"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not serving"


