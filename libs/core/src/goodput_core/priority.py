"""Priority classes P0 (most urgent) to P2 and their names in REST headers, API keys and metrics labels.

Only the defined classes exist: a number the enum does not define (a proto3 enum field carries any int32, so a gRPC
caller can send ``priority=4`` or ``99``) is refused, never ranked by its value.

Example:
    >>> check_priority(types_pb2.PRIORITY_P2) == types_pb2.PRIORITY_P2
    True
    >>> check_priority(99)
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: undefined priority 99: use P0, P1 or P2 (or leave it unset)
"""

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
        raise InvalidArgument(f"unknown priority {name[:32]!r}: use P0, P1 or P2", param="priority",
                              code="invalid_value") from None


def check_priority(value: int) -> int:
    """``value`` when it is a defined class or PRIORITY_UNSPECIFIED; InvalidArgument (param ``priority``) otherwise."""
    if value != types_pb2.PRIORITY_UNSPECIFIED and value not in _NAMES:
        raise InvalidArgument(f"undefined priority {value}: use P0, P1 or P2 (or leave it unset)", param="priority",
                              code="invalid_value")
    return value


def priority_name(value: int) -> str:
    return _NAMES.get(value, "unspecified")


def more_urgent(a: int, b: int) -> bool:
    """True when class ``a`` is more urgent than ``b`` (P0 beats P1 beats P2). Both must be defined classes
    (:func:`check_priority`): an undefined value has no rank."""
    return a < b
