"""The gateway's keys file (``api-keys.json``) and the development API key of a local platform.

The gateway only ever sees a key's SHA-256; the plain dev key is written, readable by its owner only, to ``dev-key``
beside the keys file so that ``goodput chat`` and the printed examples can use it. ``goodput up`` keeps whatever
else the keys file holds (the keys and tenants of ``goodput keys``): it only puts the dev key's entry (id ``dev``).

Every write goes through :func:`edit_keys_document`: under a lock, to a private temporary file that replaces the file
at once, so the gateway (which re-reads the file when it changes) never sees half of one.

Example (``state`` is a state folder such as ``.goodput``):
    >>> import tempfile; state = Path(tempfile.mkdtemp())
    >>> key = write_dev_keys(state)                 # reuses an existing dev key
    >>> read_dev_key(state) == key
    True
    >>> with edit_keys_document(state / KEYS_FILE) as doc:
    ...     doc.setdefault("tenants", {})["acme"] = {"rpm": 600}
    >>> write_dev_keys(state) == key                # the next `goodput up` keeps the tenant
    True
    >>> doc = read_keys_document(state / KEYS_FILE)
    >>> doc["tenants"], [key_id(entry) for entry in doc["keys"]]
    ({'acme': {'rpm': 600}}, ['dev'])
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from goodput_core.tls import write_private

__all__ = ["DEV_KEY_FILE", "DEV_KEY_ID", "DEV_TENANT", "KEYS_FILE", "KeysFileError", "default_state_dir",
           "edit_keys_document", "hash_key", "key_digest", "key_id", "read_dev_key", "read_keys_document",
           "write_dev_keys", "write_keys_file"]

KEYS_FILE = "api-keys.json"
DEV_KEY_FILE = "dev-key"
DEV_TENANT = "dev"
DEV_KEY_ID = "dev"
_DEV_KEY_RE = re.compile(r"^gp-dev-[0-9a-f]{32}$")


class KeysFileError(ValueError):
    """The keys file cannot be read as a keys document (not JSON, or not the shape of one)."""


def hash_key(key: str) -> str:
    """The hex SHA-256 of a plain API key, as the gateway's key file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_dev_key() -> str:
    return "gp-dev-" + secrets.token_hex(16)


def read_dev_key(workdir: Path) -> str | None:
    """The plain dev key kept in ``workdir``, or None when there is none (or it is malformed)."""
    try:
        key = (workdir / DEV_KEY_FILE).read_text().strip()
    except OSError:
        return None
    return key if _DEV_KEY_RE.match(key) else None


# ---- the keys document -------------------------------------------------------------------------------------------

def key_digest(entry: dict[str, Any]) -> str:
    """The hex digest of a key entry: its ``key_sha256``, else that of its plain ``key`` (test files), else ""."""
    digest = entry.get("key_sha256")
    if isinstance(digest, str) and digest:
        return digest.lower()
    plain = entry.get("key")
    return hash_key(plain) if isinstance(plain, str) and plain else ""


def key_id(entry: dict[str, Any]) -> str:
    """A key entry's id as the gateway names it: its ``id``, else the first 12 hex digits of its digest.

    >>> key_id({"key_sha256": "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08"})
    '9f86d081884c'
    """
    given = entry.get("id")
    return given if isinstance(given, str) and given else key_digest(entry)[:12]


def read_keys_document(path: Path) -> dict[str, Any]:
    """The keys document in ``path`` as plain JSON (``{}`` when the file does not exist); a bare list of keys (the
    first version's format) comes back as ``{"keys": [...]}``. KeysFileError when it is not a keys document."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise KeysFileError(f"{path}: not valid JSON: {err}") from None
    if isinstance(doc, list):
        doc = {"keys": doc}
    if not isinstance(doc, dict):
        raise KeysFileError(f"{path}: expected a JSON object with \"keys\", \"tenants\", \"defaults\"")
    for name, kind in (("keys", list), ("tenants", dict), ("defaults", dict)):
        if name in doc and not isinstance(doc[name], kind):
            raise KeysFileError(f"{path}: \"{name}\" must be a JSON {'list' if kind is list else 'object'}")
    if any(not isinstance(entry, dict) for entry in doc.get("keys", [])):
        raise KeysFileError(f"{path}: every entry of \"keys\" must be a JSON object")
    return doc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s edits (a ``.<name>.lock`` file beside it), so that two edits at once (two
    SREs, or ``goodput up`` and ``goodput keys``) do not lose one of them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def edit_keys_document(path: Path, *, move_invalid_aside: bool = False) -> Iterator[dict[str, Any]]:
    """Yields the keys document of ``path`` (see :func:`read_keys_document`) to change in place, then writes it
    back, atomically and mode 0600, under a lock; nothing is written when the block raises. What the block does
    not touch (entries and fields this code does not know) is written back as it was.

    ``move_invalid_aside``: a file that is not a keys document is renamed to ``<name>.invalid`` (not lost) and the
    block starts from an empty document, instead of KeysFileError.
    """
    path = Path(os.path.realpath(path))
    with _locked(path):
        try:
            doc = read_keys_document(path)
        except KeysFileError:
            if not move_invalid_aside:
                raise
            os.replace(path, path.with_name(path.name + ".invalid"))
            doc = {}
        yield doc
        write_private(path, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode())


def write_keys_file(workdir: Path, entries: list[dict[str, Any]] | dict[str, Any]) -> Path:
    """Replaces the keys file of ``workdir`` with exactly ``entries`` (tests that bring their own keys): a list of
    keys, or a whole document (``defaults``, ``tenants``, ``keys``)."""
    path = workdir / KEYS_FILE
    doc = entries if isinstance(entries, dict) else {"keys": entries}
    with _locked(path):
        write_private(path, (json.dumps(doc, indent=2) + "\n").encode())
    return path


def _is_dev_entry(entry: dict[str, Any]) -> bool:
    # An entry without an id for tenant "dev" is the one an earlier `goodput up` wrote (`goodput keys create` always
    # writes an id): replacing it means a new dev key really retires the old one.
    return entry.get("id") == DEV_KEY_ID or (not entry.get("id") and entry.get("tenant") == DEV_TENANT)


def write_dev_keys(workdir: Path) -> str:
    """Puts one P0 key of tenant ``dev`` (id ``dev``, hash only) into the keys file and returns the plain key.

    The file's other keys, tenants and defaults are kept. The key already in ``workdir/dev-key`` is reused, so
    examples copied from an earlier ``goodput up`` keep working. A keys file that cannot be read is moved aside to
    ``api-keys.json.invalid`` (not lost) and a new one started.
    """
    key = read_dev_key(workdir) or new_dev_key()
    digest = hash_key(key)
    entry = {"id": DEV_KEY_ID, "key_sha256": digest, "tenant": DEV_TENANT, "max_priority": "P0",
             "default_priority": "P0"}
    with edit_keys_document(workdir / KEYS_FILE, move_invalid_aside=True) as doc:
        keys: list[dict[str, Any]] = doc.setdefault("keys", [])
        replaced = [i for i, e in enumerate(keys) if _is_dev_entry(e) or key_digest(e) == digest]
        keys[:] = [e for i, e in enumerate(keys) if i not in replaced]
        keys.insert(replaced[0] if replaced else len(keys), entry)  # where it was: a diff shows only the change
    write_private(workdir / DEV_KEY_FILE, (key + "\n").encode())
    return key


STATE_DIR_NAME = ".goodput"


def default_state_dir() -> Path:
    """The state folder of `goodput up` and of the commands that talk to it: ``$GOODPUT_STATE_DIR``, else
    ``.goodput`` in the current folder."""
    return Path(os.environ.get("GOODPUT_STATE_DIR") or Path.cwd() / STATE_DIR_NAME)
