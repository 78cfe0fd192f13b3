"""Redis roles in the chart: one Redis (external.redis) by default, or separate instances for the response cache's
entries (external.cacheRedis) and for the Celery queues and job stores (external.queueRedis), each wired to the
services of its role with its own password Secret, and the chart rendering exactly as before when they are unset."""

from __future__ import annotations

from typing import Any

import pytest

MAIN = "redis://redis-master.goodput-data.svc.cluster.local:6379/0"
CACHE = "redis://cache-redis.data:6379/0"
QUEUES = "redis://queue-redis.data:6379/0"
# component -> env prefix, for the services that use Redis
USERS = {"gateway": "GOODPUT_GATEWAY_", "jobs-worker": "GOODPUT_GATEWAY_", "embedder": "GOODPUT_EMBEDDER_",
         "indexing-worker": "GOODPUT_EMBEDDER_", "cache": "GOODPUT_CACHE_"}
QUEUE_USERS = ("gateway", "jobs-worker", "embedder", "indexing-worker")
# The roles and their Secrets as wired without the services' own Redis users (redisUsers.enabled=false): with them,
# each URL carries its service's user instead (test_each_service_connects_as_its_own_redis_user).
SHARED = "redisUsers.enabled=false"


def _env(chart: Any, docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    (container,) = chart.by_kind(docs, "Deployment")[component]["spec"]["template"]["spec"]["containers"]
    return list(container.get("env", []))


def _values(chart: Any, docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The Redis-related env entries: name -> value, or the secretKeyRef of a password (rendered without the
    services' own Redis users: their URLs are test_each_service_connects_as_its_own_redis_user's)."""
    return {e["name"]: e.get("value", e.get("valueFrom", {}).get("secretKeyRef"))
            for e in _env(chart, docs, component) if "REDIS" in e["name"]}


def test_one_redis_by_default_and_the_same_render_with_the_options_empty(chart: Any) -> None:
    docs = chart.docs(sets=(SHARED,))
    for component, prefix in USERS.items():
        assert _values(chart, docs, component) == {prefix + "REDIS_URL": MAIN}, component
    # Empty options are the defaults: not one byte differs, in any scenario.
    for values in (None, *chart.scenarios):
        assert chart.text(values, sets=("external.cacheRedis.url=", "external.queueRedis.url=",
                                        "external.queueRedis.existingSecret=")) == chart.text(values), values


def test_a_cache_redis_of_its_own_holds_the_entries_and_versions_stay_with_the_indexer(chart: Any) -> None:
    docs = chart.docs(sets=(SHARED, f"external.cacheRedis.url={CACHE}",))
    # The cache's entries there; the knowledge-base versions read and followed where the embedder writes them.
    assert _values(chart, docs, "cache") == {"GOODPUT_CACHE_REDIS_URL": CACHE, "GOODPUT_CACHE_KB_REDIS_URL": MAIN}
    for component in QUEUE_USERS:
        assert _values(chart, docs, component) == {USERS[component] + "REDIS_URL": MAIN}, component


def test_a_queue_redis_of_its_own_holds_the_queues_and_job_stores_and_quotas_stay(chart: Any) -> None:
    docs = chart.docs(sets=(SHARED, f"external.queueRedis.url={QUEUES}",))
    for component in ("gateway", "jobs-worker"):
        # parked jobs, batches and the Celery broker on the queues' Redis; quotas, usage, responses on the main one
        assert _values(chart, docs, component) == {"GOODPUT_GATEWAY_REDIS_URL": QUEUES,
                                                   "GOODPUT_GATEWAY_QUOTA_REDIS_URL": MAIN}, component
    for component in ("embedder", "indexing-worker"):  # indexing jobs, content hashes, KB versions
        assert _values(chart, docs, component) == {"GOODPUT_EMBEDDER_REDIS_URL": QUEUES}, component
    assert _values(chart, docs, "cache") == {"GOODPUT_CACHE_REDIS_URL": MAIN, "GOODPUT_CACHE_KB_REDIS_URL": QUEUES}
    # A quota Redis of its own still wins.
    docs = chart.docs(sets=(SHARED, f"external.queueRedis.url={QUEUES}", "tenancy.quotas.redis.url=redis://quota:6379/2"))
    assert _values(chart, docs, "gateway")["GOODPUT_GATEWAY_QUOTA_REDIS_URL"] == "redis://quota:6379/2"
    # Without jobs the gateway has no REDIS_URL (nor a quota Redis), as before; the indexer keeps its queues' Redis.
    docs = chart.docs(sets=(SHARED, f"external.queueRedis.url={QUEUES}", "gateway.config.useRedis=false"))
    assert _values(chart, docs, "gateway") == {}
    assert "jobs-worker" not in chart.by_kind(docs, "Deployment")
    assert _values(chart, docs, "embedder") == {"GOODPUT_EMBEDDER_REDIS_URL": QUEUES}


def test_each_redis_takes_its_password_from_its_own_secret(chart: Any) -> None:
    docs = chart.docs(sets=(SHARED, f"external.cacheRedis.url={CACHE}", "external.cacheRedis.existingSecret=cache-auth",
                            f"external.queueRedis.url={QUEUES}", "external.queueRedis.existingSecret=queue-auth",
                            "external.queueRedis.passwordKey=pw", "external.redis.existingSecret=main-auth"))
    main = {"name": "main-auth", "key": "redis-password"}
    cache = {"name": "cache-auth", "key": "redis-password"}
    queue = {"name": "queue-auth", "key": "pw"}
    with_queue_password = {"GOODPUT_REDIS_QUEUE_PASSWORD": queue}
    expected = {
        "gateway": {**with_queue_password, "GOODPUT_GATEWAY_REDIS_URL": "redis://:$(GOODPUT_REDIS_QUEUE_PASSWORD)"
                    "@queue-redis.data:6379/0", "GOODPUT_REDIS_PASSWORD": main,
                    "GOODPUT_GATEWAY_QUOTA_REDIS_URL": "redis://:$(GOODPUT_REDIS_PASSWORD)"
                    "@redis-master.goodput-data.svc.cluster.local:6379/0"},
        "embedder": {**with_queue_password,
                     "GOODPUT_EMBEDDER_REDIS_URL": "redis://:$(GOODPUT_REDIS_QUEUE_PASSWORD)@queue-redis.data:6379/0"},
        "cache": {"GOODPUT_REDIS_CACHE_PASSWORD": cache,
                  "GOODPUT_CACHE_REDIS_URL": "redis://:$(GOODPUT_REDIS_CACHE_PASSWORD)@cache-redis.data:6379/0",
                  **with_queue_password,
                  "GOODPUT_CACHE_KB_REDIS_URL": "redis://:$(GOODPUT_REDIS_QUEUE_PASSWORD)@queue-redis.data:6379/0"},
    }
    expected["jobs-worker"] = expected["gateway"]
    expected["indexing-worker"] = expected["embedder"]
    for component, want in expected.items():
        assert _values(chart, docs, component) == want, component
        # Kubernetes expands $(VAR) only from entries defined before it.
        names = [e["name"] for e in _env(chart, docs, component)]
        for name, value in want.items():
            if isinstance(value, str) and "$(" in value:
                assert names.index(value.split("$(")[1].split(")")[0]) < names.index(name), (component, name)


@pytest.mark.parametrize("bad", [
    "external.cacheRedis.url=cache-redis:6379",  # no scheme
    "external.queueRedis.host=queue-redis",  # unknown key
    "external.queueRedis.passwordKey=",
])
def test_schema_refuses_bad_redis_options(chart: Any, bad: str) -> None:
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path), "--set", bad])
    assert proc.returncode != 0 and "values don't meet the specifications of the schema" in proc.stderr, bad


def test_a_password_for_an_unset_redis_is_refused(chart: Any) -> None:
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path),
                      "--set", "external.cacheRedis.existingSecret=cache-auth"])
    assert proc.returncode != 0 and "external.cacheRedis.url is empty" in proc.stderr


def test_each_service_connects_as_its_own_redis_user(chart: Any) -> None:
    """By default every Redis URL carries its service's own ACL user (goodput_contracts.redis_access) and that user's
    password from the release's credentials Secret; a pre-install hook Job creates the users on every Redis the
    release uses, with each Redis's own admin Secret."""
    docs = chart.docs(sets=(f"external.queueRedis.url={QUEUES}", "external.queueRedis.existingSecret=queue-auth",
                            "external.redis.existingSecret=main-auth"))
    users = {"gateway": "gateway", "jobs-worker": "jobsWorker", "embedder": "embedder",
             "indexing-worker": "indexWorker", "cache": "cache"}
    for component, user in users.items():
        values = _values(chart, docs, component)
        urls = {k: v for k, v in values.items() if k.endswith("REDIS_URL")}
        assert urls and all(v.startswith(f"redis://goodput-{user}:$(") for v in urls.values()), (component, values)
        refs = [v for v in values.values() if isinstance(v, dict)]
        assert refs and all(r == {"name": "goodput-credentials", "key": f"redis-{user}"} for r in refs), values
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "goodput-credentials"]
    assert set(secret["data"]) == {f"redis-{u}" for u in (*users.values(), "scheduler")} | {"jobs-mac-key"}
    assert secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    (job,) = chart.by_kind(docs, "Job").values()
    assert int(job["metadata"]["annotations"]["helm.sh/hook-weight"]) > -10  # after the Secret it reads
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "goodput_gateway.redis_users"]
    admins = [command[i + 1] for i, a in enumerate(command) if a == "--admin-url"]
    assert admins == ["redis://:$(GOODPUT_REDIS_ADMIN_REDIS)@redis-master.goodput-data.svc.cluster.local:6379/0",
                      "redis://:$(GOODPUT_REDIS_ADMIN_QUEUE)@queue-redis.data:6379/0"]
    env = {e["name"] for e in container["env"]}
    assert {f"GOODPUT_REDIS_PASSWORD_{u.upper()}" for u in users.values()} <= env
    assert {"GOODPUT_REDIS_ADMIN_REDIS", "GOODPUT_REDIS_ADMIN_QUEUE"} <= env
    # The jobs' MAC key reaches the gateway and the jobs worker only.
    for component in ("gateway", "jobs-worker", "cache", "embedder"):
        names = {e["name"] for e in _env(chart, docs, component)}
        assert ("GOODPUT_GATEWAY_JOBS__MAC_KEY" in names) == (component in ("gateway", "jobs-worker")), component


def test_the_chart_makes_a_password_for_every_identity_of_the_redis_access_table(chart: Any) -> None:
    from goodput_contracts.redis_access import REDIS_ACCESS

    (secret,) = [d for d in chart.docs() if d["kind"] == "Secret" and d["metadata"]["name"] == "goodput-credentials"]
    assert {k.removeprefix("redis-") for k in secret["data"] if k.startswith("redis-")} == set(REDIS_ACCESS)
