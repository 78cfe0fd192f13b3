"""The chart lints, renders and validates against the Kubernetes 1.30 schemas in every scenario."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "goodput"
K8S = REPO / "k8s"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
INSTALL_HINT = "run: PYTHON=<this python> bash scripts/install-k8s-tools.sh"

# Custom resources have no schema in kubernetes-validate; it warns and moves on. Only these may warn.
CUSTOM_KINDS = {"monitoring.coreos.com/v1": ("ServiceMonitor", "PrometheusRule"),
                "cert-manager.io/v1": ("Certificate", "Issuer")}
ALLOWED_WARNING = re.compile("|".join(
    r"^WARN .* Couldn't find schema for kind (%s) with api version %s " % ("|".join(kinds), re.escape(api))
    for api, kinds in CUSTOM_KINDS.items()))


def test_scenarios_exist() -> None:
    # CPU-only dev, single-GPU 7B, 14B on an A30, 72B with TP 2, autoscaling off, two and three model pools.
    assert {
        "two-pools-values.yaml",
        "three-pools-values.yaml",
        "cpu-dev-values.yaml",
        "gpu-7b-values.yaml",
        "gpu-14b-a30-values.yaml",
        "gpu-72b-tp2-values.yaml",
        "autoscaling-off-values.yaml",
    } <= set(SCENARIOS)


@pytest.mark.parametrize("values", [None, *SCENARIOS])
def test_helm_lint_strict(chart: Any, helm: str, values: str | None) -> None:
    cmd = [helm, "lint", "--strict", str(CHART)]
    if values:
        cmd += ["-f", str(CHART / "ci" / values)]
    proc = chart.run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _kubernetes_validate(chart: Any, files: list[Path]) -> None:
    proc = chart.run(
        [sys.executable, "-m", "kubernetes_validate", "-k", "1.30.0", "--strict", "--quiet", *map(str, files)]
    )
    if "No module named kubernetes_validate" in proc.stderr:
        pytest.fail(f"kubernetes-validate is not installed in {sys.executable}; {INSTALL_HINT}", pytrace=False)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    problems = [line for line in lines if not ALLOWED_WARNING.match(line)]
    assert proc.returncode == 0 and not problems, "\n".join(lines)


def test_rendered_manifests_validate_against_kubernetes_1_30(chart: Any, tmp_path: Path) -> None:
    files = []
    for values in [None, *SCENARIOS]:
        name = values or "default-values.yaml"
        out = tmp_path / name.replace("-values.yaml", ".rendered.yaml")
        out.write_text(chart.text(values))
        files.append(out)
    _kubernetes_validate(chart, files)


def test_cluster_prerequisites_validate(chart: Any) -> None:
    _kubernetes_validate(chart, [K8S / "priority-classes.yaml"])


def test_default_render_has_every_service(chart: Any) -> None:
    text = chart.text()
    for component in ("gateway", "scheduler", "inference", "embedder", "retriever", "cache", "indexing-worker",
                      "jobs-worker"):
        assert f"app.kubernetes.io/component: {component}" in text, component
