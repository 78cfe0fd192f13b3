"""Lexical leg, embedded: tantivy (BM25, English stemming), one index directory per knowledge-base generation.

Layout under ``root``: ``<alias>/<generation>/`` index directories and ``<alias>/CURRENT``, a one-line file naming
the live generation. A full rebuild fills a new directory and replaces ``CURRENT`` with ``os.replace`` (atomic
on POSIX), then the old directory is removed; a reader opens whatever ``CURRENT`` names, so it sees the old
index or the new one, never a half-built one. With ``root=":memory:"`` the indexes live in RAM and the pointer is
a dict entry.

Example:
    >>> idx = TantivyIndex(":memory:")
    >>> idx.ensure("acme", "handbook"), idx.ensure("acme", "handbook")   # created, then already there
    (True, False)
    >>> idx.upsert("acme", "handbook", [StoredChunk("refunds-0", "refunds", "Refunds are paid within 30 days."),
    ...                                 StoredChunk("shipping-0", "shipping", "We ship worldwide.")])
    >>> [h.chunk_id for h in idx.search("acme", "handbook", "refund policy", limit=5)]   # English stemming
    ['refunds-0']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tantivy

from goodput_retriever.fusion import Hit
from goodput_retriever.stores import StoredChunk, base_name

__all__ = ["TantivyIndex"]

_TERM = re.compile(r"\w+", re.UNICODE)


def _schema() -> tantivy.Schema:
    sb = tantivy.SchemaBuilder()
    for name in ("chunk_id", "document_id", "tenant", "kb"):
        sb.add_text_field(name, stored=True, tokenizer_name="raw")
    sb.add_text_field("text", stored=True, tokenizer_name="en_stem")
    sb.add_text_field("metadata", stored=True, index_option="basic", tokenizer_name="raw")
    return sb.build()


class _Live:
    def __init__(self, index: tantivy.Index) -> None:
        self.index = index
        self.writer: Any = None

    def writer_(self) -> Any:
        if self.writer is None:
            self.writer = self.index.writer(heap_size=15_000_000, num_threads=1)
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.wait_merging_threads()
            self.writer = None


class TantivyIndex:
    def __init__(self, root: str) -> None:
        self.memory = root == ":memory:"
        self.root = Path(root) if not self.memory else None
        self.schema = _schema()
        self._open: dict[str, _Live] = {}  # "<alias>/<generation>" -> index
        self._current: dict[str, str] = {}  # alias -> generation (authoritative in memory mode)
        self._lock = threading.RLock()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    # ---- generations ---------------------------------------------------------------------------------------
    def _current_gen(self, alias: str) -> str | None:
        if self.memory:
            return self._current.get(alias)
        assert self.root is not None
        try:
            return (self.root / alias / "CURRENT").read_text().strip() or None
        except FileNotFoundError:
            return None

    def _set_current(self, alias: str, generation: str) -> None:
        if self.memory:
            self._current[alias] = generation
            return
        assert self.root is not None
        tmp = self.root / alias / f".CURRENT.{uuid.uuid4().hex}"
        tmp.write_text(generation + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.root / alias / "CURRENT")

    def _index(self, alias: str, generation: str, *, create: bool = False) -> _Live:
        key = f"{alias}/{generation}"
        live = self._open.get(key)
        if live is None:
            if self.memory:
                if not create:
                    raise KeyError(key)
                index = tantivy.Index(self.schema)
            else:
                assert self.root is not None
                path = self.root / alias / generation
                if not create and not path.exists():
                    raise KeyError(key)
                path.mkdir(parents=True, exist_ok=True)
                index = tantivy.Index(self.schema, path=str(path))
            live = self._open[key] = _Live(index)
        return live

    def _drop(self, alias: str, generation: str) -> None:
        live = self._open.pop(f"{alias}/{generation}", None)
        if live is not None:
            live.close()
        if self.root is not None:
            shutil.rmtree(self.root / alias / generation, ignore_errors=True)

    def _target(self, tenant: str, kb: str, generation: str) -> _Live:
        alias = base_name(tenant, kb)
        gen = generation or self._current_gen(alias)
        if gen is None:
            raise KeyError(f"no index for {tenant}/{kb}")
        return self._index(alias, gen)

    # ---- interface -----------------------------------------------------------------------------------------
    def exists(self, tenant: str, kb: str) -> bool:
        with self._lock:
            return self._current_gen(base_name(tenant, kb)) is not None

    def ensure(self, tenant: str, kb: str) -> bool:
        alias = base_name(tenant, kb)
        with self._lock:
            if self._current_gen(alias) is not None:
                return False
            gen = uuid.uuid4().hex[:12]
            self._index(alias, gen, create=True).writer_().commit()
            self._set_current(alias, gen)
            return True

    def upsert(self, tenant: str, kb: str, chunks: Sequence[StoredChunk], *, generation: str = "") -> None:
        if not chunks:
            return
        with self._lock:
            live = self._target(tenant, kb, generation)
            w = live.writer_()
            for c in chunks:
                w.delete_documents_by_term("chunk_id", c.chunk_id)
                w.add_document(tantivy.Document(chunk_id=c.chunk_id, document_id=c.document_id, tenant=tenant,
                                                kb=kb, text=c.text, metadata=json.dumps(c.metadata)))
            w.commit()
            live.index.reload()

    def delete(self, tenant: str, kb: str, *, chunk_ids: Sequence[str] = (), document_ids: Sequence[str] = (),
               generation: str = "") -> None:
        if not chunk_ids and not document_ids:
            return
        with self._lock:
            live = self._target(tenant, kb, generation)
            w = live.writer_()
            for cid in chunk_ids:
                w.delete_documents_by_term("chunk_id", cid)
            for did in document_ids:
                w.delete_documents_by_term("document_id", did)
            w.commit()
            live.index.reload()

    def begin_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        with self._lock:
            live = self._current_gen(alias)
            stale = [k.split("/", 1)[1] for k in self._open if k.startswith(alias + "/")]
            if self.root is not None and (self.root / alias).exists():
                stale += [p.name for p in (self.root / alias).iterdir() if p.is_dir()]
            for gen in set(stale) - {live}:
                self._drop(alias, gen)  # an earlier rebuild that never finished
            self._index(alias, generation, create=True).writer_().commit()

    def commit_rebuild(self, tenant: str, kb: str, generation: str) -> None:
        alias = base_name(tenant, kb)
        with self._lock:
            old = self._current_gen(alias)
            self._index(alias, generation).index.reload()
            self._set_current(alias, generation)
            if old is not None and old != generation:
                self._drop(alias, old)

    def search(self, tenant: str, kb: str, query: str, limit: int) -> list[Hit]:
        terms = _TERM.findall(query.lower())
        if not terms:
            return []
        with self._lock:
            live = self._target(tenant, kb, "")
            index = live.index
        text_q = index.parse_query(" ".join(terms), ["text"])  # terms only: no query syntax reaches the parser
        q = tantivy.Query.boolean_query([
            (tantivy.Occur.Must, text_q),
            (tantivy.Occur.Must, tantivy.Query.term_query(self.schema, "tenant", tenant)),
            (tantivy.Occur.Must, tantivy.Query.term_query(self.schema, "kb", kb)),
        ])
        searcher = index.searcher()
        found = [(score, searcher.doc(addr)) for score, addr in searcher.search(q, limit).hits]
        return [Hit(chunk_id=d["chunk_id"][0], document_id=d["document_id"][0], score=float(score), text=d["text"][0],
                    metadata=json.loads(d["metadata"][0]) if d["metadata"] else {}) for score, d in found]

    def close(self) -> None:
        with self._lock:
            for live in self._open.values():
                live.close()
            self._open.clear()
