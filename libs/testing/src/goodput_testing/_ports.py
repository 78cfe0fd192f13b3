"""Local ports for tests: one to listen on, one nothing listens on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (bound, then closed): for a server a test starts in another process, which must be
    told its port up front (in-process servers bind port 0 and report theirs instead).

    Example:
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", free_port()))
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def dead_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on: a store or a service that is down (connections to it are refused).

    Example:
        >>> socket.create_connection(("127.0.0.1", dead_port()), timeout=1)
        Traceback (most recent call last):
        ...
        ConnectionRefusedError: [Errno 111] Connection refused
    """
    return free_port(host)
