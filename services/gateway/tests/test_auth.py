from __future__ import annotations

import json
from pathlib import Path

import pytest
from goodput.common.v1 import types_pb2

from goodput_core.errors import PermissionDenied, Unauthenticated

from goodput_gateway.auth import ApiKeyStore, sha256_hex


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
    assert "secret-acme" not in repr(keys._entries)  # noqa: SLF001 - asserting on the stored form


def test_bad_key_files_fail_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps({"keys": [{"tenant": "x"}]}))
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps({"keys": [{"key": "k"}]}))
    with pytest.raises(ValueError):
        ApiKeyStore.from_sources(inline=json.dumps(
            {"keys": [{"key": "k", "tenant": "t", "max_priority": "P2", "default_priority": "P0"}]}))
