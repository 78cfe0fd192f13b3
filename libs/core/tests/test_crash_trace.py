"""A service process that dies in native code (a segfault in an extension) leaves its Python stacks in its log:
run_main turns on faulthandler, so the crash names where it happened instead of leaving only an exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_CRASHING_SERVICE = """
import ctypes
from goodput_core.server import run_main

def crash_in_native_code():
    ctypes.string_at(0)  # reads address 0: SIGSEGV in C, as a bug in an extension would

async def main():
    crash_in_native_code()

run_main(main)
"""


def test_a_native_crash_writes_the_python_stack_to_the_log() -> None:
    out = subprocess.run([sys.executable, "-c", _CRASHING_SERVICE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GOODPUT_EVENT_LOOP": "uvloop"})
    assert out.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert "crash_in_native_code" in out.stderr  # the frame it died in
