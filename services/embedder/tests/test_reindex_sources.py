"""What a Reindex job may read: only files under the source roots (``..`` and symlinks resolved first), regular
files of real filesystems under the size bound. The RPC refuses a bad source with a status code before a job
exists; the job checks again when it reads."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.errors import ERROR_CODE_KEY
from goodput_core.server import ServiceRunner

from goodput_embedder.config import EmbedderSettings
from goodput_embedder.indexer import Indexer
from goodput_embedder.jobs import JobStore, run_reindex
from goodput_embedder.servicer import IndexerServicer
from goodput_embedder.sources import SourceAccess


class RecordingCelery:
    """Stands in for the Celery app: the tasks Reindex queued (no worker needed to see that a job was refused)."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []

    def send_task(self, name: str, args: list[Any]) -> None:
        self.sent.append(args)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``root/kb`` holds one document; a secret lies beside the root."""
    (tmp_path / "root" / "kb").mkdir(parents=True)
    (tmp_path / "root" / "kb" / "guide.md").write_text("# Guide\nThe code word is heron.")
    (tmp_path / "secret.md").write_text("the stores' password")
    return tmp_path


async def _reindex_server(settings: EmbedderSettings, indexer: Indexer, roots: list[str], max_bytes: int = 1 << 20
                          ) -> tuple[ServiceRunner, RecordingCelery]:
    settings = settings.model_copy(update={"source_roots": roots, "source_max_file_bytes": max_bytes})
    client = redis.Redis.from_url(settings.redis_url)
    celery = RecordingCelery()
    servicer = IndexerServicer(settings, indexer, JobStore(client, prefix=settings.key_prefix, ttl_s=600), celery,
                               sources=SourceAccess.from_settings(settings))
    runner = ServiceRunner(name="embedder", settings=settings, registry=CollectorRegistry(), provider=None)
    runner.add(embedder_pb2_grpc.add_IndexerServicer_to_server, servicer, "goodput.embedder.v1.Indexer")
    await runner.start()
    return runner, celery


async def _refusal(runner: ServiceRunner, source: str) -> tuple[grpc.StatusCode, str, str]:
    async with aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as ch:
        with pytest.raises(aio.AioRpcError) as info:
            await embedder_pb2_grpc.IndexerStub(ch).Reindex(embedder_pb2.ReindexRequest(
                tenant="acme", knowledge_base="handbook", source_uri=source))
    code = dict(info.value.trailing_metadata() or ()).get(ERROR_CODE_KEY, "")
    return info.value.code(), info.value.details() or "", str(code)


async def test_without_source_roots_reindex_reads_no_local_path(settings, indexer, tree: Path) -> None:
    runner, celery = await _reindex_server(settings, indexer, roots=[])
    try:
        code, message, reason = await _refusal(runner, str(tree / "root" / "kb"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and reason == "no_source_roots"
        assert "GOODPUT_EMBEDDER_SOURCE_ROOTS is empty" in message and "IndexDocuments" in message
        assert celery.sent == []
    finally:
        await runner.stop()


async def test_reindex_refuses_what_lies_outside_the_roots_or_is_not_a_document(settings, indexer, tree: Path) -> None:
    root = tree / "root"
    (root / "kb" / "leak.md").symlink_to(tree / "secret.md")
    os.mkfifo(root / "fifo.md")
    (root / "big.md").write_text("x" * 5000)
    runner, celery = await _reindex_server(settings, indexer, roots=[str(root)], max_bytes=4096)
    try:
        denied = {
            "/etc/passwd": "is outside the source roots",  # a system file
            "/proc/self/environ": "is outside the source roots",  # the process's environment: the credentials
            str(root / ".." / "secret.md"): "resolves to",  # traversal
            str(root / "kb" / "leak.md"): "resolves to",  # a symlink inside the root pointing out of it
        }
        for source, words in denied.items():
            code, message, reason = await _refusal(runner, source)
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "outside_roots"), source
            assert words in message and "GOODPUT_EMBEDDER_SOURCE_ROOTS" in message, message
        invalid = {
            str(root / "fifo.md"): ("special_file", "is a FIFO; only regular files are read"),
            str(root / "big.md"): ("too_large", "is 5000 bytes; the limit is 4096"),
            str(root / "missing.md"): ("missing", "does not exist"),
            "kb/guide.md": ("not_absolute", "absolute path"),
            "s3://bucket/kb": ("invalid_value", "not a URL"),
        }
        for source, (want, words) in invalid.items():
            code, message, reason = await _refusal(runner, source)
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, want), source
            assert words in message, message
        assert celery.sent == []  # no job was queued for any of them
        # a source inside the root is accepted and queued
        async with aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as ch:
            r = await embedder_pb2_grpc.IndexerStub(ch).Reindex(embedder_pb2.ReindexRequest(
                tenant="acme", knowledge_base="handbook", source_uri=str(root / "kb" / "guide.md")))
        assert r.job_id and len(celery.sent) == 1
    finally:
        await runner.stop()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs a Linux /proc")
async def test_proc_files_are_refused_even_under_a_root_that_holds_them(settings, indexer) -> None:
    runner, _ = await _reindex_server(settings, indexer, roots=["/"])
    try:
        code, message, reason = await _refusal(runner, "/proc/self/environ")
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "pseudo_file") and "pseudo filesystem" in message
    finally:
        await runner.stop()


async def test_a_job_reads_through_the_same_checks(settings, indexer, tree: Path) -> None:
    """A source accepted when queued is checked again when the job reads it: a symlink to a file outside the root,
    added in between, fails the job, and nothing of it is indexed."""
    root = tree / "root"
    settings = settings.model_copy(update={"source_roots": [str(root)]})
    access = SourceAccess.from_settings(settings)
    jobs = JobStore(redis.Redis.from_url(settings.redis_url), prefix=settings.key_prefix, ttl_s=600)
    job = jobs.create("acme", "handbook", str(root / "kb"), False)
    # (in a thread: the retriever the job writes to serves on this test's event loop)
    result = await asyncio.to_thread(run_reindex, indexer, jobs, job, "acme", "handbook", str(root / "kb"), False,
                                     sources=access)
    first = jobs.get(job)
    assert first is not None and first.state == "succeeded", first
    assert result.documents_indexed == 1
    (root / "kb" / "leak.md").symlink_to(tree / "secret.md")
    job2 = jobs.create("acme", "handbook", str(root / "kb"), False)
    await asyncio.to_thread(run_reindex, indexer, jobs, job2, "acme", "handbook", str(root / "kb"), False,
                            sources=access)
    info = jobs.get(job2)
    assert info is not None and info.state == "failed"
    assert "leak.md resolves to" in info.error and "outside the source roots" in info.error
    assert indexer.version("acme", "handbook") == result.kb_version  # the failed job wrote nothing


def test_source_roots_are_a_comma_separated_list_of_absolute_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_EMBEDDER_SOURCE_ROOTS", "/srv/kb, /data/docs")
    assert EmbedderSettings().source_roots == ["/srv/kb", "/data/docs"]
    assert EmbedderSettings.model_fields["source_roots"].default_factory() == []  # type: ignore[misc]
    monkeypatch.setenv("GOODPUT_EMBEDDER_SOURCE_ROOTS", "docs")
    with pytest.raises(ValueError, match="not an absolute path"):
        EmbedderSettings()
    assert json.dumps(EmbedderSettings.model_fields["source_max_file_bytes"].default) == str(64 << 20)
