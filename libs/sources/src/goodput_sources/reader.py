"""Reading documents for indexing jobs and the CLI: a JSONL file (optionally gzipped), a text/Markdown/code file,
or a folder of them (recursively). JSONL lines are ``{"id" or "_id", "text", "title"?, "type"?, "metadata"?}``.

A file's id is its name; a file in a folder has its path inside that folder (``docs/api/auth.md`` read from
``docs/`` is ``api/auth.md``), so a folder indexed again gives the same ids and unchanged files are skipped.

Example::

    for doc in read_source(Path("docs/")): ...
    docs = list(read_sources([Path("docs/"), Path("README.md")]))   # ids must not collide across paths
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SourceDocument", "SourceError", "read_source", "read_sources"]

_TYPE_BY_SUFFIX = {".md": "markdown", ".markdown": "markdown", ".txt": "prose", ".rst": "prose",
                   ".py": "code", ".js": "code", ".ts": "code", ".go": "code", ".rs": "code", ".java": "code",
                   ".c": "code", ".cc": "code", ".cpp": "code", ".h": "code", ".rb": "code", ".sh": "code"}


class SourceError(ValueError):
    """A source cannot be read (missing, bad JSON, not UTF-8)."""


@dataclass(frozen=True)
class SourceDocument:
    id: str
    text: str
    title: str = ""
    type: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


def _jsonl(path: Path) -> Iterator[SourceDocument]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise SourceError(f"{path}:{n}: each line must be a JSON object")
            doc_id = obj.get("id", obj.get("_id"))
            if doc_id is None or not isinstance(obj.get("text", ""), str):
                raise SourceError(f"{path}:{n}: needs an 'id' (or '_id') and a string 'text'")
            meta = obj.get("metadata") or {}
            yield SourceDocument(id=str(doc_id), text=obj.get("text", ""), title=str(obj.get("title") or ""),
                                 type=str(obj.get("type") or ""),
                                 metadata={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {})


def _file(path: Path, doc_id: str) -> SourceDocument:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not UTF-8 text") from None
    return SourceDocument(id=doc_id, text=text, title=path.stem, type=_TYPE_BY_SUFFIX.get(path.suffix.lower(), ""),
                          metadata={"path": doc_id})


def read_source(path: Path) -> Iterator[SourceDocument]:
    if not path.exists():
        raise SourceError(f"{path} does not exist")
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            if f.name.endswith((".jsonl", ".jsonl.gz")):
                yield from _jsonl(f)
            else:
                yield _file(f, f.relative_to(path).as_posix())
    elif path.name.endswith((".jsonl", ".jsonl.gz")):
        yield from _jsonl(path)
    else:
        yield _file(path, path.name)


def read_sources(paths: Iterable[Path]) -> Iterator[SourceDocument]:
    """The documents of several paths, in order. Two paths that give a document the same id are an error naming
    both, since the second would silently replace the first in the knowledge base."""
    seen: dict[str, int] = {}
    given: list[Path] = []
    for n, path in enumerate(paths):
        given.append(path)
        for doc in read_source(path):
            first = seen.setdefault(doc.id, n)
            if first != n:
                raise SourceError(f"{given[first]} and {path} both give a document with the id {doc.id!r}; index "
                                  "them separately (or into different knowledge bases)")
            yield doc
