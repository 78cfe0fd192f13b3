"""GPU utilisation through NVML (nvidia-ml-py), when a GPU and the library are present; -1 otherwise."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

log = logging.getLogger("goodput.inference.gpu")


class GpuMonitor:
    """Average utilisation (0-1) over the visible GPUs, sampled at most once a second."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._last = (0.0, -1.0)
        with contextlib.suppress(Exception):  # no NVML library or no driver: a CPU worker
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def utilization(self) -> float:
        if not self._handles:
            return -1.0
        now = time.monotonic()
        if now - self._last[0] < 1.0:
            return self._last[1]
        try:
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            value = sum(rates) / len(rates) / 100.0
        except Exception:  # noqa: BLE001
            log.warning("NVML query failed", exc_info=True)
            value = -1.0
        self._last = (now, value)
        return value
