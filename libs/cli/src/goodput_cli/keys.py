"""The development API key of a local platform.

The gateway only ever sees the key's SHA-256 (``api-keys.json``); the plain key is written, readable by its owner
only, to ``dev-key`` beside it so that ``goodput chat`` and the printed examples can use it.

Example:
    >>> key = write_dev_keys(Path(".goodput"))      # reuses an existing dev key
    >>> read_dev_key(Path(".goodput")) == key
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

KEYS_FILE = "api-keys.json"
DEV_KEY_FILE = "dev-key"
DEV_TENANT = "dev"
_DEV_KEY_RE = re.compile(r"^gp-dev-[0-9a-f]{32}$")


def hash_key(key: str) -> str:
    """The hex SHA-256 of a plain API key, as the gateway's key file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_dev_key() -> str:
    return "gp-dev-" + secrets.token_hex(16)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_dev_key(workdir: Path) -> str | None:
    """The plain dev key kept in ``workdir``, or None when there is none (or it is malformed)."""
    try:
        key = (workdir / DEV_KEY_FILE).read_text().strip()
    except OSError:
        return None
    return key if _DEV_KEY_RE.match(key) else None


def write_keys_file(workdir: Path, entries: list[dict[str, Any]]) -> Path:
    path = workdir / KEYS_FILE
    _write_private(path, json.dumps({"keys": entries}, indent=2) + "\n")
    return path


def write_dev_keys(workdir: Path) -> str:
    """Writes the key file with one P0 key for tenant ``dev`` (hash only) and returns the plain key.

    The key already in ``workdir/dev-key`` is reused, so examples copied from an earlier ``goodput up`` keep working.
    """
    key = read_dev_key(workdir) or new_dev_key()
    write_keys_file(workdir, [{"key_sha256": hash_key(key), "tenant": DEV_TENANT,
                               "max_priority": "P0", "default_priority": "P0"}])
    _write_private(workdir / DEV_KEY_FILE, key + "\n")
    return key


STATE_DIR_NAME = ".goodput"


def default_state_dir() -> Path:
    """The state folder of `goodput up` and of the commands that talk to it: ``$GOODPUT_STATE_DIR``, else
    ``.goodput`` in the current folder."""
    return Path(os.environ.get("GOODPUT_STATE_DIR") or Path.cwd() / STATE_DIR_NAME)
