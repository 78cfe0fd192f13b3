"""Lexical leg on an Elasticsearch cluster (the ``elasticsearch`` client): an index template gives every
knowledge-base index its mapping (BM25 on ``text`` with the English analyzer, keyword ``tenant``/``kb``/ids), each
knowledge base is an alias over one index generation, and a full rebuild switches the alias with one ``_aliases``
call (remove + add in the same request is atomic).

Not exercised on a machine without a cluster: its tests run when GOODPUT_TEST_ELASTICSEARCH_URL is set.

Example::

    idx = ElasticsearchIndex(url="https://es:9200", api_key="...")
    idx.ensure("acme", "handbook")
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from goodput_retriever.fusion import Hit
from goodput_retriever.stores import StoredChunk, base_name

__all__ = ["ElasticsearchIndex", "TEMPLATE_NAME"]

TEMPLATE_NAME = "goodput-chunks"
_MAPPINGS: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {
        "tenant": {"type": "keyword"},
        "kb": {"type": "keyword"},
        "chunk_id": {"type": "keyword"},
        "document_id": {"type": "keyword"},
        "text": {"type": "text", "analyzer": "english"},
        "metadata": {"type": "object", "enabled": False},
    },
}


class ElasticsearchIndex:
    def __init__(self, *, url: str, api_key: str = "", client: Any = None, shards: int = 1,
                 replicas: int = 1) -> None:
        if client is None:
            from elasticsearch import Elasticsearch

            client = Elasticsearch(url, api_key=api_key or None, request_timeout=30)
        self.es = client
        self.es.indices.put_index_template(name=TEMPLATE_NAME, index_patterns=["gp_*"], template={
            "settings": {"number_of_shards": shards, "number_of_replicas": replicas},
            "mappings": _MAPPINGS})

    def _alias_target(self, alias: str) -> str | None:
        if not self.es.indices.exists_alias(name=alias):
            return None
        return next(iter(self.es.indices.get_alias(name=alias).keys()), None)

    def _target(self, tenant: str, kb: str, generation: str) -> str:
        return f"{base_name(tenant, kb)}_{generation}" if generation else base_name(tenant, kb)

    def exists(self, tenant: str, kb: str) -> bool:
        return self._alias_target(base_name(tenant, kb)) is not None

    def ensure(self, tenant: str, kb: str) -> bool:
        alias = base_name(tenant, kb)
        if self._alias_target(alias) is not None:
            return False
        self.es.indices.create(index=f"{alias}_{uuid.uuid4().hex[:12]}", aliases={alias: {"is_write_index": True}})
        return True

    def upsert(self, tenant: str, kb: str, chunks: Sequence[StoredChunk], *, generation: str = "") -> None:
        if not chunks:
            return
        from elasticsearch import helpers

        index = self._target(tenant, kb, generation)
        actions = [{"_op_type": "index", "_index": index, "_id": c.chunk_id, "_source": {
            "tenant": tenant, "kb": kb, "chunk_id": c.chunk_id, "document_id": c.document_id, "text": c.text,
            "metadata": dict(c.metadata)}} for c in chunks]
        helpers.bulk(self.es, actions, refresh="wait_for")

    def delete(self, tenant: str, kb: str, *, chunk_ids: Sequence[str] = (), document_ids: Sequence[str] = (),
               generation: str = "") -> None:
        index = self._target(tenant, kb, generation)
        if chunk_ids:
            from elasticsearch import helpers

            helpers.bulk(self.es, [{"_op_type": "delete", "_index": index, "_id": c} for c in chunk_ids],
                         refresh="wait_for", raise_on_error=False)
        if document_ids:
            self.es.delete_by_query(index=index, refresh=True, query={"bool": {"filter": [
                {"term": {"tenant": tenant}}, {"term": {"kb": kb}},
                {"terms": {"document_id": list(document_ids)}}]}})

    def begin_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        live = self._alias_target(alias)
        for name in self.es.indices.get(index=f"{alias}_*").keys():
            if name != live:
                self.es.indices.delete(index=name)  # an earlier rebuild that never finished
        self.es.indices.create(index=f"{alias}_{generation}")

    def commit_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        old = self._alias_target(alias)
        new = f"{alias}_{generation}"
        actions: list[dict[str, Any]] = []
        if old is not None:
            actions.append({"remove": {"index": old, "alias": alias}})
        actions.append({"add": {"index": new, "alias": alias, "is_write_index": True}})
        self.es.indices.update_aliases(actions=actions)
        if old is not None and old != new:
            self.es.indices.delete(index=old)

    def search(self, tenant: str, kb: str, query: str, limit: int) -> list[Hit]:
        res = self.es.search(index=base_name(tenant, kb), size=limit, query={"bool": {
            "must": [{"match": {"text": {"query": query}}}],
            "filter": [{"term": {"tenant": tenant}}, {"term": {"kb": kb}}]}})
        return [Hit(chunk_id=h["_source"]["chunk_id"], document_id=h["_source"]["document_id"],
                    score=float(h["_score"]), text=h["_source"]["text"],
                    metadata={str(k): str(v) for k, v in (h["_source"].get("metadata") or {}).items()})
                for h in res["hits"]["hits"]]

    def close(self) -> None:
        self.es.close()
