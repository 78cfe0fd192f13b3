"""Cache sharing groups: the tenants whose prompts may reuse each other's cached prefixes.

The inference workers salt each prompt's prefix cache by its scope, and the scheduler keys prefix and session
affinity by the same scope, so both read one setting (``CACHE_SHARING_GROUPS``) through this module: a JSON object
``{"group": ["tenant-a", "tenant-b"]}``. A tenant in no group is its own scope; group and tenant scopes never
collide, whatever the names.

>>> groups = SharingGroups(parse_sharing_groups('{"partners": ["acme", "globex"]}'))
>>> groups.scope("acme"), groups.scope("globex"), groups.scope("initech"), groups.scope("partners")
('group:partners', 'group:partners', 'tenant:initech', 'tenant:partners')
>>> SharingGroups({"a": ["t1"], "b": ["t1"]})
Traceback (most recent call last):
...
ValueError: tenant 't1' is in two cache sharing groups ('a' and 'b')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SharingGroups", "parse_sharing_groups"]


def parse_sharing_groups(value: Any) -> Any:
    """The setting as a mapping: a JSON string is decoded (empty = no groups); anything else is returned as is."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else {}
    return value


class SharingGroups:
    """Tenant -> group of a sharing-groups setting; a tenant in two groups, an unnamed group or a group given as a
    string is a ValueError (refused at start)."""

    def __init__(self, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self.group_of: dict[str, str] = {}
        for group, tenants in (groups or {}).items():
            if not group:
                raise ValueError("a cache sharing group needs a name")
            if isinstance(tenants, str):
                raise ValueError(f"cache sharing group {group!r}: a list of tenants, not a string")
            for tenant in tenants:
                if self.group_of.setdefault(tenant, group) != group:
                    raise ValueError(f"tenant {tenant!r} is in two cache sharing groups "
                                     f"({self.group_of[tenant]!r} and {group!r})")

    def scope(self, tenant: str) -> str:
        group = self.group_of.get(tenant)
        return f"group:{group}" if group is not None else f"tenant:{tenant}"
