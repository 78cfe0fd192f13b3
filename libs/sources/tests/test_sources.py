"""Reading what `goodput index` and Reindex jobs index: files, folders, JSONL, several paths at once."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from goodput_sources import SourceError, read_source, read_sources


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
