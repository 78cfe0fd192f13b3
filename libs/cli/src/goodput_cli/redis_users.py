"""A local platform's Redis ACL users (:mod:`goodput_contracts.redis_access`): one per identity that uses Redis,
named after the platform (``gp<hash of its state folder>-<identity>``, so platforms sharing a Redis never share a
user), each with a fresh password kept in ``<state folder>/redis-users.json`` (mode 0600) and given to its
processes in their Redis URLs. The supervisor creates them with the credentials of ``GOODPUT_REDIS_URL`` (the
operator's) and deletes them when the platform stops.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import redis

from goodput_contracts import redis_access
from goodput_core.tls import write_private

__all__ = ["USERS_FILE", "RedisUsers"]

USERS_FILE = "redis-users.json"


class RedisUsers:
    def __init__(self, workdir: Path, admin_url: str) -> None:
        self.admin_url = admin_url
        self.path = workdir / USERS_FILE
        self.namespace = "gp" + hashlib.sha256(str(workdir).encode()).hexdigest()[:10]
        self._passwords: dict[str, str] = {}
        self._env: Mapping[str, str] = {}

    def create(self, identities: Iterable[str], env: Mapping[str, str]) -> dict[str, str]:
        """Creates (or resets, with new passwords) the users of ``identities``, their key prefixes read from
        ``env``; returns each identity's Redis URL."""
        self._passwords = {i: redis_access.new_password() for i in identities if i in redis_access.REDIS_ACCESS}
        self._env = env
        self.apply()
        write_private(self.path, json.dumps({"namespace": self.namespace, "users": {
            i: {"user": self.user(i), "password": p} for i, p in self._passwords.items()}}, indent=1).encode())
        return {i: self.url(i) for i in self._passwords}

    def apply(self) -> None:
        """Sets the users on Redis again (a Redis restarted without its data lost them)."""
        with redis.Redis.from_url(self.admin_url, socket_timeout=5) as client:
            redis_access.apply(client, self.namespace, {i: (p, self._env) for i, p in self._passwords.items()})

    def remove(self) -> None:
        if not self._passwords:
            return
        with redis.Redis.from_url(self.admin_url, socket_timeout=2) as client:
            redis_access.remove(client, self.namespace, self._passwords)
        self._passwords = {}

    def user(self, identity: str) -> str:
        return redis_access.user_name(self.namespace, identity)

    def url(self, identity: str) -> str:
        """``identity``'s Redis URL: the platform's, with its own user's credentials."""
        return redis_access.user_url(self.admin_url, self.user(identity), self._passwords[identity])
