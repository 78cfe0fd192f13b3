"""Features some scenarios need, detected in the code this checkout runs (the services run from the same tree).

A scenario whose feature is missing is reported "not available", never as a pass.

Example:
    >>> sorted(FEATURES)
    ['hung-engine-detection', 'stream-resume']
    >>> isinstance(available("stream-resume"), Feature)
    True
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FEATURES", "Feature", "available"]


@dataclass(frozen=True)
class Feature:
    name: str
    present: bool
    why: str  # what was found, or what is missing


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _fields(module: str, cls: str) -> set[str]:
    try:
        found = getattr(importlib.import_module(module), cls)
        return set(found.model_fields)
    except Exception:  # noqa: BLE001 - a settings class that does not import is a feature that is not there
        return set()


def _stream_resume() -> Feature:
    """The gateway numbers a stream's events and lets a client that reconnects with Last-Event-ID get the rest
    (``goodput_gateway.resume``, ``RESUME__WINDOW_S``)."""
    module, setting = _has("goodput_gateway.resume"), "resume" in _fields("goodput_gateway.config",
                                                                                     "GatewaySettings")
    if module and setting:
        return Feature("stream-resume", True, "goodput_gateway.resume and GOODPUT_GATEWAY_RESUME__WINDOW_S")
    missing = [what for what, ok in (("goodput_gateway.resume", module), ("RESUME__WINDOW_S", setting)) if not ok]
    return Feature("stream-resume", False, f"the gateway has no stream resume yet (missing: {', '.join(missing)})")


def _hung_engine_detection() -> Feature:
    """A worker notices its engine making no progress (``goodput_inference.progress``, ``STALL_AFTER_S``) and turns
    NOT_SERVING, so the scheduler places nothing there."""
    module = _has("goodput_inference.progress")
    setting = "stall_after_s" in _fields("goodput_inference.config", "InferenceSettings")
    if module and setting:
        return Feature("hung-engine-detection", True, "goodput_inference.progress and STALL_AFTER_S")
    missing = [what for what, ok in (("goodput_inference.progress", module), ("STALL_AFTER_S", setting)) if not ok]
    return Feature("hung-engine-detection", False,
                   f"no detection of a hung engine yet (missing: {', '.join(missing)})")


FEATURES: dict[str, Callable[[], Feature]] = {"stream-resume": _stream_resume,
                                              "hung-engine-detection": _hung_engine_detection}


def available(name: str) -> Feature:
    return FEATURES[name]()
