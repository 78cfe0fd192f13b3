"""The committed stubs must be exactly what `make protos` generates from protos/ (CI fails on drift)."""

from __future__ import annotations

import filecmp
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh, committed = tmp_path / "goodput", ROOT / "libs" / "protos" / "src" / "goodput"
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    committed_files = sorted(p.relative_to(committed) for p in committed.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts)
    assert fresh_files == committed_files, "stub files differ from protos/: run `make protos` and commit"
    drifted = [str(f) for f in fresh_files if not filecmp.cmp(fresh / f, committed / f, shallow=False)]
    assert not drifted, f"stale stubs (run `make protos` and commit): {drifted}"


def test_every_service_has_a_versioned_proto_and_typed_stubs() -> None:
    for svc, service_names in {"gateway": ["Gateway"], "scheduler": ["Scheduler"], "inference": ["Inference"],
                               "embedder": ["Embedding", "Indexer"], "retriever": ["Retrieval"],
                               "cache": ["Cache"]}.items():
        assert (ROOT / "protos" / "goodput" / svc / "v1" / f"{svc}.proto").is_file()
        module = importlib.import_module(f"goodput.{svc}.v1.{svc}_pb2")
        assert module.DESCRIPTOR.package == f"goodput.{svc}.v1"
        assert set(service_names) <= set(module.DESCRIPTOR.services_by_name)
        spec = importlib.util.find_spec(f"goodput.{svc}.v1.{svc}_pb2")
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).with_suffix(".pyi").is_file()
        assert (Path(spec.origin).parent / f"{svc}_pb2_grpc.pyi").is_file()


