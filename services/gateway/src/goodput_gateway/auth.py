"""API keys: each maps to a tenant, the most urgent priority it may use and its default priority.

Keys are held only as SHA-256 digests (a file may store the digest, so the plain key never sits on disk) and an
incoming key is compared against every digest in constant time.

Example file (`GOODPUT_GATEWAY_API_KEYS_FILE`, usually a mounted Secret):
    {"keys": [{"key_sha256": "9f86...", "tenant": "acme", "max_priority": "P0", "default_priority": "P1"}]}
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.common.v1 import types_pb2

from goodput_core.errors import PermissionDenied, Unauthenticated
from goodput_core.priority import check_priority, more_urgent, parse_priority, priority_name


@dataclass(frozen=True)
class Principal:
    tenant: str
    max_priority: int
    default_priority: int

    def resolve_priority(self, requested: int) -> int:
        """The request's priority: the key's default when unset; InvalidArgument when it is not a defined class
        (``priority=4`` is not "less urgent than P2"); PermissionDenied above the allowance."""
        if check_priority(requested) == types_pb2.PRIORITY_UNSPECIFIED:
            return self.default_priority
        if more_urgent(requested, self.max_priority):
            raise PermissionDenied(
                f"priority {priority_name(requested)} is above this API key's allowance "
                f"({priority_name(self.max_priority)})", param="priority")
        return requested


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeyStore:
    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = entries

    @classmethod
    def from_sources(cls, *, file: str = "", inline: str = "") -> ApiKeyStore:
        entries: list[tuple[bytes, Principal]] = []
        docs: list[tuple[str, Any]] = []
        if file:
            docs.append((file, json.loads(Path(file).read_text(encoding="utf-8"))))
        if inline.strip():
            docs.append(("GOODPUT_GATEWAY_API_KEYS", json.loads(inline)))
        for source, doc in docs:
            keys = doc.get("keys") if isinstance(doc, dict) else doc
            if not isinstance(keys, list):
                raise ValueError(f"{source}: expected {{'keys': [...]}}")
            for i, item in enumerate(keys):
                entries.append(cls._entry(source, i, item))
        return cls(entries)

    @staticmethod
    def _entry(source: str, i: int, item: Any) -> tuple[bytes, Principal]:
        if not isinstance(item, dict) or not item.get("tenant"):
            raise ValueError(f"{source}: key #{i} needs a tenant")
        digest = item.get("key_sha256") or (sha256_hex(item["key"]) if item.get("key") else "")
        if len(digest) != 64:
            raise ValueError(f"{source}: key #{i} needs key_sha256 (64 hex chars) or key")
        max_p = parse_priority(item.get("max_priority", "P1"))
        default_p = parse_priority(item.get("default_priority", priority_name(max_p)))
        if more_urgent(default_p, max_p):
            raise ValueError(f"{source}: key #{i} default_priority is above max_priority")
        return bytes.fromhex(digest), Principal(tenant=str(item["tenant"]), max_priority=max_p,
                                                default_priority=default_p)

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """From an `Authorization: Bearer <key>` value to the key's principal, or Unauthenticated."""
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed Authorization header: expected `Bearer <key>`",
                                  code="invalid_api_key")
        digest = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).digest()
        found: Principal | None = None
        for stored, principal in self._entries:
            if hmac.compare_digest(stored, digest):  # every entry is compared: no early exit on a match
                found = principal
        if found is None:
            raise Unauthenticated("invalid API key", code="invalid_api_key")
        return found
