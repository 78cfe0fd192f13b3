r"""Chunkers, one per document type. Sizes are counted in words (whitespace-separated tokens; MiniLM's word
pieces run ~1.3 per English word) and come from settings.

- ``faq``: one chunk per question/answer entry.
- ``prose``: windows of ``prose_chunk_tokens`` words with ``prose_overlap`` overlap, cut at paragraph ends when
  one is near.
- ``markdown``: one chunk per heading section (the heading path is kept as the section's first line).
- ``code``: one chunk per top-level function or class (the lines before the first one are a chunk of their own).

A section longer than its type's limit is split like prose. Every chunk carries the document's title as its first
line, so a chunk is understandable (and findable) on its own.

Example:
    >>> chunk_document("# Refunds\nWithin 30 days.\n\n## Exceptions\nSale items are final.\n", doc_type="markdown",
    ...                title="Guide", sizes=ChunkSizes())
    ['Guide\nRefunds\nWithin 30 days.', 'Guide\nRefunds > Exceptions\nSale items are final.']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DOC_TYPES", "ChunkSizes", "chunk_document", "guess_type"]

DOC_TYPES = ("prose", "markdown", "faq", "code")

_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
_FAQ_Q = re.compile(r"^\s*(?:Q|Question)\s*[:.)]\s*", re.IGNORECASE)
_CODE_DEF = re.compile(r"^(?:async\s+def|def|class|function|func|fn|pub\s+fn|(?:public|private|export)\s+"
                       r"(?:class|function|interface|static))\b")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class ChunkSizes:
    prose_tokens: int = 256
    prose_overlap: float = 0.125
    markdown_max_tokens: int = 512
    code_max_tokens: int = 512
    faq_max_tokens: int = 512


def guess_type(text: str) -> str:
    lines = text.splitlines()
    if sum(1 for ln in lines if _FAQ_Q.match(ln)) >= 2:
        return "faq"
    if sum(1 for ln in lines if _CODE_DEF.match(ln)) >= 1 and sum(1 for ln in lines if ln.startswith(
            ("    ", "\t"))) >= max(2, len(lines) // 5):
        return "code"
    if any(_HEADING.match(ln) for ln in lines):
        return "markdown"
    return "prose"


def chunk_document(text: str, *, doc_type: str, title: str = "", sizes: ChunkSizes) -> list[str]:
    """Chunk texts of one document, in order (empty pieces dropped)."""
    if doc_type == "faq":
        pieces = _split_long(_faq_entries(text), sizes.faq_max_tokens, sizes.prose_overlap)
    elif doc_type == "markdown":
        pieces = _split_long(_markdown_sections(text), sizes.markdown_max_tokens, sizes.prose_overlap)
    elif doc_type == "code":
        pieces = _split_long(_code_units(text), sizes.code_max_tokens, sizes.prose_overlap)
    elif doc_type == "prose":
        pieces = _windows(text, sizes.prose_tokens, sizes.prose_overlap)
    else:
        raise ValueError(f"unknown document type {doc_type!r}")
    head = title.strip()
    return [f"{head}\n{p}" if head else p for p in pieces if p.strip()]


def _windows(text: str, size: int, overlap: float) -> list[str]:
    """Word windows of ``size`` with ``overlap``; a window ends early at a paragraph end in its last quarter."""
    words = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    if not words:
        return []
    if len(words) <= size:
        return [text.strip()]
    para_ends = {i for i in range(len(words) - 1) if "\n\n" in text[words[i][1]:words[i + 1][0]]}
    step_back = int(size * overlap)
    chunks: list[str] = []
    start = 0
    while start < len(words):
        end = min(start + size, len(words))
        if end < len(words):
            for i in range(end - 1, start + (3 * size) // 4, -1):
                if i in para_ends:
                    end = i + 1
                    break
        chunks.append(text[words[start][0]:words[end - 1][1]])
        if end >= len(words):
            break
        start = max(end - step_back, start + 1)
    return chunks


def _split_long(pieces: list[str], limit: int, overlap: float) -> list[str]:
    out: list[str] = []
    for p in pieces:
        out.extend(_windows(p, limit, overlap) if len(_WORD.findall(p)) > limit else [p.strip()])
    return out


def _faq_entries(text: str) -> list[str]:
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if _FAQ_Q.match(ln)]
    if not starts:
        return [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    entries = []
    if starts[0] > 0 and "\n".join(lines[:starts[0]]).strip():
        entries.append("\n".join(lines[:starts[0]]))
    entries.extend("\n".join(lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True))
    return entries


def _markdown_sections(text: str) -> list[str]:
    sections: list[str] = []
    path: list[str] = []
    current: list[str] = []
    in_fence = False

    def flush() -> None:
        body = "\n".join(current).strip()
        if body:
            sections.append(body)

    for ln in text.splitlines():
        if ln.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else _HEADING.match(ln)
        if m:
            flush()
            level = len(m.group(1))
            path[:] = path[:level - 1] + [m.group(2)]
            current = [" > ".join(path)]
        else:
            current.append(ln)
    flush()
    return sections


def _code_units(text: str) -> list[str]:
    lines = text.splitlines()
    units: list[str] = []
    current: list[str] = []
    pending_decorators: list[str] = []
    for ln in lines:
        if ln.startswith("@"):
            pending_decorators.append(ln)
            continue
        if _CODE_DEF.match(ln):
            if current and "\n".join(current).strip():
                units.append("\n".join(current))
            current = [*pending_decorators, ln]
        else:
            current.extend(pending_decorators)
            current.append(ln)
        pending_decorators = []
    current.extend(pending_decorators)
    if current and "\n".join(current).strip():
        units.append("\n".join(current))
    return units
