"""Reading documents for indexing jobs and the CLI: a JSONL file (optionally gzipped), a text/Markdown/code file,
or a folder of them (recursively). JSONL lines are ``{"id" or "_id", "text", "title"?, "type"?, "metadata"?}``.

A file's id is its name; a file in a folder has its path inside that folder (``docs/api/auth.md`` read from
``docs/`` is ``api/auth.md``), so a folder indexed again gives the same ids and unchanged files are skipped.
Hidden files and everything under a hidden folder (``.git/``, ``.env``) are left out of a folder.

Only regular files are read: a FIFO, a socket or a device is refused, and so is a file on a pseudo filesystem
(``/proc``, ``/sys``: ``/proc/self/environ`` looks like an empty regular file but holds the process's environment).
A service that reads paths a caller names passes ``roots``: every path, and every file found under a folder, must
then resolve (symlinks followed first) inside one of those folders, so ``..`` or a symlink cannot lead outside them.
``max_file_bytes`` bounds each file (for a gzipped JSONL file, its decompressed text).

Example::

    for doc in read_source(Path("docs/")): ...
    docs = list(read_sources([Path("docs/"), Path("README.md")]))   # ids must not collide across paths
    job = list(read_source(Path("/srv/kb/handbook"), roots=[Path("/srv/kb")], max_file_bytes=64 << 20))
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SourceDenied", "SourceDocument", "SourceError", "check_source", "read_source", "read_sources"]

_TYPE_BY_SUFFIX = {".md": "markdown", ".markdown": "markdown", ".txt": "prose", ".rst": "prose",
                   ".py": "code", ".js": "code", ".ts": "code", ".go": "code", ".rs": "code", ".java": "code",
                   ".c": "code", ".cc": "code", ".cpp": "code", ".h": "code", ".rb": "code", ".sh": "code"}

# Filesystems whose files are views of the kernel or of processes, not documents.
_PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "cgroup",
                        "cgroup2", "configfs", "bpf", "fusectl", "pstore", "efivarfs", "mqueue", "binfmt_misc",
                        "hugetlbfs", "nsfs", "rpc_pipefs", "autofs", "selinuxfs"})
# Refused even where the mount table cannot be read.
_PSEUDO_DIRS = (Path("/proc"), Path("/sys"), Path("/dev"))
_KIND = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


class SourceError(ValueError):
    """A source cannot be read. ``reason`` says why, for callers that map it to an error code: ``missing``,
    ``not_absolute``, ``special_file``, ``pseudo_file``, ``too_large``, ``not_utf8``, ``bad_jsonl``,
    ``duplicate_id`` (or ``outside_roots`` on :class:`SourceDenied`)."""

    def __init__(self, message: str, *, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason


class SourceDenied(SourceError):
    """The path resolves outside the roots the reader was given (a permission matter, not a malformed path)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="outside_roots")


@dataclass(frozen=True)
class SourceDocument:
    id: str
    text: str
    title: str = ""
    type: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


class _Guard:
    """What may be read: the resolved roots (None = anywhere) and the size bound (None = none)."""

    def __init__(self, roots: Sequence[Path] | None, max_file_bytes: int | None) -> None:
        self.roots = None if roots is None else tuple(Path(r).resolve() for r in roots)
        self.max_file_bytes = max_file_bytes
        self._pseudo: frozenset[int] | None = None

    def inside(self, path: Path) -> bool:
        return self.roots is None or any(path == r or path.is_relative_to(r) for r in self.roots)

    def resolve(self, given: Path, *, shown: Path | None = None) -> Path:
        """``given`` with symlinks and ``..`` resolved, refused when that lies outside the roots. Checked before
        existence, so a caller learns nothing about paths outside the roots."""
        shown = shown or given
        if self.roots is not None and not given.is_absolute():
            raise SourceError(f"{given}: a source must be an absolute path inside the source roots "
                              f"({self._roots_text()})", reason="not_absolute")
        try:
            real = given.resolve()
        except (OSError, RuntimeError) as err:  # a symlink loop
            raise SourceError(f"{shown}: cannot be resolved ({err})") from None
        if not self.inside(real):
            where = f"{shown} resolves to {real}, which is" if real != given.absolute() else f"{shown} is"
            raise SourceDenied(f"{where} outside the source roots ({self._roots_text()})")
        return real

    def _roots_text(self) -> str:
        return ", ".join(map(str, self.roots or ())) or "none configured"

    def pseudo_devices(self) -> frozenset[int]:
        if self._pseudo is None:
            self._pseudo = _pseudo_devices()
        return self._pseudo

    def check_file(self, real: Path, st: os.stat_result, shown: Path) -> None:
        """Refuses what is not a regular file of a real filesystem, or is over the bound."""
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KIND if test(st.st_mode)), "not a regular file")
            raise SourceError(f"{shown} is {kind}; only regular files are read", reason="special_file")
        if st.st_dev in self.pseudo_devices() or any(real.is_relative_to(d) for d in _PSEUDO_DIRS):
            raise SourceError(f"{shown} is on a pseudo filesystem (kernel or process state, not a document)",
                              reason="pseudo_file")
        if self.max_file_bytes is not None and st.st_size > self.max_file_bytes:
            raise SourceError(f"{shown} is {st.st_size} bytes; the limit is {self.max_file_bytes}",
                              reason="too_large")

    def open(self, real: Path, shown: Path) -> io.BufferedReader:
        """Opens a checked file without following a symlink swapped in since, and checks what was opened."""
        before = real.lstat()
        self.check_file(real, before, shown)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(real, flags)
        except OSError as err:
            raise SourceError(f"{shown}: cannot be opened ({err.strerror})") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise SourceError(f"{shown} changed while it was being opened", reason="special_file")
            self.check_file(real, st, shown)
            opened = _fd_path(fd)
            if opened is not None and not self.inside(opened):
                raise SourceDenied(f"{shown} was opened at {opened}, outside the source roots "
                                   f"({self._roots_text()})")
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def bounded(self, raw: io.BufferedIOBase, shown: Path) -> bytes:
        limit = self.max_file_bytes
        data = raw.read() if limit is None else raw.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise SourceError(f"{shown} holds more than {limit} bytes (the limit)", reason="too_large")
        return data


def _fd_path(fd: int) -> Path | None:
    """The path the kernel opened (Linux), so a folder swapped for a symlink mid-way is seen; None elsewhere."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def _pseudo_devices() -> frozenset[int]:
    """Device numbers of the mounted pseudo filesystems, from the mount table (empty where there is none)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    out = set()
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, fstype = left.split(), right.split()[:1]
        if len(fields) > 2 and fstype and fstype[0] in _PSEUDO_FS:
            major, _, minor = fields[2].partition(":")
            if major.isdigit() and minor.isdigit():
                out.add(os.makedev(int(major), int(minor)))
    return frozenset(out)


def _jsonl(real: Path, shown: Path, guard: _Guard) -> Iterator[SourceDocument]:
    with guard.open(real, shown) as raw:
        stream: io.BufferedIOBase = raw
        if real.name.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        read = 0
        try:
            for n, rawline in enumerate(stream, 1):
                read += len(rawline)
                if guard.max_file_bytes is not None and read > guard.max_file_bytes:
                    raise SourceError(f"{shown} holds more than {guard.max_file_bytes} bytes of text (the limit)",
                                      reason="too_large")
                try:
                    line = rawline.decode("utf-8")
                except UnicodeDecodeError:
                    raise SourceError(f"{shown}:{n}: not UTF-8 text", reason="not_utf8") from None
                if not line.strip():
                    continue
                yield _jsonl_doc(line, shown, n)
        except (OSError, EOFError) as err:  # a corrupt gzip stream
            raise SourceError(f"{shown}: cannot be read ({err})") from None


def _jsonl_doc(line: str, shown: Path, n: int) -> SourceDocument:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise SourceError(f"{shown}:{n}: not valid JSON ({err.msg})", reason="bad_jsonl") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{shown}:{n}: each line must be a JSON object", reason="bad_jsonl")
    doc_id = obj.get("id", obj.get("_id"))
    if doc_id is None or not isinstance(obj.get("text", ""), str):
        raise SourceError(f"{shown}:{n}: needs an 'id' (or '_id') and a string 'text'", reason="bad_jsonl")
    meta = obj.get("metadata") or {}
    return SourceDocument(id=str(doc_id), text=obj.get("text", ""), title=str(obj.get("title") or ""),
                          type=str(obj.get("type") or ""),
                          metadata={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {})


def _file(real: Path, shown: Path, doc_id: str, guard: _Guard) -> SourceDocument:
    with guard.open(real, shown) as raw:
        data = guard.bounded(raw, shown)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"{shown}: not UTF-8 text", reason="not_utf8") from None
    return SourceDocument(id=doc_id, text=text, title=shown.stem, type=_TYPE_BY_SUFFIX.get(shown.suffix.lower(), ""),
                          metadata={"path": doc_id})


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def _folder(folder: Path, real_folder: Path, guard: _Guard) -> Iterator[SourceDocument]:
    # Symlinked folders are not followed (no cycles, no second copy of a tree); symlinked files are, to their
    # resolved target, which must be inside the roots like everything else.
    for entry in sorted(_walk(real_folder)):
        rel = entry.relative_to(real_folder)
        shown = folder / rel
        st = entry.lstat()
        real = entry
        if stat.S_ISLNK(st.st_mode):
            real = guard.resolve(entry, shown=shown)
            if real.is_dir():
                continue
        if _is_jsonl(entry):
            yield from _jsonl(real, shown, guard)
        else:
            yield _file(real, shown, rel.as_posix(), guard)


def _walk(folder: Path) -> Iterator[Path]:
    """Every entry below ``folder`` but folders, hidden ones (and all under a hidden folder) left out, symlinked
    folders not entered."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        base = Path(top)
        yield from (base / f for f in files if not f.startswith("."))
        # a symlink to a folder is listed among dirs by os.walk: hand it on, the caller resolves and checks it
        yield from (base / d for d in dirs if (base / d).is_symlink())


def check_source(path: Path, *, roots: Sequence[Path] | None = None, max_file_bytes: int | None = None) -> Path:
    """The resolved path of a source that may be read (a folder, or a file passing the checks of
    :func:`read_source`); raises :class:`SourceDenied` or :class:`SourceError` naming what is wrong. Files inside
    a folder are checked as the folder is read."""
    guard = _Guard(roots, max_file_bytes)
    real = guard.resolve(path)
    try:
        st = real.stat()
    except FileNotFoundError:
        raise SourceError(f"{path} does not exist", reason="missing") from None
    except OSError as err:
        raise SourceError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        guard.check_file(real, st, path)
    return real


def read_source(path: Path, *, roots: Sequence[Path] | None = None,
                max_file_bytes: int | None = None) -> Iterator[SourceDocument]:
    """The documents of one file or folder. ``roots``: None reads any path (a person indexing their own files);
    otherwise only paths that resolve inside one of these folders (an empty list allows none)."""
    guard = _Guard(roots, max_file_bytes)
    real = check_source(path, roots=roots, max_file_bytes=max_file_bytes)
    if real.is_dir():
        yield from _folder(path, real, guard)
    elif _is_jsonl(path):
        yield from _jsonl(real, path, guard)
    else:
        yield _file(real, path, path.name, guard)


def read_sources(paths: Iterable[Path], *, roots: Sequence[Path] | None = None,
                 max_file_bytes: int | None = None) -> Iterator[SourceDocument]:
    """The documents of several paths, in order. Two paths that give a document the same id are an error naming
    both, since the second would silently replace the first in the knowledge base."""
    seen: dict[str, int] = {}
    given: list[Path] = []
    for n, path in enumerate(paths):
        given.append(path)
        for doc in read_source(path, roots=roots, max_file_bytes=max_file_bytes):
            first = seen.setdefault(doc.id, n)
            if first != n:
                raise SourceError(f"{given[first]} and {path} both give a document with the id {doc.id!r}; index "
                                  "them separately (or into different knowledge bases)", reason="duplicate_id")
            yield doc
