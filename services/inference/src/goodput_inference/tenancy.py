"""Prefix-cache isolation between tenants: every prompt reaches the engine with a cache salt derived from its tenant.

vLLM's prefix cache reuses the KV blocks of any earlier prompt that starts the same way, and a reused prefix makes
the first token come sooner. Shared across tenants, that is a timing side channel: a tenant can tell whether
another tenant recently sent a given prompt (the class of CVE-2025-46570). vLLM mixes a request's ``cache_salt``
into the hash of its first block, so prompts with different salts never share a block.

The salt is a keyed hash (HMAC-SHA256) of the tenant, not its name: it shows up wherever the engine reports block
hashes (KV events, offloading connectors). Tenants that should share a cache (a team's several keys, one product's
tenants) are put in one sharing group (``cache_sharing_groups``); a group's tenants get the group's salt. A request
without a tenant is the anonymous tenant ``""``, salted like any other.

The key is ``cache_salt_key``; empty = a random key per process, which is enough while every engine's cache lives
and dies with its process. Set it (from a Secret, the same on every worker) when KV blocks outlive the process or
travel between engines (an offloading connector).

>>> salts = CacheSalts(key=b"k", groups={"partners": ["acme", "globex"]})
>>> salts.scope("acme"), salts.scope("globex"), salts.scope("initech")
('group:partners', 'group:partners', 'tenant:initech')
>>> salts.salt("acme") == salts.salt("globex") != salts.salt("initech")
True
>>> len(salts.salt("initech")), "initech" in salts.salt("initech")
(32, False)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from goodput_contracts.sharing import SharingGroups

if TYPE_CHECKING:
    from goodput_inference.config import InferenceSettings

__all__ = ["CacheSalts", "check_sharing_groups"]


def check_sharing_groups(groups: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Tenant -> group of a sharing-groups setting; a tenant in two groups, or an empty name, is a ValueError.

    >>> check_sharing_groups({"a": ["t1"], "b": ["t1"]})
    Traceback (most recent call last):
    ...
    ValueError: tenant 't1' is in two cache sharing groups ('a' and 'b')
    """
    return SharingGroups(groups).group_of


class CacheSalts:
    """The cache salt of each tenant: one per sharing group, else one per tenant."""

    def __init__(self, *, key: bytes | None = None, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self._key = key or secrets.token_bytes(32)
        self._group_of = check_sharing_groups(groups or {})
        self._memo: dict[str, str] = {}

    @classmethod
    def from_settings(cls, settings: InferenceSettings) -> CacheSalts:
        key = settings.cache_salt_key.get_secret_value().encode("utf-8")
        return cls(key=key or None, groups=settings.cache_sharing_groups)

    def scope(self, tenant: str) -> str:
        """What shares a cache with ``tenant``: its group, or the tenant alone (the two never collide)."""
        group = self._group_of.get(tenant)
        return f"group:{group}" if group is not None else f"tenant:{tenant}"

    def salt(self, tenant: str) -> str:
        found = self._memo.get(tenant)
        if found is None:
            found = hmac.new(self._key, self.scope(tenant).encode("utf-8", "surrogatepass"),
                             hashlib.sha256).hexdigest()[:32]
            if len(self._memo) < 65536:  # tenants are few; the bound only stops a flood of made-up names
                self._memo[tenant] = found
        return found
