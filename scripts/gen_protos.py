"""Generate Python stubs (messages, gRPC services and their .pyi) for every proto under protos/.

Usage:
    python scripts/gen_protos.py            # writes libs/protos/src/goodput/...
    python scripts/gen_protos.py --out DIR  # writes elsewhere (the drift test compares the two)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
DEFAULT_OUT = ROOT / "libs" / "protos" / "src"


def generate(out: Path) -> list[Path]:
    files = sorted(PROTOS.rglob("*.proto"))
    if not files:
        raise SystemExit("no .proto files under protos/")
    pkg_root = out / "goodput"
    if pkg_root.exists():
        shutil.rmtree(pkg_root)
    out.mkdir(parents=True, exist_ok=True)
    plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={plugin}",
        f"--mypy_grpc_out={out}",
        *[str(f.relative_to(PROTOS)) for f in files],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Regular packages (with py.typed) so mypy and editable installs see them.
    for d in [pkg_root, *[p for p in pkg_root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    (pkg_root / "py.typed").touch()
    return sorted(p for p in pkg_root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = parser.parse_args()
    written = generate(ns.out)
    print(f"generated {len(written)} files under {ns.out / 'goodput'}")


if __name__ == "__main__":
    main()
