"""`goodput keys`: a key is shown once and only its hash is stored; the file stays one the gateway accepts."""

from __future__ import annotations

import hashlib
import json
import stat

import pytest
from typer.testing import CliRunner

from goodput_cli.keys import read_dev_key, write_dev_keys
from goodput_cli.main import app
from goodput_gateway.auth import ApiKeyStore, parse_keys_document

runner = CliRunner()  # click 8.2: result.stdout and result.stderr apart


@pytest.fixture
def keys_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GOODPUT_GATEWAY_API_KEYS_FILE", raising=False)
    monkeypatch.setenv("GOODPUT_STATE_DIR", str(tmp_path))
    return tmp_path / "api-keys.json"


def keys(*args: str):
    return runner.invoke(app, ["keys", *args])


def create(*args: str) -> str:
    result = keys("create", *args)
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


def test_create_prints_the_key_once_and_stores_only_its_hash(keys_file):
    result = keys("create", "--tenant", "acme", "--max-priority", "P0", "--default-priority", "P1", "--rpm", "60")

    assert result.exit_code == 0
    key = result.stdout.strip()
    assert result.stdout == key + "\n" and key.startswith("gp-")  # KEY=$(goodput keys create ...) works
    assert "shown only this once" in result.stderr
    text = keys_file.read_text()
    assert key not in text
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert json.loads(text)["keys"] == [{"id": digest[:12], "tenant": "acme", "key_sha256": digest,
                                         "max_priority": "P0", "default_priority": "P1", "rpm": 60}]


def test_the_gateway_accepts_the_file_and_authenticates_the_printed_key(keys_file):
    key = create("--tenant", "acme", "--id", "acme-ci", "--tpm", "1000", "--operator")
    create("--tenant", "beta")
    assert keys("tenant", "acme", "--rpm", "10", "--monthly-tokens", "5000", "--monthly-soft", "0.5",
                "--weight", "2").exit_code == 0

    store = ApiKeyStore(parse_keys_document(str(keys_file), json.loads(keys_file.read_text())))
    p = store.authenticate(f"Bearer {key}")
    assert (p.tenant, p.key_id, p.operator, p.weight) == ("acme", "acme-ci", True, 2.0)
    assert (p.tenant_quota.rpm, p.tenant_quota.monthly_tokens, p.tenant_quota.monthly_soft) == (10, 5000, 0.5)
    assert p.key_quota.tpm == 1000
    assert len(store) == 2


def test_list_shows_ids_and_digest_prefixes_never_a_key(keys_file):
    key = create("--tenant", "acme", "--id", "acme-ci")
    keys_file.write_text(json.dumps({"keys": [*json.loads(keys_file.read_text())["keys"],
                                              {"id": "t", "tenant": "t", "key": "plain-test-key"}]}))

    result = keys("list")

    assert result.exit_code == 0
    assert "acme-ci" in result.stdout and hashlib.sha256(key.encode()).hexdigest()[:12] in result.stdout
    assert key not in result.stdout and "plain-test-key" not in result.stdout


def test_revoke_removes_the_key_and_an_unknown_id_is_an_error(keys_file):
    create("--tenant", "acme", "--id", "acme-ci")
    create("--tenant", "acme", "--id", "acme-web")

    assert keys("revoke", "acme-ci").exit_code == 0
    assert [k["id"] for k in json.loads(keys_file.read_text())["keys"]] == ["acme-web"]

    again = keys("revoke", "acme-ci")
    assert again.exit_code == 1
    assert "no key with the id 'acme-ci'" in again.stderr


def test_a_duplicate_id_is_refused_and_nothing_is_printed(keys_file):
    create("--tenant", "acme", "--id", "acme-ci")
    before = keys_file.read_text()

    result = keys("create", "--tenant", "other", "--id", "acme-ci")

    assert result.exit_code == 1
    assert result.stdout == "" and "already in" in result.stderr
    assert keys_file.read_text() == before


@pytest.mark.parametrize("args, message", [
    (["--tenant", ""], "tenant: '' is not a name"),
    (["--tenant", "acme:eu"], "tenant: 'acme:eu' is not a name"),
    (["--tenant", "x" * 129], "1 to 128"),
    (["--tenant", "acme", "--id", "i" * 129], "1 to 128"),
    (["--tenant", "acme", "--max-priority", "P1", "--default-priority", "P0"], "more urgent"),
    (["--tenant", "acme", "--monthly-soft", "0"], "(0, 1]"),
])
def test_values_the_gateway_would_refuse_are_refused(keys_file, args, message):
    result = keys("create", *args)

    assert result.exit_code == 1 and message in result.stderr
    assert not keys_file.exists()


def test_tenant_limits_are_merged_with_what_is_there(keys_file):
    keys_file.write_text(json.dumps({"tenants": {"acme": {"rpm": 100, "tpm": 5000, "custom": "kept"}}}))

    result = keys("tenant", "acme", "--rpm", "200", "--weight", "3")

    assert result.exit_code == 0
    assert json.loads(keys_file.read_text())["tenants"] == {"acme": {"rpm": 200, "tpm": 5000, "custom": "kept",
                                                                     "weight": 3}}
    assert keys("tenant", "acme", "--weight", "0").exit_code == 1
    shown = keys("tenant", "acme")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["acme"]["rpm"] == 200


def test_edits_keep_what_they_do_not_know_and_convert_a_bare_list(keys_file):
    keys_file.write_text(json.dumps([{"id": "old", "tenant": "t", "key_sha256": "a" * 64, "note": "by hand"}]))

    create("--tenant", "acme", "--id", "new")

    doc = json.loads(keys_file.read_text())
    assert doc["keys"][0] == {"id": "old", "tenant": "t", "key_sha256": "a" * 64, "note": "by hand"}
    assert [k["id"] for k in doc["keys"]] == ["old", "new"]


def test_the_file_is_private_and_written_by_replacement(keys_file):
    create("--tenant", "acme")
    keys_file.chmod(0o644)
    inode = keys_file.stat().st_ino

    create("--tenant", "acme")

    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert keys_file.stat().st_ino != inode  # a new file renamed over the old: a reader never sees half of one
    assert [p.name for p in keys_file.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_file_option_and_environment_choose_the_file(keys_file, tmp_path, monkeypatch):
    create("--tenant", "a", "--file", str(tmp_path / "one.json"))
    monkeypatch.setenv("GOODPUT_GATEWAY_API_KEYS_FILE", str(tmp_path / "two.json"))
    create("--tenant", "b")

    assert json.loads((tmp_path / "one.json").read_text())["keys"][0]["tenant"] == "a"
    assert json.loads((tmp_path / "two.json").read_text())["keys"][0]["tenant"] == "b"
    assert not keys_file.exists()


def test_goodput_up_keeps_the_keys_and_tenants_created_with_the_cli(keys_file):
    create("--tenant", "acme", "--id", "acme-ci")
    keys("tenant", "acme", "--rpm", "10")

    dev = write_dev_keys(keys_file.parent)
    again = write_dev_keys(keys_file.parent)  # the next `goodput up`

    doc = json.loads(keys_file.read_text())
    assert again == dev == read_dev_key(keys_file.parent)
    assert [k["id"] for k in doc["keys"]] == ["acme-ci", "dev"]
    assert doc["tenants"] == {"acme": {"rpm": 10}}
    assert doc["keys"][1]["key_sha256"] == hashlib.sha256(dev.encode()).hexdigest()
    parse_keys_document("api-keys.json", doc)


def test_a_new_dev_key_replaces_the_old_one_also_in_an_earlier_format(keys_file):
    keys_file.write_text(json.dumps({"keys": [{"key_sha256": "b" * 64, "tenant": "dev", "max_priority": "P0",
                                               "default_priority": "P0"}]}))

    dev = write_dev_keys(keys_file.parent)

    assert json.loads(keys_file.read_text())["keys"] == [{
        "id": "dev", "key_sha256": hashlib.sha256(dev.encode()).hexdigest(), "tenant": "dev", "max_priority": "P0",
        "default_priority": "P0"}]


def test_goodput_up_moves_an_unreadable_keys_file_aside_instead_of_losing_it(keys_file):
    keys_file.write_text('{"keys": [')

    write_dev_keys(keys_file.parent)

    assert keys_file.with_name("api-keys.json.invalid").read_text() == '{"keys": ['
    assert [k["id"] for k in json.loads(keys_file.read_text())["keys"]] == ["dev"]
    assert keys("list").exit_code == 0
