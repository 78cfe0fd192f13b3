"""A Redis for tests: the one on 127.0.0.1:6379 when it answers, otherwise a ``redis-server`` this module starts."""

from __future__ import annotations

import shutil
import socket
import subprocess

from goodput_testing._ports import free_port
from goodput_testing._wait import wait_until


def redis_answers(host: str = "127.0.0.1", port: int = 6379, *, timeout: float = 0.5) -> bool:
    """True when a Redis answers PING on ``host:port`` (a closed port or another server answers False).

    Example:
        >>> from goodput_testing import dead_port
        >>> redis_answers(port=dead_port())
        False
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A throwaway ``redis-server`` on a free local port, without persistence; a context manager.

    Example::

        with RedisServer() as server:
            client = redis.Redis.from_url(server.url)
    """

    def __init__(self, binary: str | None = None, *, start_timeout_s: float = 10.0) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("no redis-server binary (make install installs it)")
        self.binary = found
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.port = free_port()
        self._proc = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                       "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: redis_answers(port=self.port) or self._exited(), timeout=self.start_timeout_s,
                       message="redis-server did not answer")
        except AssertionError:
            self.stop()
            raise
        if self._exited():
            self.stop()
            raise RuntimeError(f"redis-server exited at start (port {self.port})")
        return self

    def _exited(self) -> bool:
        return self._proc is not None and self._proc.poll() is not None

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def delete_keys(redis_url: str, prefix: str) -> None:
    """Deletes every key that starts with ``prefix`` (best effort: a server already gone leaves nothing)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # a test that stopped the server (or a server already gone) leaves nothing to clean
    finally:
        client.close()
