"""Local ports for tests: one to listen on, one nothing listens on."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANDOM = random.SystemRandom()  # independent of any seed a test sets


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (bound, then closed): for a server a test starts in another process, which must be
    told its port up front (in-process servers bind port 0 and report theirs instead).

    It is drawn at random from below the kernel's ephemeral range (``ip_local_port_range``), not by binding port 0:
    a port from inside that range can be taken by any outgoing connection on the machine between this call and the
    server's bind, and the server then fails to start.

    Example:
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", free_port()))
    """
    low, high = _below_ephemeral()
    for _ in range(200):
        port = _RANDOM.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _below_ephemeral() -> tuple[int, int]:
    """Ports from 20000 up to just below the ephemeral range (Linux's default: 20000-32767)."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    return (20000, first - 1) if first > 21000 else (10000, max(first - 1, 10001))


def dead_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on: a store or a service that is down (connections to it are refused).

    Example:
        >>> socket.create_connection(("127.0.0.1", dead_port()), timeout=1)
        Traceback (most recent call last):
        ...
        ConnectionRefusedError: [Errno 111] Connection refused
    """
    return free_port(host)
