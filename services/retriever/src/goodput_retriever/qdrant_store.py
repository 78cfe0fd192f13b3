"""Dense leg: Qdrant, as a server (``QdrantClient(url=...)``) or in-process local mode (``path=`` or
``:memory:``) — the same client API either way.

Example (3-dimensional vectors here; the embedder's are 384):
    >>> store = QdrantStore(location=":memory:", dim=3)
    >>> store.ensure("acme", "handbook")     # True: created
    True
    >>> store.upsert("acme", "handbook", [StoredChunk("refunds-0", "refunds", "Refunds...", vector=[1, 0, 0]),
    ...                                   StoredChunk("shipping-0", "shipping", "We ship...", vector=[0, 1, 0])])
    >>> [h.chunk_id for h in store.search("acme", "handbook", [0.9, 0.1, 0.0], limit=1)]
    ['refunds-0']
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

from qdrant_client import QdrantClient, models

from goodput_retriever.fusion import Hit
from goodput_retriever.stores import StoredChunk, base_name

__all__ = ["QdrantStore"]


def point_id(tenant: str, kb: str, chunk_id: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"goodput:{tenant}:{kb}:{chunk_id}"))


class QdrantStore:
    def __init__(self, *, url: str = "", api_key: str = "", location: str = ":memory:", dim: int = 384) -> None:
        self.local = not url
        if url:
            self.client = QdrantClient(url=url, api_key=api_key or None, timeout=30)
        elif location == ":memory:":
            self.client = QdrantClient(location=":memory:")
        else:
            self.client = QdrantClient(path=location)
        self.dim = dim
        # Local mode is not safe for concurrent writers in one process; a server serialises on its side.
        self._lock = threading.RLock()

    def _filter(self, tenant: str, kb: str, *extra: models.Condition) -> models.Filter:
        return models.Filter(must=[
            models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant)),
            models.FieldCondition(key="kb", match=models.MatchValue(value=kb)), *extra])

    def _target(self, tenant: str, kb: str, generation: str) -> str:
        return f"{base_name(tenant, kb)}_{generation}" if generation else base_name(tenant, kb)

    def _create(self, name: str) -> None:
        self.client.create_collection(name, vectors_config=models.VectorParams(size=self.dim,
                                                                               distance=models.Distance.COSINE))
        if not self.local:  # payload indexes have no effect in local mode
            self.client.create_payload_index(name, "tenant", models.KeywordIndexParams(
                type=models.KeywordIndexType.KEYWORD, is_tenant=True))
            for key in ("kb", "document_id", "chunk_id"):
                self.client.create_payload_index(name, key, models.PayloadSchemaType.KEYWORD)

    def _alias_target(self, alias: str) -> str | None:
        return next((str(a.collection_name) for a in self.client.get_aliases().aliases if a.alias_name == alias), None)

    def exists(self, tenant: str, kb: str) -> bool:
        with self._lock:
            return self._alias_target(base_name(tenant, kb)) is not None

    def ensure(self, tenant: str, kb: str) -> bool:
        alias = base_name(tenant, kb)
        with self._lock:
            if self._alias_target(alias) is not None:
                return False
            name = f"{alias}_{uuid.uuid4().hex[:12]}"
            self._create(name)
            self.client.update_collection_aliases(change_aliases_operations=[
                models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name=name, alias_name=alias))])
            return True

    def upsert(self, tenant: str, kb: str, chunks: Sequence[StoredChunk], *, generation: str = "") -> None:
        if not chunks:
            return
        points = [models.PointStruct(id=point_id(tenant, kb, c.chunk_id), vector=list(c.vector), payload={
            "tenant": tenant, "kb": kb, "chunk_id": c.chunk_id, "document_id": c.document_id, "text": c.text,
            "metadata": dict(c.metadata)}) for c in chunks]
        with self._lock:
            self.client.upsert(self._target(tenant, kb, generation), points=points, wait=True)

    def delete(self, tenant: str, kb: str, *, chunk_ids: Sequence[str] = (), document_ids: Sequence[str] = (),
               generation: str = "") -> None:
        target = self._target(tenant, kb, generation)
        with self._lock:
            if chunk_ids:
                self.client.delete(target, points_selector=models.PointIdsList(
                    points=[point_id(tenant, kb, c) for c in chunk_ids]), wait=True)
            if document_ids:
                self.client.delete(target, points_selector=models.FilterSelector(filter=self._filter(
                    tenant, kb, models.FieldCondition(key="document_id",
                                                      match=models.MatchAny(any=list(document_ids))))), wait=True)

    def begin_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        with self._lock:
            live = self._alias_target(alias)
            for c in self.client.get_collections().collections:
                if c.name.startswith(alias + "_") and c.name != live:
                    self.client.delete_collection(c.name)  # an earlier rebuild that never finished
            self._create(f"{alias}_{generation}")

    def commit_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        with self._lock:
            old = self._alias_target(alias)
            ops: list[Any] = []
            if old is not None:
                ops.append(models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=alias)))
            ops.append(models.CreateAliasOperation(create_alias=models.CreateAlias(
                collection_name=f"{alias}_{generation}", alias_name=alias)))
            self.client.update_collection_aliases(change_aliases_operations=ops)  # one atomic request
            if old is not None and old != f"{alias}_{generation}":
                self.client.delete_collection(old)

    def search(self, tenant: str, kb: str, vector: Sequence[float], limit: int) -> list[Hit]:
        # A server filters on its (tenant-aware) payload index. Local mode evaluates a filter in Python point by
        # point (6x slower measured); its collection already holds one knowledge base only, so the same tenant/kb
        # check is applied to the hits instead: either way no other tenant's chunk is ever returned.
        with self._lock:
            res = self.client.query_points(base_name(tenant, kb), query=list(vector), limit=limit,
                                           query_filter=None if self.local else self._filter(tenant, kb),
                                           with_payload=True)
        return [Hit(chunk_id=str(p.payload["chunk_id"]), document_id=str(p.payload["document_id"]),
                    score=float(p.score), text=str(p.payload.get("text", "")),
                    metadata=dict(p.payload.get("metadata") or {}))
                for p in res.points
                if p.payload is not None and p.payload.get("tenant") == tenant and p.payload.get("kb") == kb]

    def close(self) -> None:
        self.client.close()
