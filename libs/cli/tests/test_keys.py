"""The development key: only its hash reaches the gateway's key file; the plain key is private to its owner."""

from __future__ import annotations

import hashlib
import json
import stat

from goodput_cli.keys import read_dev_key, write_dev_keys


def test_key_file_holds_only_the_hash(tmp_path):
    key = write_dev_keys(tmp_path)

    assert key.startswith("gp-dev-")
    text = (tmp_path / "api-keys.json").read_text()
    assert key not in text
    assert json.loads(text) == {"keys": [{"id": "dev", "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                          "tenant": "dev", "max_priority": "P0", "default_priority": "P0"}]}


def test_plain_key_is_readable_by_its_owner_only(tmp_path):
    key = write_dev_keys(tmp_path)

    assert read_dev_key(tmp_path) == key
    assert stat.S_IMODE((tmp_path / "dev-key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "api-keys.json").stat().st_mode) == 0o600


def test_key_is_kept_across_restarts_so_copied_examples_keep_working(tmp_path):
    assert write_dev_keys(tmp_path) == write_dev_keys(tmp_path)


def test_malformed_key_file_is_replaced(tmp_path):
    (tmp_path / "dev-key").write_text("not a key\n")

    assert write_dev_keys(tmp_path).startswith("gp-dev-")
