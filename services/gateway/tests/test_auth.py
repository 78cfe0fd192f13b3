from __future__ import annotations

import json
from pathlib import Path

import pytest
from goodput.common.v1 import types_pb2

from goodput_core.errors import PermissionDenied, Unauthenticated

from goodput_gateway.auth import ApiKeyStore, KeysFileWatcher, Quota, sha256_hex


def store(tmp_path: Path) -> ApiKeyStore:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"key_sha256": sha256_hex("secret-acme"), "tenant": "acme", "max_priority": "P0", "default_priority": "P1"},
        {"key_sha256": sha256_hex("secret-batch"), "tenant": "batch", "max_priority": "P2"},
    ]}))
    return ApiKeyStore.from_sources(file=str(path), inline=json.dumps([{"key": "inline", "tenant": "dev"}]))


def test_keys_map_to_tenants_and_priorities(tmp_path: Path) -> None:
    keys = store(tmp_path)
    acme = keys.authenticate("Bearer secret-acme")
    assert acme.tenant == "acme"
    assert acme.resolve_priority(types_pb2.PRIORITY_UNSPECIFIED) == types_pb2.PRIORITY_P1
    assert acme.resolve_priority(types_pb2.PRIORITY_P0) == types_pb2.PRIORITY_P0
    batch = keys.authenticate("bearer secret-batch")
    assert batch.resolve_priority(types_pb2.PRIORITY_UNSPECIFIED) == types_pb2.PRIORITY_P2
    with pytest.raises(PermissionDenied):
        batch.resolve_priority(types_pb2.PRIORITY_P1)
    assert keys.authenticate("Bearer inline").tenant == "dev"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", "Bearer wrong", "Bearer secret-acme2"])
def test_missing_or_wrong_keys_are_rejected(tmp_path: Path, header: str | None) -> None:
    with pytest.raises(Unauthenticated):
        store(tmp_path).authenticate(header)


def test_only_hashes_are_kept(tmp_path: Path) -> None:
    keys = store(tmp_path)
    assert "secret-acme" not in repr(keys._by_digest)  # noqa: SLF001 - asserting on the stored form


def test_bad_key_files_fail_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps({"keys": [{"tenant": "x"}]}))
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps({"keys": [{"key": "k"}]}))
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps(
            {"keys": [{"key": "k", "tenant": "t", "max_priority": "P2", "default_priority": "P0"}]}))


def test_limits_come_from_the_tenant_over_the_defaults_and_keys_have_their_own() -> None:
    keys = ApiKeyStore.from_sources(inline=json.dumps({
        "defaults": {"rpm": 600, "tpm": 200_000, "max_concurrent": 32, "weight": 1},
        "tenants": {"acme": {"rpm": 1200, "monthly_tokens": 5_000_000, "monthly_soft": 0.9, "weight": 3}},
        "keys": [{"id": "acme-ci", "key": "k-ci", "tenant": "acme", "rpm": 60, "max_priority": "P0"},
                 {"key": "k-globex", "tenant": "globex", "operator": True}]}))
    ci = keys.authenticate("Bearer k-ci")
    assert ci.key_id == "acme-ci" and ci.weight == 3.0 and not ci.operator
    assert ci.tenant_quota == Quota(rpm=1200, tpm=200_000, max_concurrent=32, monthly_tokens=5_000_000,
                                    monthly_soft=0.9)
    assert ci.key_quota == Quota(rpm=60)
    globex = keys.authenticate("Bearer k-globex")
    assert globex.tenant_quota == Quota(rpm=600, tpm=200_000, max_concurrent=32)  # the defaults
    assert globex.key_id == sha256_hex("k-globex")[:12] and globex.operator and globex.weight == 1.0
    assert not globex.key_quota.limited


@pytest.mark.parametrize("doc,named", [
    ({"keys": [{"key": "k", "tenant": "t", "rmp": 5}]}, "keys.0.rmp"),  # a typo is refused by name
    ({"tenants": {"t": {"rpm": -1}}, "keys": []}, "tenants.t.rpm"),
    ({"tenants": {"t": {"weight": 0}}, "keys": []}, "tenants.t.weight"),
    ({"keys": [{"key": "k", "tenant": "t"}, {"key": "k", "tenant": "u"}]}, "listed twice"),
    ({"keys": [{"key_sha256": "abc", "tenant": "t"}]}, "keys.0.key_sha256"),
    # names become parts of Redis keys: a ':' would mix this tenant's keys with another's, "tenants" is the usage
    # index's own word
    ({"keys": [{"key": "k", "tenant": "acme:usage"}]}, "keys.0.tenant"),
    ({"keys": [{"key": "k", "tenant": "tenants"}]}, "keys.0.tenant"),
    ({"keys": [{"key": "k", "tenant": ""}]}, "keys.0.tenant"),
    ({"keys": [{"key": "k", "tenant": "t", "id": "ops key"}]}, "keys.0.id"),
    ({"tenants": {"a/b": {}}, "keys": []}, "tenants"),
])
def test_a_bad_keys_document_is_refused_naming_the_field(doc: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        ApiKeyStore.from_sources(inline=json.dumps(doc))


def write_keys(path: Path, *keys: str) -> None:
    path.write_text(json.dumps({"keys": [{"key_sha256": sha256_hex(k), "tenant": "acme"} for k in keys]}))


def test_a_rotated_key_stops_working_when_the_file_is_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    write_keys(path, "old-key")
    keys = ApiKeyStore.from_sources(file=str(path))
    watcher = KeysFileWatcher(keys, file=str(path), interval_s=1)
    held = keys.authenticate("Bearer old-key")  # a request in flight keeps its principal
    assert not watcher.check()  # unchanged
    write_keys(path, "new-key", "another-key")
    assert watcher.check()
    with pytest.raises(Unauthenticated):
        keys.authenticate("Bearer old-key")
    assert keys.authenticate("Bearer new-key").tenant == held.tenant == "acme"
    assert len(keys) == 2 and watcher.reloads.labels("ok")._value.get() == 1  # noqa: SLF001


def test_a_broken_keys_file_keeps_the_keys_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    write_keys(path, "good-key")
    keys = ApiKeyStore.from_sources(file=str(path))
    watcher = KeysFileWatcher(keys, file=str(path), interval_s=1)
    path.write_text('{"keys": [')  # half-written
    assert not watcher.check()
    assert keys.authenticate("Bearer good-key").tenant == "acme"
    assert watcher.reloads.labels("error")._value.get() == 1  # noqa: SLF001
    write_keys(path, "good-key", "second-key")  # fixed: picked up at the next check
    assert watcher.check() and keys.authenticate("Bearer second-key").tenant == "acme"


def test_a_parked_job_runs_as_its_tenant_until_the_tenant_has_no_key() -> None:
    keys = ApiKeyStore.from_sources(inline=json.dumps({"tenants": {"acme": {"tpm": 10, "weight": 2}},
                                                       "keys": [{"key": "k", "tenant": "acme", "rpm": 1}]}))
    p2 = types_pb2.PRIORITY_P2
    job = keys.tenant_principal("acme", priority=p2)
    assert (job.tenant, job.max_priority, job.weight, job.tenant_quota.tpm) == ("acme", p2, 2.0, 10)
    assert not job.key_quota.limited and job.key_id == ""  # the submitting key's own limits are not the job's
    keys.replace([])
    with pytest.raises(Unauthenticated):
        keys.tenant_principal("acme", priority=p2)
