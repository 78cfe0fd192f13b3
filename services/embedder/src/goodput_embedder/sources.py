"""What a Reindex job may read: local paths under the configured source roots only (``source_roots``), regular files
of real filesystems, each under ``source_max_file_bytes``. The Reindex RPC checks the source before it queues a job
(the caller gets the refusal as a status code) and the job reads through the same checks (the file may have changed
in between, and a Celery worker may not share the embedder's view of the disk).

Example::

    access = SourceAccess.from_settings(settings)
    access.check("/srv/kb/handbook")          # raises PermissionDenied / InvalidArgument naming the problem
    docs = list(access.read("/srv/kb/handbook"))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from goodput_core.errors import GoodputError, InvalidArgument, PermissionDenied
from goodput_sources import SourceDenied, SourceDocument, SourceError, check_source, read_source

from goodput_embedder.config import EmbedderSettings

__all__ = ["SourceAccess", "source_error"]

_SETTING = "GOODPUT_EMBEDDER_SOURCE_ROOTS"


def source_error(err: SourceError) -> GoodputError:
    """A reader's refusal as the error a caller sees: outside the roots is PERMISSION_DENIED, the rest
    INVALID_ARGUMENT; ``code`` is the reader's reason (``outside_roots``, ``special_file``, ``too_large``...)."""
    if isinstance(err, SourceDenied):
        return PermissionDenied(f"{err}; a Reindex source must be inside {_SETTING}", param="source_uri",
                                code=err.reason)
    return InvalidArgument(str(err), param="source_uri", code=err.reason)


class SourceAccess:
    def __init__(self, roots: Sequence[Path], *, max_file_bytes: int) -> None:
        self.roots = tuple(roots)
        self.max_file_bytes = max_file_bytes

    @classmethod
    def from_settings(cls, settings: EmbedderSettings) -> SourceAccess:
        return cls([Path(r) for r in settings.source_roots], max_file_bytes=settings.source_max_file_bytes)

    def check(self, source: str) -> Path:
        """The resolved path of a source a job may read, or the refusal (a GoodputError)."""
        if not self.roots:
            raise PermissionDenied(f"this embedder reads no local paths ({_SETTING} is empty); send the documents "
                                   "with IndexDocuments", param="source_uri", code="no_source_roots")
        if "://" in source:
            raise InvalidArgument(f"{source[:200]!r}: a source is a local path (file, folder or JSONL), not a URL",
                                  param="source_uri", code="invalid_value")
        try:
            return check_source(Path(source), roots=self.roots, max_file_bytes=self.max_file_bytes)
        except SourceError as err:
            raise source_error(err) from None

    def read(self, source: str) -> Iterator[SourceDocument]:
        """The source's documents, read through the same checks; a refusal is raised as a GoodputError."""
        self.check(source)
        try:
            yield from read_source(Path(source), roots=self.roots, max_file_bytes=self.max_file_bytes)
        except SourceError as err:
            raise source_error(err) from None
