"""Redis behind the same identity rules as gRPC, black-box: a platform started as ``goodput up`` starts it (real
processes, real Redis, a simulated inference worker) gives each service its own Redis ACL user
(``goodput_contracts.redis_access``). Redis itself refuses what a service's credentials were not granted -- the
cache's cannot write a job, the embedder's cannot touch a tenant's budget -- and a job record written with the
gateway's own credentials but without the MAC of the jobs' key is refused by the jobs worker: never run, whoever
it names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis

from goodput_testing import wait_until

from goodput_cli.redis_users import USERS_FILE
from goodput_cli.supervisor import Platform
from goodput_gateway.jobs.messages import celery_send

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 4900
REDIS_DB = 13
KEY = "test-key-acl"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    keys = {"tenants": {"victim": {"monthly_tokens": 1_000_000}},
            "keys": [{"key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "acl", "max_priority": "P2"}]}
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    # A Redis database of its own, emptied first: no other platform's jobs wait in its queue's fair order.
    p = Platform(workdir=tmp_path_factory.mktemp("acl"), workers=1, port_offset=PORT_OFFSET, env=env, api_keys=keys,
                 knowledge=True, cache=True, jobs=True, redis_db=REDIS_DB)
    redis.Redis.from_url(p.redis_url).flushdb()
    with p:
        yield p


def user_url(platform: Platform, identity: str) -> str:
    assert platform.redis_users is not None
    return platform.redis_users.url(identity)


def client(platform: Platform, identity: str) -> redis.Redis:
    """A Redis client with ``identity``'s credentials, as that service has them."""
    return redis.Redis.from_url(user_url(platform, identity), socket_timeout=5)


def test_each_service_has_its_own_user_and_its_file_is_private(platform: Platform) -> None:
    path = platform.workdir / USERS_FILE
    assert path.stat().st_mode & 0o077 == 0
    users = json.loads(path.read_text())["users"]
    assert set(users) == {"gateway", "jobsWorker", "embedder", "indexWorker", "cache"}
    assert len({u["password"] for u in users.values()}) == len(users)
    for identity in users:
        assert client(platform, identity).ping()


def test_the_caches_credentials_cannot_write_a_job_or_announce_a_version(platform: Platform) -> None:
    cache = client(platform, "cache")
    with pytest.raises(redis.exceptions.NoPermissionError):
        cache.set("goodput:jobs:job:job-forged", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        cache.incr("goodput:kb:victim:handbook:version")  # the indexer's versions: read-only to the cache
    with pytest.raises(redis.exceptions.NoPermissionError):
        cache.publish("goodput:kb-version", "victim:handbook:9")
    cache.get("goodput:kb:victim:handbook:version")  # what it needs: reading them
    cache.set("goodput:cache:acl-probe", "1")
    cache.delete("goodput:cache:acl-probe")


def test_the_embedders_credentials_cannot_touch_quotas_usage_or_the_whole_store(platform: Platform) -> None:
    embedder = client(platform, "embedder")
    for write in (lambda: embedder.delete("goodput:quota:month:tenant:victim:2026-12"),
                  lambda: embedder.set("goodput:quota:epoch", "op:reset"),
                  lambda: embedder.hincrby("goodput:usage:victim:2026-12", "tokens", -1000),
                  lambda: embedder.get("goodput:responses:victim:resp-1"),
                  lambda: embedder.flushall(), lambda: embedder.keys("*"),
                  lambda: embedder.execute_command("CONFIG", "SET", "maxmemory", "1"),
                  lambda: embedder.execute_command("ACL", "SETUSER", "me", "on", "+@all", "~*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    with pytest.raises(redis.exceptions.NoPermissionError):  # nor the jobs' queue
        embedder.lpush("goodput-jobs:goodput-jobs", "{}")


def test_the_gateways_credentials_cannot_reach_the_caches_entries_or_the_indexers_queue(platform: Platform) -> None:
    gateway = client(platform, "gateway")
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.hset("goodput:cache:e:poison", "meta", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.lpush("goodput-index:goodput-index", "{}")


def wait_job(http: httpx.Client, job_id: str, state: str) -> dict[str, object]:
    seen: dict[str, object] = {}

    def reached() -> bool:
        seen.update(http.get(f"/v1/jobs/{job_id}").json())
        return seen.get("status") == state
    try:
        wait_until(reached, timeout=60, interval=0.3)
    except AssertionError:
        raise AssertionError(f"job {job_id} did not reach {state}: {seen}") from None
    return seen


def test_a_job_written_with_the_gateways_user_but_without_the_mac_never_runs(platform: Platform) -> None:
    admin = redis.Redis.from_url(platform.redis_url)
    with httpx.Client(base_url=platform.gateway_http, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        # A job the gateway sealed runs: the worker is there and works.
        resp = http.post("/v1/jobs", json={"endpoint": "/v1/chat/completions",
                                           "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}})
        assert resp.status_code == 202, resp.text
        done = wait_job(http, resp.json()["id"], "completed")
        # The same record, rewritten to run as another tenant and sent to the worker with the gateway's Redis user.
        raw = json.loads(admin.get(f"goodput:jobs:job:{done['id']}"))
        forged_id = "job-forged-" + raw["id"][4:]
        forged = {**raw, "id": forged_id, "tenant": "victim", "key": "", "state": "queued", "dispatch": 1,
                  "claim": "", "result": None, "attempts": 0, "mac": "0" * 64}
        gateway = client(platform, "gateway")
        gateway.set(f"goodput:jobs:job:{forged_id}", json.dumps(forged), ex=600)
        verdicts = admin.hgetall("goodput:jobs:messages")
        before = int(verdicts.get(b"forged", 0))
        celery_send(SimpleNamespace(redis_url=user_url(platform, "gateway"),
                                    jobs=SimpleNamespace(queue="goodput-jobs")))(forged_id, 1, 0.0)
        wait_until(lambda: int(admin.hget("goodput:jobs:messages", "forged") or 0) > before, timeout=30,
                   message="the jobs worker did not refuse the forged job")
        assert admin.get(f"goodput:jobs:job:{forged_id}") is None  # deleted unrun
        assert not admin.keys("goodput:usage:victim:*")  # nothing ran as the victim
        assert http.get(f"/v1/jobs/{forged_id}").status_code == 404
        # A record forged in place of a real one is not shown to its tenant either.
        gateway.set(f"goodput:jobs:job:{done['id']}", json.dumps({**raw, "result": {"forged": True}}), ex=600)
        assert http.get(f"/v1/jobs/{done['id']}").status_code == 404


def test_stopping_the_platform_deletes_its_users(tmp_path: Path) -> None:
    p = Platform(workdir=tmp_path, workers=1, port_offset=PORT_OFFSET + 100,
                 env={"GOODPUT_INFERENCE_ENGINE": "sim"}, knowledge=False, cache=False, jobs=False)
    with p:
        assert p.redis_users is not None
        name = p.redis_users.user("gateway")
        admin = redis.Redis.from_url(p.redis_url)
        assert name.encode() in admin.execute_command("ACL", "USERS")
    assert name.encode() not in admin.execute_command("ACL", "USERS")
