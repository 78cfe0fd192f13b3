"""Fixtures of the chart tests: the tools, and a `chart` object that renders and parses the chart.

The tools come from scripts/install-k8s-tools.sh. A missing tool fails the test (with the command to
run), it never skips: a green run must mean the chart was actually checked. (The repository runs pytest
with --import-mode=importlib, so the test modules use fixtures rather than importing this file.)
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "goodput"
K8S = REPO / "k8s"
INSTALL_HINT = "run: PYTHON=<this python> bash scripts/install-k8s-tools.sh"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))


def _tool(name: str, local: Path | None = None) -> str:
    if local is not None and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found (looked in .tools/bin and on PATH); {INSTALL_HINT}", pytrace=False)
    return found


@pytest.fixture(scope="session")
def helm() -> str:
    return _tool("helm", REPO / ".tools" / "bin" / "helm")


@pytest.fixture(scope="session")
def promtool() -> str:
    return _tool("promtool")


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kwargs)


@functools.cache
def _render(helm: str, values: tuple[str, ...], sets: tuple[str, ...], set_json: tuple[str, ...] = ()) -> str:
    cmd = [helm, "template", "goodput", str(CHART), "--namespace", "goodput"]
    for v in values:
        cmd += ["-f", str(CHART / "ci" / v)]
    for s in sets:
        cmd += ["--set", s]
    for s in set_json:
        cmd += ["--set-json", s]
    proc = run(cmd)
    assert proc.returncode == 0, f"helm template failed for {values} {sets} {set_json}:\n{proc.stderr}"
    # The credentials Secret's passwords are random on every render (an install keeps its first ones): one fixed
    # stand-in, so that two renders of the same values compare equal.
    return _RANDOM.sub(r"\1cmFuZG9t", proc.stdout)


_RANDOM = re.compile(r"^(  (?:redis-[A-Za-z]+|jobs-mac-key): )\S+$", re.MULTILINE)


class Chart:
    """The goodput chart, rendered with `helm template` (release goodput, namespace goodput)."""

    path = CHART
    k8s = K8S
    scenarios = SCENARIOS
    install_hint = INSTALL_HINT

    def __init__(self, helm: str) -> None:
        self.helm = helm

    def text(self, *values: str | None, sets: tuple[str, ...] = (), set_json: tuple[str, ...] = ()) -> str:
        """The rendered YAML with the given ci/ values files (None entries are ignored), then `--set` and
        `--set-json` values (--set passes 0.5 as a string, which the schema refuses where it wants a number)."""
        return _render(self.helm, tuple(v for v in values if v), tuple(sets), tuple(set_json))

    def docs(self, *values: str | None, sets: tuple[str, ...] = (),
             set_json: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The rendered manifests as a list of dicts."""
        return [d for d in yaml.safe_load_all(self.text(*values, sets=sets, set_json=set_json)) if d]

    @staticmethod
    def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
        """Manifests of one kind, keyed by their app.kubernetes.io/component label; an inference pool's also as
        `inference-<pool>` (goodput.dev/pool), and `inference` is the first pool's."""
        out: dict[str, dict[str, Any]] = {}
        for d in docs:
            if d["kind"] == kind:
                labels = d["metadata"].get("labels", {})
                key = labels.get("app.kubernetes.io/component", d["metadata"]["name"])
                if "goodput.dev/pool" in labels:
                    out[f"{key}-{labels['goodput.dev/pool']}"] = d
                    out.setdefault(key, d)
                else:
                    out[key] = d
        return out

    run = staticmethod(run)


@pytest.fixture(scope="session")
def chart(helm: str) -> Chart:
    return Chart(helm)
