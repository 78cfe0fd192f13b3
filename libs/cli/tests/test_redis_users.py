"""The Redis ACL table (goodput_contracts.redis_access), both ways, against a real Redis: each identity's user can
read and write every key family of its grant (read only where the grant says so) and nothing of any other family,
uses its channel only in its direction, and runs no dangerous command."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from goodput_contracts.redis_access import REDIS_ACCESS

from goodput_cli.plan import redis_db_url
from goodput_cli.redis_users import USERS_FILE, RedisUsers

# One key of every family any identity is granted (its pattern, the wildcard filled in).
SAMPLES = sorted({k.pattern({}).removeprefix("%R").removeprefix("~").replace("*", "probe")
                  for grant in REDIS_ACCESS.values() for k in grant.keys})


@pytest.fixture
def scratch(redis_url: str) -> str:
    """A Redis database of its own, emptied (the sample keys name real families: never a platform's data)."""
    url = redis_db_url(redis_url, 14)
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def users(scratch: str, tmp_path: Path) -> Iterator[dict[str, redis.Redis]]:
    made = RedisUsers(tmp_path, scratch)
    made.create(REDIS_ACCESS, {})
    yield {i: redis.Redis.from_url(made.url(i), socket_timeout=5) for i in REDIS_ACCESS}
    made.remove()


def test_every_identity_reaches_its_key_families_and_no_others(users: dict[str, redis.Redis], scratch: str) -> None:
    admin = redis.Redis.from_url(scratch)
    for identity, client in users.items():
        patterns = [k.pattern({}) for k in REDIS_ACCESS[identity].keys]
        writable = [p.removeprefix("~") for p in patterns if p.startswith("~")]
        readable = [*writable, *(p.removeprefix("%R~") for p in patterns if p.startswith("%R~"))]
        for key in SAMPLES:
            if any(fnmatch.fnmatchcase(key, p) for p in readable):
                client.get(key)
            else:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.get(key)
            if any(fnmatch.fnmatchcase(key, p) for p in writable):
                client.set(key, "x", ex=5)
                admin.delete(key)
            else:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.set(key, "x")
    # The table's point, said plainly.
    with pytest.raises(redis.exceptions.NoPermissionError):
        users["cache"].set("goodput:jobs:job:job-1", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        users["embedder"].incrby("goodput:quota:month:tenant:acme:2026-12", -1000)


@pytest.mark.parametrize("command", [("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"), ("CONFIG", "GET", "maxmemory"),
                                     ("ACL", "WHOAMI"), ("SWAPDB", "0", "1"), ("SHUTDOWN",),
                                     ("CLIENT", "KILL", "ID", "1")])
def test_no_identity_runs_a_dangerous_command(users: dict[str, redis.Redis], command: tuple[str, ...]) -> None:
    for client in users.values():
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)


def test_channels_are_used_in_one_direction_only(users: dict[str, redis.Redis]) -> None:
    users["embedder"].publish("goodput:kb-version", "x")  # the indexer announces
    with pytest.raises(redis.exceptions.NoPermissionError):
        users["cache"].publish("goodput:kb-version", "x")  # the cache only listens
    with pytest.raises(redis.exceptions.NoPermissionError):
        users["gateway"].publish("goodput:kb-version", "x")
    pubsub = users["cache"].pubsub()
    pubsub.subscribe("goodput:kb-version")
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    pubsub.close()


def test_the_users_file_is_private_and_names_each_password_once(users: dict[str, redis.Redis], tmp_path: Path) -> None:
    path = tmp_path / USERS_FILE
    assert path.stat().st_mode & 0o077 == 0
    written = json.loads(path.read_text())["users"]
    assert set(written) == set(REDIS_ACCESS)
    assert len({u["password"] for u in written.values()}) == len(written)
