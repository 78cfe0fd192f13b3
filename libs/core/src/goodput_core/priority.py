"""Priority classes P0 (most urgent) to P2 and their names in REST headers, API keys and metrics labels."""

from __future__ import annotations

from goodput.common.v1 import types_pb2

from goodput_core.errors import InvalidArgument

_BY_NAME: dict[str, int] = {"P0": types_pb2.PRIORITY_P0, "P1": types_pb2.PRIORITY_P1, "P2": types_pb2.PRIORITY_P2}
_NAMES: dict[int, str] = {v: k for k, v in _BY_NAME.items()}


def parse_priority(name: str) -> int:
    """'P0'/'p0'/'0' -> PRIORITY_P0. Anything else is InvalidArgument."""
    key = name.strip().upper()
    if key.isdigit():
        key = f"P{key}"
    try:
        return _BY_NAME[key]
    except KeyError:
        raise InvalidArgument(f"unknown priority {name!r}: use P0, P1 or P2", param="priority") from None


def priority_name(value: int) -> str:
    return _NAMES.get(value, "unspecified")


def more_urgent(a: int, b: int) -> bool:
    """True when class ``a`` is more urgent than ``b`` (P0 beats P1 beats P2)."""
    return a < b
