"""What CPU this process runs on, in the terms that change an engine's numerics.

vLLM's CPU kernels pick their code path from the instruction set: on an Intel Xeon with AMX, a bfloat16 model
runs the AMX attention kernels, on an AMD EPYC the AVX-512 or AVX2 ones, and a small model's greedy answer can
differ between them. Every worker logs and exports these facts at start, and every benchmark report names them,
so a number or an answer can always be traced to the machine that produced it.

Reads ``/proc/cpuinfo`` only (no torch import); holds no host name or path, so it can go into a report.

Example:
    >>> info = cpu_info()
    >>> sorted(info)
    ['amx', 'avx2', 'avx512', 'avx512_bf16', 'isa', 'model', 'vendor']
    >>> info["isa"] in ("amx", "avx512", "avx2", "other")
    True
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_info", "parse_cpuinfo"]

_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}


def parse_cpuinfo(text: str, *, machine: str = "") -> dict[str, str]:
    """The vendor, model and vector extensions described by the text of ``/proc/cpuinfo``.

    ``isa`` is the widest matrix/vector path present: ``amx`` (AMX tiles with bf16), ``avx512``, ``avx2`` or
    ``other``. The flags are ``"true"``/``"false"`` strings so they can be labels of an info metric.

    >>> sample = "vendor_id : AuthenticAMD\\nmodel name : AMD EPYC 9R14\\nflags : fpu avx2 avx512f avx512_bf16\\n"
    >>> parse_cpuinfo(sample)["isa"], parse_cpuinfo(sample)["vendor"], parse_cpuinfo(sample)["amx"]
    ('avx512', 'AMD', 'false')
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key not in fields:  # the first processor describes them all
            fields[key] = value.strip()
    flags = set(fields.get("flags", "").split())
    amx = {"amx_tile", "amx_bf16"} <= flags
    avx512 = "avx512f" in flags
    avx2 = "avx2" in flags
    isa = "amx" if amx else "avx512" if avx512 else "avx2" if avx2 else "other"
    vendor_id = fields.get("vendor_id", "")
    return {
        "vendor": _VENDORS.get(vendor_id, vendor_id or machine or "unknown"),
        "model": fields.get("model name", "") or machine or "unknown",
        "isa": isa,
        "amx": _flag(amx),
        "avx512": _flag(avx512),
        "avx512_bf16": _flag("avx512_bf16" in flags),
        "avx2": _flag(avx2),
    }


def cpu_info() -> dict[str, str]:
    """:func:`parse_cpuinfo` of this machine (the architecture's name where ``/proc/cpuinfo`` is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, machine=platform.machine())


def _flag(value: bool) -> str:
    return "true" if value else "false"
