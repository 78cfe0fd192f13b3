"""Indexing sources, black box: a real local platform (embedder, retriever, simulated worker) whose embedder may
read local files only under the roots it is given. What an attacker who may call `Reindex` tries: a system file,
the process's own environment (which holds the stores' credentials), `..` out of a root, a symlink inside a root
that points out, a FIFO (a read that never ends). Each is refused with its reason and before a job exists; a
file inside the root is indexed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

PORT_OFFSET = 3500


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    (root / "handbook.md").write_text("# Refunds\n\nRefunds are paid within 14 days of the return.\n")
    (root / "escape").symlink_to("/etc/passwd")
    os.mkfifo(root / "pipe")
    return root


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, root: Path) -> Iterator[Platform]:
    env = {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_EMBEDDER_SOURCE_ROOTS": str(root)}
    p = Platform(workdir=tmp_path_factory.mktemp("indexing"), workers=1, port_offset=PORT_OFFSET, env=env,
                 knowledge=True, cache=False, jobs=False)
    with p:  # started here, stopped after the module's tests
        yield p


def reindex(platform: Platform, source: str) -> embedder_pb2.ReindexResponse:
    with platform.internal_channel(platform.embedder_grpc) as ch:  # the operator's certificate: allowed to index
        return embedder_pb2_grpc.IndexerStub(ch).Reindex(
            embedder_pb2.ReindexRequest(tenant="acme", knowledge_base="handbook", source_uri=source), timeout=30)


@pytest.mark.parametrize("source, code", [
    ("/etc/passwd", grpc.StatusCode.PERMISSION_DENIED),
    ("/proc/self/environ", grpc.StatusCode.PERMISSION_DENIED),
    ("{root}/../../../etc/passwd", grpc.StatusCode.PERMISSION_DENIED),
    ("{root}/escape", grpc.StatusCode.PERMISSION_DENIED),
    ("{root}/pipe", grpc.StatusCode.INVALID_ARGUMENT),
    ("relative/path.md", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_source_outside_the_roots_or_not_a_regular_file_is_refused(platform: Platform, root: Path, source: str,
                                                                     code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as err:
        reindex(platform, source.format(root=root))
    assert err.value.code() == code, err.value.details()
    assert err.value.details(), "the refusal says why"


def test_a_file_inside_the_root_is_indexed(platform: Platform, root: Path) -> None:
    job = reindex(platform, str(root / "handbook.md"))
    assert job.job_id
