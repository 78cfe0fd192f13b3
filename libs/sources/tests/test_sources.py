"""Reading what `goodput index` and Reindex jobs index: files, folders, JSONL, several paths at once."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from goodput_sources import SourceDenied, SourceError, check_source, read_source, read_sources


def test_a_folder_gives_its_files_with_ids_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "docs" / "api").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text("# Guide\nhello")
    (tmp_path / "docs" / "api" / "auth.py").write_text("def login(): ...")
    (tmp_path / "docs" / ".hidden").write_text("skipped")
    docs = {d.id: d for d in read_source(tmp_path / "docs")}
    assert set(docs) == {"guide.md", "api/auth.py"}
    assert docs["guide.md"].type == "markdown" and docs["guide.md"].title == "guide"
    assert docs["api/auth.py"].type == "code" and docs["api/auth.py"].metadata == {"path": "api/auth.py"}


def test_jsonl_lines_become_documents_and_bad_lines_are_named(tmp_path: Path) -> None:
    src = tmp_path / "corpus.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"_id": 7, "text": "seven", "metadata": {"lang": "en"}}) + "\n\n")
    (doc,) = read_source(src)
    assert (doc.id, doc.text, doc.metadata) == ("7", "seven", {"lang": "en"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\nnot json\n')
    with pytest.raises(SourceError, match="bad.jsonl:2"):
        list(read_source(bad))


def test_several_paths_are_read_in_order(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("a")
    (tmp_path / "README.md").write_text("readme")
    ids = [d.id for d in read_sources([tmp_path / "docs", tmp_path / "README.md"])]
    assert ids == ["a.md", "README.md"]


def test_two_paths_giving_the_same_id_are_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("docs readme")
    (tmp_path / "README.md").write_text("top readme")
    with pytest.raises(SourceError, match=r"docs and .*README.md both give a document with the id 'README.md'"):
        list(read_sources([tmp_path / "docs", tmp_path / "README.md"]))


def test_missing_and_binary_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        list(read_source(tmp_path / "nope"))
    (tmp_path / "x.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SourceError, match="not UTF-8"):
        list(read_source(tmp_path / "x.bin"))


# ---- what a service reading a caller's path may read ----------------------------------------------------------------

@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "kb").mkdir(parents=True)
    (tmp_path / "root" / "kb" / "a.md").write_text("# A\nalpha")
    (tmp_path / "outside.md").write_text("a secret outside the root")
    return tmp_path / "root"


def test_a_path_inside_a_root_is_read_and_one_outside_is_denied_by_name(root: Path) -> None:
    assert [d.id for d in read_source(root / "kb", roots=[root])] == ["a.md"]
    with pytest.raises(SourceDenied, match=r"outside.md is outside the source roots") as info:
        list(read_source(root.parent / "outside.md", roots=[root]))
    assert info.value.reason == "outside_roots"
    # an empty list of roots allows nothing; a system file is refused before anyone learns whether it exists
    with pytest.raises(SourceDenied, match="none configured"):
        list(read_source(root / "kb", roots=[]))
    with pytest.raises(SourceDenied):
        check_source(Path("/etc/passwd"), roots=[root])
    with pytest.raises(SourceDenied):
        check_source(Path("/no/such/file"), roots=[root])


def test_dot_dot_cannot_climb_out_of_a_root(root: Path) -> None:
    sneaky = root / "kb" / ".." / ".." / "outside.md"
    with pytest.raises(SourceDenied, match=r"resolves to .*outside.md, which is outside the source roots"):
        list(read_source(sneaky, roots=[root]))
    with pytest.raises(SourceDenied):
        list(read_source(root / ".." / ".." / ".." / "etc" / "passwd", roots=[root]))
    # relative paths mean nothing to a remote caller: refused when roots are set
    with pytest.raises(SourceError, match="absolute path") as info:
        check_source(Path("kb/a.md"), roots=[root])
    assert info.value.reason == "not_absolute"


def test_a_symlink_inside_a_root_pointing_outside_is_refused(root: Path) -> None:
    (root / "kb" / "leak.md").symlink_to(root.parent / "outside.md")
    with pytest.raises(SourceDenied, match=r"leak.md resolves to .*outside.md, which is outside the source roots"):
        list(read_source(root / "kb", roots=[root]))  # found while walking the folder
    with pytest.raises(SourceDenied):
        list(read_source(root / "kb" / "leak.md", roots=[root]))  # named directly
    (root / "etc").symlink_to("/etc", target_is_directory=True)
    with pytest.raises(SourceDenied):
        list(read_source(root / "etc" / "passwd", roots=[root]))
    # a symlink that stays inside the root is fine, read under its own name
    (root / "kb" / "leak.md").unlink()
    (root / "kb" / "alias.md").symlink_to(root / "kb" / "a.md")
    assert sorted(d.id for d in read_source(root / "kb", roots=[root])) == ["a.md", "alias.md"]
    # a symlinked folder is not entered: one inside the root is left out, one leading outside is refused
    (root / "kb" / "again").symlink_to(root / "kb", target_is_directory=True)
    assert sorted(d.id for d in read_source(root / "kb", roots=[root])) == ["a.md", "alias.md"]
    (root / "kb" / "out").symlink_to(root.parent, target_is_directory=True)
    with pytest.raises(SourceDenied, match="out resolves to"):
        list(read_source(root / "kb", roots=[root]))
    (root / "kb" / "out").unlink()
    # and the root itself may be reached through a symlink
    (root.parent / "link-to-root").symlink_to(root, target_is_directory=True)
    assert [d.id for d in read_source(root.parent / "link-to-root" / "kb" / "a.md", roots=[root])] == ["a.md"]


def test_a_fifo_is_refused_not_waited_on(root: Path) -> None:
    fifo = root / "kb" / "pipe.md"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match=r"pipe.md is a FIFO; only regular files are read") as info:
        list(read_source(fifo, roots=[root]))
    assert info.value.reason == "special_file"
    with pytest.raises(SourceError, match="a FIFO"):
        list(read_source(root / "kb", roots=[root]))  # in a folder too: named, not silently skipped


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs a Linux /proc")
def test_proc_self_environ_is_refused_even_with_a_root_above_it(tmp_path: Path) -> None:
    # /proc/self/environ (where the stores' credentials live) reads as an empty regular file
    environ = Path("/proc/self/environ")
    with pytest.raises(SourceDenied):
        list(read_source(environ, roots=[tmp_path]))
    with pytest.raises(SourceError, match="pseudo filesystem") as info:
        list(read_source(environ, roots=[Path("/")]))
    assert info.value.reason == "pseudo_file"
    with pytest.raises(SourceError, match="pseudo filesystem"):
        list(read_source(environ))  # the CLI (no roots) does not read it either
    (tmp_path / "env.md").symlink_to(environ)
    with pytest.raises(SourceError, match="pseudo filesystem"):
        list(read_source(tmp_path, roots=[Path("/")]))


def test_a_file_over_the_size_bound_is_refused(root: Path) -> None:
    (root / "kb" / "big.md").write_text("x" * 2000)
    with pytest.raises(SourceError, match=r"big.md is 2000 bytes; the limit is 1000") as info:
        list(read_source(root / "kb" / "big.md", roots=[root], max_file_bytes=1000))
    assert info.value.reason == "too_large"
    assert len(list(read_source(root / "kb", roots=[root], max_file_bytes=2000))) == 2
    # a gzipped JSONL file is bounded by the text it holds, not by its compressed size
    bomb = root / "kb" / "bomb.jsonl.gz"
    with gzip.open(bomb, "wt", encoding="utf-8") as f:
        for i in range(100):
            f.write(json.dumps({"id": i, "text": "y" * 100}) + "\n")
    assert bomb.stat().st_size < 1000
    with pytest.raises(SourceError, match="bomb.jsonl.gz holds more than 1000 bytes of text"):
        list(read_source(bomb, roots=[root], max_file_bytes=1000))


def test_hidden_folders_are_left_out_of_a_folder(root: Path) -> None:
    (root / "kb" / ".git").mkdir()
    (root / "kb" / ".git" / "config").write_text("[core]")
    (root / "kb" / ".env").write_text("TOKEN=1")
    assert [d.id for d in read_source(root / "kb", roots=[root])] == ["a.md"]
