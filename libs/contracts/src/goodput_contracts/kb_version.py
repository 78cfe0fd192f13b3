"""The knowledge-base version contract: where a knowledge base's version lives in Redis and how a change is
announced. The indexer (embedder) writes both; the cache reads the version and follows the announcements.

- ``<prefix>:kb:<tenant>:<kb>:version``: a Redis counter, bumped by every finished indexing write. The indexer's
  other per-knowledge-base keys (its lock, its content hashes) live under the same ``<prefix>:kb:<tenant>:<kb>:``.
- The channel (``goodput:kb-version`` by default) carries ``{"tenant", "knowledge_base", "version"}`` as JSON after
  each bump.

Example:
    >>> version_key("acme", "handbook")
    'goodput:kb:acme:handbook:version'
    >>> change = VersionChange("acme", "handbook", 3)
    >>> VersionChange.decode(change.encode()) == change
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["DEFAULT_CHANNEL", "DEFAULT_KEY_PREFIX", "VersionChange", "kb_key", "version_key"]

DEFAULT_KEY_PREFIX = "goodput"
DEFAULT_CHANNEL = "goodput:kb-version"


def kb_key(tenant: str, kb: str, what: str, *, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """A per-knowledge-base key of the indexer (``what``: ``version``, ``lock``, ``docs``, ...)."""
    return f"{prefix}:kb:{tenant}:{kb}:{what}"


def version_key(tenant: str, kb: str, *, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The Redis counter holding the knowledge base's current version (absent = 0)."""
    return kb_key(tenant, kb, "version", prefix=prefix)


@dataclass(frozen=True)
class VersionChange:
    """One announcement on the version channel."""

    tenant: str
    knowledge_base: str
    version: int

    def encode(self) -> str:
        return json.dumps({"tenant": self.tenant, "knowledge_base": self.knowledge_base, "version": self.version})

    @classmethod
    def decode(cls, raw: str | bytes) -> VersionChange:
        """Raises ValueError on anything but the contract's shape."""
        try:
            data = json.loads(raw)
            return cls(str(data["tenant"]), str(data["knowledge_base"]), int(data["version"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a knowledge-base version change: {raw!r:.200}") from err
