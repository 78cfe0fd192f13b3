"""Incremental indexing: validation, chunking, content-hash change detection, writes through the retriever's
IndexStore, knowledge-base versions. Plain synchronous code (no gRPC server imports): the embedder's gRPC
``IndexDocuments`` runs it in a thread, the Celery ``reindex`` task runs it directly.

Change detection. Redis keeps, per knowledge base, one record per document: the hash of its content and the ids
of its chunks. A document whose hash is unchanged is skipped (0 embeddings). A changed one is re-chunked; chunk ids
are derived from the chunk's content, so only chunks that are new are embedded and upserted, and chunk ids no
longer produced are deleted. A deleted document has all its chunks removed.

Crash safety. Stores are written first, the Redis record last, and every write is an idempotent upsert or delete
by content-derived id. A job killed at any point and re-run therefore redoes at most the documents whose records
were not yet written: no duplicates, nothing missing.

Full rebuild. ``BeginRebuild`` makes staging indexes beside the live ones, every document is written there, and
``CommitRebuild`` switches the alias in one step; queries see the old index until then, never a half-built one.
The records are staged under their own key and renamed over the live key after the commit.

Every finished write bumps the knowledge base's version (a Redis counter) and publishes
``{"tenant", "knowledge_base", "version"}`` on the version channel (the cache invalidates on it).

Example::

    indexer = Indexer(settings, embed=model.embed, store=GrpcStoreWriter(addr), redis=Redis.from_url(url))
    result = indexer.index_documents("acme", "handbook", [Doc(id="a", text="...")], delete_ids=[])
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import redis

from goodput_contracts import VersionChange, kb_key
from goodput_core.errors import InvalidArgument

from goodput_embedder.chunking import DOC_TYPES, ChunkSizes, chunk_document, guess_type
from goodput_embedder.config import EmbedderSettings

__all__ = ["ChunkRecord", "Doc", "IndexResult", "Indexer", "StoreWriter", "validate_name", "NAME_RE"]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_ID_CHARS = 256
MAX_METADATA_ENTRIES = 32


def validate_name(value: str, param: str) -> str:
    if not value:
        raise InvalidArgument(f"'{param}' must not be empty", param=param, code="invalid_value")
    if not NAME_RE.match(value):
        raise InvalidArgument(f"'{param}' must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                              f"digit (got {value[:80]!r})", param=param, code="invalid_value")
    return value


@dataclass(frozen=True)
class Doc:
    id: str
    text: str
    type: str = ""
    title: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkRecord:
    chunk_id: str
    document_id: str
    text: str
    metadata: dict[str, str]


@dataclass
class IndexResult:
    chunks_embedded: int = 0
    chunks_deleted: int = 0
    documents_unchanged: int = 0
    documents_deleted: int = 0
    documents_indexed: int = 0
    kb_version: int = 0


class StoreWriter(Protocol):
    """The write side of the stores (the retriever's IndexStore API)."""

    def open(self, tenant: str, kb: str) -> tuple[bool, int]: ...

    def write(self, tenant: str, kb: str, *, upserts: Sequence[tuple[ChunkRecord, np.ndarray]],
              delete_chunk_ids: Sequence[str] = (), delete_document_ids: Sequence[str] = (),
              rebuild_id: str = "", kb_version: int = 0) -> None: ...

    def begin_rebuild(self, tenant: str, kb: str) -> str: ...

    def commit_rebuild(self, tenant: str, kb: str, rebuild_id: str, kb_version: int) -> None: ...


def _looks_binary(text: str) -> bool:
    if "\x00" in text:
        return True
    sample = text[:65536]
    bad = sum(1 for c in sample if (ord(c) < 32 and c not in "\n\r\t\f") or c == "\ufffd")
    return bad > max(8, len(sample) // 100)


class Indexer:
    def __init__(self, settings: EmbedderSettings, *, embed: Callable[[list[str]], np.ndarray], store: StoreWriter,
                 redis_client: redis.Redis) -> None:
        self.settings = settings
        self.embed = embed
        self.store = store
        self.redis = redis_client
        self.sizes = ChunkSizes(prose_tokens=settings.prose_chunk_tokens, prose_overlap=settings.prose_overlap,
                                markdown_max_tokens=settings.markdown_max_tokens,
                                code_max_tokens=settings.code_max_tokens, faq_max_tokens=settings.faq_max_tokens)

    # ---- keys ----------------------------------------------------------------------------------------------
    def _key(self, tenant: str, kb: str, what: str) -> str:
        return kb_key(tenant, kb, what, prefix=self.settings.key_prefix)

    def lock(self, tenant: str, kb: str) -> Any:
        """One writer per knowledge base at a time (a Redis lock, so it also holds across Celery workers)."""
        return self.redis.lock(self._key(tenant, kb, "lock"), timeout=600, blocking_timeout=600)

    def version(self, tenant: str, kb: str) -> int:
        return int(self.redis.get(self._key(tenant, kb, "version")) or 0)

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self, docs: Sequence[Doc], delete_ids: Sequence[str], *, max_documents: int | None) -> list[Doc]:
        """Checks every document before anything is written; returns them with their type resolved."""
        s = self.settings
        if max_documents is not None and len(docs) > max_documents:
            raise InvalidArgument(f"{len(docs)} documents in one request; the limit is {max_documents} (use a "
                                  "Reindex job for more)", param="documents", code="invalid_value")
        if not docs and not delete_ids:
            raise InvalidArgument("nothing to do: no documents and no delete_ids", param="documents",
                                  code="invalid_value")
        seen: set[str] = set()
        total = 0
        out = []
        for i, d in enumerate(docs):
            p = f"documents[{i}]"
            if not d.id or len(d.id) > MAX_ID_CHARS or any(ord(c) < 32 for c in d.id):
                raise InvalidArgument(f"{p}.id must be 1-{MAX_ID_CHARS} printable characters", param=f"{p}.id",
                                      code="invalid_value")
            if d.id in seen:
                raise InvalidArgument(f"{p}.id {d.id!r} appears twice", param=f"{p}.id", code="invalid_value")
            seen.add(d.id)
            size = len(d.text.encode("utf-8", errors="surrogatepass"))
            total += size
            if size > s.max_document_bytes:
                raise InvalidArgument(f"{p} is {size} bytes; the limit is {s.max_document_bytes}",
                                      param=f"{p}.text", code="document_too_large")
            if not d.text.strip():
                raise InvalidArgument(f"{p} ({d.id!r}) is empty", param=f"{p}.text", code="empty_document")
            if _looks_binary(d.text):
                raise InvalidArgument(f"{p} ({d.id!r}) looks like binary data, not text", param=f"{p}.text",
                                      code="binary_document")
            doc_type = d.type or guess_type(d.text)
            if doc_type not in DOC_TYPES:
                raise InvalidArgument(f"{p}.type {d.type!r} is not one of {', '.join(DOC_TYPES)}",
                                      param=f"{p}.type", code="invalid_value")
            if len(d.metadata) > MAX_METADATA_ENTRIES:
                raise InvalidArgument(f"{p}.metadata has more than {MAX_METADATA_ENTRIES} entries",
                                      param=f"{p}.metadata", code="invalid_value")
            out.append(Doc(id=d.id, text=d.text, type=doc_type, title=d.title, metadata=dict(d.metadata)))
        if total > s.max_request_bytes:
            raise InvalidArgument(f"the documents total {total} bytes; the limit is {s.max_request_bytes}",
                                  param="documents", code="request_too_large")
        for j, did in enumerate(delete_ids):
            if not did or len(did) > MAX_ID_CHARS:
                raise InvalidArgument(f"delete_ids[{j}] must be 1-{MAX_ID_CHARS} characters",
                                      param=f"delete_ids[{j}]", code="invalid_value")
            if did in seen:
                raise InvalidArgument(f"document {did!r} is both indexed and deleted", param=f"delete_ids[{j}]",
                                      code="invalid_value")
        return out

    # ---- chunking ------------------------------------------------------------------------------------------
    @staticmethod
    def doc_hash(d: Doc) -> str:
        payload = json.dumps([d.type, d.title, d.text, sorted(d.metadata.items())], ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8", errors="surrogatepass")).hexdigest()

    def chunks(self, d: Doc) -> list[ChunkRecord]:
        texts = chunk_document(d.text, doc_type=d.type, title=d.title, sizes=self.sizes)
        meta = {**d.metadata, "type": d.type}
        if d.title:
            meta["title"] = d.title
        meta_key = json.dumps(sorted(meta.items()), ensure_ascii=False)
        out: list[ChunkRecord] = []
        seen: dict[str, int] = {}
        for t in texts:
            h = hashlib.sha256(f"{d.id}\x00{meta_key}\x00{t}".encode("utf-8", errors="surrogatepass")).hexdigest()
            n = seen.get(h, 0)
            seen[h] = n + 1
            cid = f"{h[:24]}" + (f"-{n}" if n else "")
            out.append(ChunkRecord(chunk_id=cid, document_id=d.id, text=t, metadata=meta))
        return out

    # ---- writing -------------------------------------------------------------------------------------------
    def _records(self, key: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        values = self.redis.hmget(key, list(ids))
        return {i: json.loads(v) for i, v in zip(ids, values, strict=True) if v}

    def _write_docs(self, tenant: str, kb: str, docs: Sequence[Doc], *, records_key: str, rebuild_id: str,
                    result: IndexResult, force: bool = False) -> None:
        old = {} if force else self._records(records_key, [d.id for d in docs])
        to_embed: list[ChunkRecord] = []
        delete_chunks: list[str] = []
        new_records: dict[str, str] = {}
        for d in docs:
            h = self.doc_hash(d)
            prev = old.get(d.id)
            if prev is not None and prev.get("hash") == h:
                result.documents_unchanged += 1
                continue
            chunks = self.chunks(d)
            prev_ids = set(prev.get("chunks", [])) if prev else set()
            ids = [c.chunk_id for c in chunks]
            to_embed.extend(c for c in chunks if c.chunk_id not in prev_ids)
            delete_chunks.extend(sorted(prev_ids - set(ids)))
            new_records[d.id] = json.dumps({"hash": h, "chunks": ids})
            result.documents_indexed += 1
        batch = self.settings.write_batch
        for i in range(0, len(to_embed), batch):
            part = to_embed[i:i + batch]
            vectors = self.embed([c.text for c in part])
            self.store.write(tenant, kb, upserts=list(zip(part, vectors, strict=True)), rebuild_id=rebuild_id)
            result.chunks_embedded += len(part)
        if delete_chunks:
            self.store.write(tenant, kb, upserts=[], delete_chunk_ids=delete_chunks, rebuild_id=rebuild_id)
            result.chunks_deleted += len(delete_chunks)
        if new_records:
            self.redis.hset(records_key, mapping=new_records)  # type: ignore[arg-type]

    def _delete_docs(self, tenant: str, kb: str, ids: Sequence[str], *, records_key: str,
                     result: IndexResult) -> None:
        if not ids:
            return
        old = self._records(records_key, ids)
        self.store.write(tenant, kb, upserts=[], delete_document_ids=list(ids))
        result.chunks_deleted += sum(len(rec.get("chunks", [])) for rec in old.values())
        result.documents_deleted += len(old)
        self.redis.hdel(records_key, *ids)

    def _open(self, tenant: str, kb: str) -> None:
        created, _ = self.store.open(tenant, kb)
        if created:
            # The stores have no such index (new, or lost): every record of it is stale.
            self.redis.delete(self._key(tenant, kb, "docs"))

    def publish_version(self, tenant: str, kb: str) -> int:
        return int(self.redis.incr(self._key(tenant, kb, "version")))

    def _announce(self, tenant: str, kb: str, version: int) -> None:
        self.redis.publish(self.settings.version_channel, VersionChange(tenant, kb, version).encode())

    def index_documents(self, tenant: str, kb: str, docs: Sequence[Doc], delete_ids: Sequence[str], *,
                        max_documents: int | None = None) -> IndexResult:
        """Synchronous indexing of a small batch (validated as a whole first: nothing is written on bad input)."""
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        docs = self.validate(docs, delete_ids, max_documents=max_documents)
        result = IndexResult()
        key = self._key(tenant, kb, "docs")
        with self.lock(tenant, kb):
            self._open(tenant, kb)
            self._write_docs(tenant, kb, docs, records_key=key, rebuild_id="", result=result)
            self._delete_docs(tenant, kb, list(delete_ids), records_key=key, result=result)
            result.kb_version = self._finish(tenant, kb)
        return result

    def _finish(self, tenant: str, kb: str) -> int:
        version = self.publish_version(tenant, kb)
        self.store.write(tenant, kb, upserts=[], kb_version=version)
        self._announce(tenant, kb, version)
        return version

    def run_job(self, tenant: str, kb: str, docs: Iterable[Doc], *, full_rebuild: bool,
                progress: Callable[[int, IndexResult], None] | None = None, batch_docs: int = 64) -> IndexResult:
        """A whole source: incremental (unchanged skipped, missing documents deleted) or a full rebuild behind an
        atomic alias switch. ``progress(documents_done, result)`` is called after every batch."""
        validate_name(tenant, "tenant")
        validate_name(kb, "knowledge_base")
        result = IndexResult()
        live_key = self._key(tenant, kb, "docs")
        seen: set[str] = set()
        done = 0
        with self.lock(tenant, kb) as held:
            self._open(tenant, kb)
            rebuild_id = self.store.begin_rebuild(tenant, kb) if full_rebuild else ""
            key = self._key(tenant, kb, f"docs:rebuild:{rebuild_id}") if full_rebuild else live_key
            if full_rebuild:
                self.redis.delete(key)
            buf: list[Doc] = []

            def flush() -> None:
                nonlocal done
                valid = self.validate(buf, [], max_documents=None)
                self._write_docs(tenant, kb, valid, records_key=key, rebuild_id=rebuild_id, result=result,
                                 force=full_rebuild)
                done += len(buf)
                buf.clear()
                held.reacquire()  # a long job keeps its lock: the TTL restarts after every batch
                if progress is not None:
                    progress(done, result)

            for d in docs:
                if d.id in seen:
                    raise InvalidArgument(f"document id {d.id!r} appears twice in the source", param="source_uri")
                seen.add(d.id)
                buf.append(d)
                if len(buf) >= batch_docs:
                    flush()
            if buf:
                flush()
            if full_rebuild:
                version = self.publish_version(tenant, kb)
                self.store.commit_rebuild(tenant, kb, rebuild_id, version)
                self.redis.rename(key, live_key) if self.redis.exists(key) else self.redis.delete(live_key)
                self._announce(tenant, kb, version)
                result.kb_version = version
            else:
                stale = [i for i in (k.decode() if isinstance(k, bytes) else k
                                     for k in self.redis.hkeys(live_key)) if i not in seen]
                self._delete_docs(tenant, kb, stale, records_key=live_key, result=result)
                result.kb_version = self._finish(tenant, kb)
        return result

