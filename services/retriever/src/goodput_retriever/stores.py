"""The two store interfaces of the retriever and what they share. Both are synchronous (the service calls them
from worker threads) and address a knowledge base by ``(tenant, kb)``.

Physical layout: every knowledge base has an alias (``base_name``) that points at one generation (a Qdrant
collection, a tantivy index directory, an Elasticsearch index). A full rebuild creates a new generation, fills
it, and switches the alias in one atomic step (Qdrant ``update_collection_aliases``, an Elasticsearch
``_aliases`` call, a tantivy ``CURRENT`` file replaced with ``os.replace``). Each stored chunk also carries its
tenant and knowledge base, and every query filters on both: the alias keeps tenants apart, and the filter does too
if an alias were ever wrong.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from goodput_retriever.fusion import Hit

__all__ = ["LexicalIndex", "StoredChunk", "VectorStore", "base_name", "new_generation"]


@dataclass(frozen=True)
class StoredChunk:
    chunk_id: str
    document_id: str
    text: str
    vector: Sequence[float] = ()
    metadata: dict[str, str] = field(default_factory=dict)


def base_name(tenant: str, kb: str) -> str:
    """Alias of a knowledge base: lowercase and fixed-length (Elasticsearch wants lowercase names)."""
    return "gp_" + hashlib.sha256(f"{tenant}\x00{kb}".encode()).hexdigest()[:24]


def new_generation() -> str:
    return uuid.uuid4().hex[:12]


class _Store(Protocol):
    def exists(self, tenant: str, kb: str) -> bool: ...

    def ensure(self, tenant: str, kb: str) -> bool:
        """Creates the knowledge base's first generation and alias when missing; True when it did."""
        ...

    def upsert(self, tenant: str, kb: str, chunks: Sequence[StoredChunk], *, generation: str = "") -> None: ...

    def delete(self, tenant: str, kb: str, *, chunk_ids: Sequence[str] = (), document_ids: Sequence[str] = (),
               generation: str = "") -> None: ...

    def begin_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        """Creates an empty generation beside the live one (dropping any earlier unfinished one)."""
        ...

    def commit_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        """Points the alias at ``generation`` atomically, then drops the old generation."""
        ...

    def close(self) -> None: ...


class VectorStore(_Store, Protocol):
    def search(self, tenant: str, kb: str, vector: Sequence[float], limit: int) -> list[Hit]: ...


class LexicalIndex(_Store, Protocol):
    def search(self, tenant: str, kb: str, query: str, limit: int) -> list[Hit]: ...
