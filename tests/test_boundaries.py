"""Service boundaries: no service's package is imported by another service or by a lib.

Services talk over gRPC; what two of them share lives in libs/ (a service's own tests may still start another
service in-process, so tests/ folders are not scanned). Starting a service as a process by its module name (the
supervisor's ``python -m goodput_x``, Celery's ``-A goodput_x.jobs``) is not an import and is not flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = {"goodput_gateway", "goodput_scheduler", "goodput_inference", "goodput_embedder",
                    "goodput_retriever", "goodput_cache"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def offenders() -> list[str]:
    found = []
    for src in sorted([*REPO.glob("services/*/src"), *REPO.glob("libs/*/src")]):
        owner = f"goodput_{src.parent.name}" if src.parent.parent.name == "services" else None
        for path in sorted(src.rglob("*.py")):
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top in SERVICE_PACKAGES and top != owner:
                    found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return found


def test_no_service_package_is_imported_by_another_service_or_a_lib() -> None:
    assert offenders() == []


def test_the_scan_sees_imports_in_every_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import goodput_cache.keys\nfrom goodput_embedder import models\n"
                     "def f():\n    from goodput_gateway.jobs import x\n"
                     "importlib.import_module('goodput_scheduler.config')\n")
    assert [m for _, m in _imports(probe)] == ["goodput_cache.keys", "goodput_embedder", "goodput_gateway.jobs",
                                              "goodput_scheduler.config"]
