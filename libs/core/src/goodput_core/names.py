"""The one pattern for the names an operator gives: tenants and API key ids. They become parts of Redis keys
(``<prefix>:<tenant>:<period>``), metric labels and log fields, so they may not hold the keys' separator ``:``,
spaces, slashes or anything a shell or a label would need quoted; and a name may not be a word the stores' own keys
use in its place (``<prefix>:tenants:<period>`` is the usage index, which a tenant named ``tenants`` would overwrite).

    >>> check_name("acme-prod.eu_1")
    'acme-prod.eu_1'
    >>> check_name("acme:usage")
    Traceback (most recent call last):
    ValueError: 'acme:usage' is not a name: 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit
    >>> check_name("tenants")
    Traceback (most recent call last):
    ValueError: 'tenants' is reserved (the stores' own keys use it)
"""

from __future__ import annotations

import re

__all__ = ["NAME_PATTERN", "RESERVED_NAMES", "check_name"]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RESERVED_NAMES = frozenset({"tenants"})
_NAME = re.compile(NAME_PATTERN)


def check_name(name: str) -> str:
    """``name`` when it matches :data:`NAME_PATTERN` and is not reserved, else ValueError saying why."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name[:64]!r} is not a name: 1 to 128 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit")
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved (the stores' own keys use it)")
    return name
