"""The quota store's epoch contract (goodput_gateway.quotas): a Redis string at ``<quota prefix>:epoch`` that every
admission names, so that a store that lost its counts is not taken for one whose budgets are unspent. Its value says
who wrote it: a gateway that found the store new (``g:``), a gateway that saw the store lose its counts (``lost:``
and the time), or an operator who accepted the counts as they stand (``op:``, written by ``goodput quotas
accept-loss``).

Example:
    >>> epoch_key("goodput:quota"), is_lost("lost:2026-12-07T10:00:00Z"), is_lost("op:1f2e"), epoch_text(None)
    ('goodput:quota:epoch', True, False, '')
"""

from __future__ import annotations

__all__ = ["DEFAULT_PREFIX", "GATEWAY", "LOST", "OPERATOR", "epoch_key", "epoch_text", "is_lost"]

DEFAULT_PREFIX = "goodput:quota"  # the gateway's QUOTAS__PREFIX default
GATEWAY, LOST, OPERATOR = "g:", "lost:", "op:"


def epoch_key(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}:epoch"


def epoch_text(raw: object) -> str:
    """The epoch as Redis returned it (bytes, or None where the store has none) as text ("" = none)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw or "")


def is_lost(epoch: str) -> bool:
    return epoch.startswith(LOST)
