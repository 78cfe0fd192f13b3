"""Tenants in the chart: the API keys as a mounted Secret file that follows rotations, the quota and metering
settings of the gateway (and of the jobsWorker, which runs parked jobs through the gateway's pipeline under their
tenant's limits), the quota Redis and its credentials, and the schema's bounds on all of them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "goodput"
ALL_SCENARIOS = [None, *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
GW = "GOODPUT_GATEWAY_"


def _config(chart: Any, docs: list[dict[str, Any]], component: str) -> dict[str, str]:
    return chart.by_kind(docs, "ConfigMap")[component]["data"]


def _pod(chart: Any, docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return chart.by_kind(docs, "Deployment")[component]["spec"]["template"]["spec"]


def _env(chart: Any, docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    (container,) = _pod(chart, docs, component)["containers"]
    return container.get("env", [])


def test_api_keys_are_a_mounted_secret_file_that_follows_rotations(chart: Any) -> None:
    """An SRE rotates a key by updating the Secret: the kubelet rewrites the mounted file (it would not under a
    subPath mount, nor in env) and the gateway re-reads it within API_KEYS_RELOAD_S; no restart."""
    docs = chart.docs()
    pod = _pod(chart, docs, "gateway")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "goodput-api-keys"
    assert volume["secret"]["items"] == [{"key": "api-keys.json", "path": "api-keys.json"}]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/goodput/api-keys", "readOnly": True}  # no subPath
    config = _config(chart, docs, "gateway")
    assert config[GW + "API_KEYS_FILE"] == "/etc/goodput/api-keys/api-keys.json"
    assert config[GW + "API_KEYS_RELOAD_S"] == "2"
    assert GW + "API_KEYS" not in {e["name"] for e in container.get("env", [])}
    # The jobsWorker runs a parked job under its tenant's limits and budget, which the keys file holds: the same
    # file, mounted the same way, so a revoked tenant's jobs stop too.
    jobs = _pod(chart, docs, "jobs-worker")
    assert [v for v in jobs["volumes"] if v["name"] == "api-keys"] == [volume]
    assert [m for m in jobs["containers"][0]["volumeMounts"] if m["name"] == "api-keys"] == [mount]
    jobs_config = _config(chart, docs, "jobs-worker")
    assert jobs_config[GW + "API_KEYS_FILE"] == config[GW + "API_KEYS_FILE"]
    assert jobs_config[GW + "API_KEYS_RELOAD_S"] == "2"
    # Nothing else reads the keys.
    for component, deploy in chart.by_kind(docs, "Deployment").items():
        if component not in ("gateway", "jobs-worker"):
            assert "api-keys" not in {v["name"] for v in deploy["spec"]["template"]["spec"]["volumes"]}, component


def test_api_keys_file_follows_key_mount_path_and_reload_values(chart: Any) -> None:
    docs = chart.docs(sets=("apiKeys.existingSecret=tenant-keys", "apiKeys.key=keys.json",
                            "apiKeys.mountPath=/var/run/goodput/keys"), set_json=("apiKeys.reloadSeconds=0.5",))
    pod = _pod(chart, docs, "gateway")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "tenant-keys"
    assert volume["secret"]["items"] == [{"key": "keys.json", "path": "keys.json"}]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["mountPath"] == "/var/run/goodput/keys"
    config = _config(chart, docs, "gateway")
    assert config[GW + "API_KEYS_FILE"] == "/var/run/goodput/keys/keys.json"
    assert config[GW + "API_KEYS_RELOAD_S"] == "0.5"
    # No Secret (development only): nothing mounted, no file setting, so the gateway starts without keys.
    dev = chart.docs("cpu-dev-values.yaml")
    assert "api-keys" not in {v["name"] for v in _pod(chart, dev, "gateway")["volumes"]}
    assert GW + "API_KEYS_FILE" not in _config(chart, dev, "gateway")


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_no_secret_is_mounted_with_a_sub_path(chart: Any, values: str | None) -> None:
    """A subPath mount of a Secret never sees the Secret change: rotated keys and renewed certificates would be
    missed until the pod restarts."""
    for component, deploy in chart.by_kind(chart.docs(values), "Deployment").items():
        spec = deploy["spec"]["template"]["spec"]
        secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
        for c in spec["containers"]:
            for m in c["volumeMounts"]:
                assert not (m["name"] in secrets and "subPath" in m), f"{component}: {m}"


def test_quota_and_metering_settings_reach_the_gateway_and_the_jobs_worker(chart: Any) -> None:
    docs = chart.docs()
    gw, jobs = _config(chart, docs, "gateway"), _config(chart, docs, "jobs-worker")
    expected = {
        "QUOTAS__PREFIX": "goodput:quota",
        "QUOTAS__TIMEOUT_S": "0.5",
        "QUOTAS__FAIL_OPEN_SHARE": "0.5",  # 1 / gateway.autoscaling.minReplicas (2)
        "QUOTAS__RETRY_S": "5",
        "QUOTAS__QUANTUM_S": "0",
        "METERING__USAGE_PREFIX": "goodput:usage",
        "METERING__RETENTION_DAYS": "400",
        "METERING__FLUSH_S": "1",
        "METERING__PREFILL_TOKENS_PER_S": "10000",
        "METERING__DECODE_TOKENS_PER_S": "2500",
    }
    for name, value in expected.items():
        assert gw[GW + name] == value, name
        assert jobs[GW + name] == value, name
    # No tenant named in the metrics by default (every tenant is "other": bounded cardinality).
    assert GW + "METRICS_TENANTS" not in gw
    # The quota counters live in the gateway's own Redis (REDIS_URL): no QUOTA_REDIS_URL of their own.
    env = {e["name"]: e for e in _env(chart, docs, "gateway")}
    assert GW + "QUOTA_REDIS_URL" not in env and GW + "QUOTA_REDIS_URL" not in gw
    assert env[GW + "REDIS_URL"]["value"].endswith("@redis-master.goodput-data.svc.cluster.local:6379/0")

    docs = chart.docs(sets=("tenancy.quotas.prefix=acme:quota", "tenancy.metering.usagePrefix=acme:usage",
                            "tenancy.metering.usageRetentionDays=31", "tenancy.metering.metricsTenants={acme,globex}",
                            "tenancy.metering.prefillTokensPerSecond=20000"),
                      set_json=("tenancy.quotas.timeoutSeconds=0.05", "tenancy.quotas.retrySeconds=2.5",
                                "tenancy.metering.decodeTokensPerSecond=1200.5", "tenancy.metering.flushSeconds=0.25"))
    gw, jobs = _config(chart, docs, "gateway"), _config(chart, docs, "jobs-worker")
    for name, value in {"QUOTAS__PREFIX": "acme:quota", "QUOTAS__TIMEOUT_S": "0.05", "QUOTAS__RETRY_S": "2.5",
                        "METERING__USAGE_PREFIX": "acme:usage", "METERING__RETENTION_DAYS": "31",
                        "METRICS_TENANTS": "acme,globex",
                        "METERING__PREFILL_TOKENS_PER_S": "20000", "METERING__DECODE_TOKENS_PER_S": "1200.5",
                        "METERING__FLUSH_S": "0.25"}.items():
        assert gw[GW + name] == jobs[GW + name] == value, name
    every = _config(chart, chart.docs(sets=("tenancy.metering.metricsTenants={*}",)), "gateway")
    assert every[GW + "METRICS_TENANTS"] == "*"


@pytest.mark.parametrize(
    ("values", "sets", "share"),
    [
        (None, (), "0.5"),  # HPA, minReplicas 2
        (None, ("gateway.autoscaling.minReplicas=4",), "0.25"),
        ("autoscaling-off-values.yaml", (), "0.3333"),  # 3 fixed replicas
        ("cpu-dev-values.yaml", (), "1"),  # one replica: its local bound is the whole limit
        (None, ("tenancy.quotas.failOpenShare=0.2",), "0.2"),  # set explicitly (--set-json: a number)
        ("autoscaling-off-values.yaml", ("tenancy.quotas.failOpenShare=1",), "1"),
    ],
)
def test_fail_open_share_splits_each_limit_over_the_gateway_replicas(
    chart: Any, values: str | None, sets: tuple[str, ...], share: str
) -> None:
    """While the quota Redis is unreachable each replica enforces this fraction of every limit: with the default, N
    replicas together allow about the limit, not N times it."""
    docs = chart.docs(values, set_json=sets)
    assert _config(chart, docs, "gateway")[GW + "QUOTAS__FAIL_OPEN_SHARE"] == share


def test_a_quota_redis_of_its_own_takes_its_password_from_a_secret(chart: Any) -> None:
    docs = chart.docs(sets=("tenancy.quotas.redis.url=redis://quota-redis.data:6379/2",
                            "tenancy.quotas.redis.existingSecret=quota-auth",
                            "redisUsers.enabled=false"))  # else the services' own users: test_chart_redis.py
    for component in ("gateway", "jobs-worker"):
        env = _env(chart, docs, component)
        names = [e["name"] for e in env]
        by_name = {e["name"]: e for e in env}
        assert by_name["GOODPUT_QUOTA_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "quota-auth", "key": "redis-password"}, component
        assert by_name[GW + "QUOTA_REDIS_URL"]["value"] == (
            "redis://:$(GOODPUT_QUOTA_REDIS_PASSWORD)@quota-redis.data:6379/2"), component
        # Kubernetes expands $(VAR) only from entries defined before it.
        assert names.index("GOODPUT_QUOTA_REDIS_PASSWORD") < names.index(GW + "QUOTA_REDIS_URL"), component
        # The jobs keep the gateway's Redis.
        assert by_name[GW + "REDIS_URL"]["value"].endswith("redis-master.goodput-data.svc.cluster.local:6379/0")
    # Only the gateway's pods get the quota Redis.
    for component in ("scheduler", "cache", "embedder"):
        assert "GOODPUT_QUOTA_REDIS_PASSWORD" not in {e["name"] for e in _env(chart, docs, component)}, component

    # Without a password; and without the gateway's Redis (no jobs), quotas are still shared across replicas.
    docs = chart.docs(sets=("tenancy.quotas.redis.url=redis://quota-redis.data:6379/2",
                            "gateway.config.useRedis=false", "redisUsers.enabled=false"))
    env = {e["name"]: e for e in _env(chart, docs, "gateway")}
    assert env[GW + "QUOTA_REDIS_URL"] == {"name": GW + "QUOTA_REDIS_URL", "value": "redis://quota-redis.data:6379/2"}
    assert GW + "REDIS_URL" not in env and "GOODPUT_QUOTA_REDIS_PASSWORD" not in env

    # A password for the gateway's own Redis belongs in external.redis.existingSecret.
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path),
                      "--set", "tenancy.quotas.redis.existingSecret=quota-auth"])
    assert proc.returncode != 0 and "tenancy.quotas.redis.url is empty" in proc.stderr


def _notes(chart: Any, tmp_path: Path, *values: str | None, sets: tuple[str, ...] = ()) -> str:
    """NOTES.txt as `helm install` would print it. helm renders NOTES only on install, which needs a cluster: a copy
    of the chart renders it through `tpl` into a ConfigMap that `helm template` shows."""
    copy = tmp_path / "goodput"
    shutil.copytree(chart.path, copy)
    shutil.copy(copy / "templates" / "NOTES.txt", copy / "notes.src")
    (copy / "templates" / "notes-as-configmap.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n'
        '  NOTES.txt: {{ tpl (.Files.Get "notes.src") . | quote }}\n')
    cmd = [chart.helm, "template", "goodput", str(copy), "--show-only", "templates/notes-as-configmap.yaml"]
    for v in values:
        if v:
            cmd += ["-f", str(chart.path / "ci" / v)]
    for s in sets:
        cmd += ["--set", s]
    proc = chart.run(cmd)
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(copy)
    return str(yaml.safe_load(proc.stdout)["data"]["NOTES.txt"])


WARNING = "WARNING: the gateway runs more than one replica but has no Redis for tenants' quotas"


def test_notes_warn_when_replicas_would_count_quotas_apart(chart: Any, tmp_path: Path) -> None:
    assert WARNING in _notes(chart, tmp_path, sets=("gateway.config.useRedis=false",))
    assert WARNING in _notes(chart, tmp_path, "autoscaling-off-values.yaml", sets=("gateway.config.useRedis=false",))
    # Shared counters (the gateway's Redis, or a quota Redis of its own), or a single replica: no warning.
    assert WARNING not in _notes(chart, tmp_path)
    assert WARNING not in _notes(chart, tmp_path, sets=("gateway.config.useRedis=false",
                                                        "tenancy.quotas.redis.url=redis://quota-redis:6379/0"))
    assert WARNING not in _notes(chart, tmp_path, "cpu-dev-values.yaml", sets=("gateway.config.useRedis=false",))


SHARED = "NOTE: the quota counters share one Redis (external.redis) with the data tenants store"


def test_notes_say_when_the_quota_counters_share_the_data_redis(chart: Any, tmp_path: Path) -> None:
    assert SHARED in _notes(chart, tmp_path)  # the default: one Redis for every role
    assert SHARED not in _notes(chart, tmp_path, sets=("external.queueRedis.url=redis://queue-redis:6379/0",))
    assert SHARED not in _notes(chart, tmp_path, sets=("tenancy.quotas.redis.url=redis://quota-redis:6379/0",))
    assert SHARED not in _notes(chart, tmp_path, sets=("gateway.config.useRedis=false",))


@pytest.mark.parametrize(
    "bad",
    [
        'tenancy.quotaz={"prefix": "x"}',  # misspelt block
        "tenancy.quotas.failOpenShare=0",  # would refuse everything while Redis is down
        "tenancy.quotas.failOpenShare=1.5",  # more than the limit per replica
        "tenancy.quotas.timeoutSeconds=0",
        "tenancy.quotas.retrySeconds=-1",
        "tenancy.quotas.quantumSeconds=61",
        'tenancy.quotas.redis.url="quota-redis:6379"',  # no scheme
        'tenancy.quotas.redis.url="redis://:hunter2@quota-redis:6379/0"',  # credentials belong in existingSecret
        "tenancy.metering.usageRetentionDays=0",
        "tenancy.metering.flushSeconds=0",
        "tenancy.metering.prefillTokensPerSecond=0",
        "tenancy.metering.decodeTokensPerSecond=-5",
        'tenancy.metering.metricsTenants=["*", "acme"]',  # "*" is every tenant: alone or not at all
        'tenancy.metering.metricsTenants=["acme,globex"]',  # one tenant per item (they are joined with commas)
        'tenancy.metering.metricsTenants="acme"',  # a list, not a string
        "apiKeys.reloadSeconds=-1",
        'apiKeys.key="../passwd"',  # a file name inside the mount
        'apiKeys.mountPath="etc/keys"',  # relative
    ],
)
def test_schema_rejects_bad_tenancy_values(chart: Any, bad: str) -> None:
    # --set-json, so that numbers arrive as numbers (--set passes 1.5 as a string, refused for its type alone).
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path), "--set-json", bad])
    assert proc.returncode != 0, f"--set-json {bad} was accepted"
    assert "schema" in proc.stderr, proc.stderr
    key = bad.split("=", 1)[0].rsplit(".", 1)[-1]
    assert key in proc.stderr, proc.stderr  # refused for this value, not another


def test_schema_accepts_the_documented_shapes(chart: Any) -> None:
    for good in ("tenancy.quotas.failOpenShare=1", "tenancy.quotas.failOpenShare=null", 'apiKeys.existingSecret=""',
                 'tenancy.metering.metricsTenants=["*"]', 'tenancy.metering.metricsTenants=["acme", "globex"]',
                 "apiKeys.reloadSeconds=0"):
        chart.text(set_json=(good,))
