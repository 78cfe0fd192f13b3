"""A Goodput service as its own process on localhost (``python -m <module>`` with settings in its environment), its
output in a log file, stopped with SIGTERM then SIGKILL. For tests that need the real process boundary: gRPC between
processes, a scheduler that outlives or loses its peers, a worker killed mid-stream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from goodput_testing._ports import free_port

__all__ = ["ServiceProcess", "sim_worker_env"]


class ServiceProcess:
    def __init__(self, module: str, env: dict[str, str], log: Path) -> None:
        self.module = module
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env}, stdout=out,
                                         stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sim_worker_env(port: int, *, time_scale: float = 0.2, **settings: str) -> dict[str, str]:
    """The environment of an inference worker on the simulated engine (no model loads), plaintext, on ``port``;
    ``settings`` are more ``GOODPUT_INFERENCE_*`` settings by their short names (``MAX_NUM_SEQS="4"``)."""
    return {"GOODPUT_INFERENCE_ENGINE": "sim", "GOODPUT_INFERENCE_GRPC_PORT": str(port),
            "GOODPUT_INFERENCE_HTTP_PORT": str(free_port()), "GOODPUT_INFERENCE_INSECURE_INTERNAL": "true",
            "GOODPUT_INFERENCE_SIM_CONFIG": f'{{"time_scale": {time_scale}}}',
            **{f"GOODPUT_INFERENCE_{k}": v for k, v in settings.items()}}
