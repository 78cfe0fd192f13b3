"""Documents to index, read from files, folders (recursively) or JSONL files: what a Reindex job and
`goodput index` both read, so the same path gives the same documents (and ids) either way.

Example::

    from goodput_sources import read_sources
    docs = list(read_sources([Path("docs/"), Path("README.md")]))
"""

from goodput_sources.reader import SourceDenied, SourceDocument, SourceError, check_source, read_source, read_sources

__all__ = ["SourceDenied", "SourceDocument", "SourceError", "check_source", "read_source", "read_sources"]
