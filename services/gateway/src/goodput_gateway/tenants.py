"""Which tenants get a Prometheus label of their own: the label's values must stay few (a setting), or one tenant
per time series would grow without bound as tenants are added.

    >>> TenantLabels("acme, globex")("acme"), TenantLabels("acme")("initech"), TenantLabels("*")("initech")
    ('acme', 'other', 'initech')
    >>> TenantLabels("")("acme")
    'other'
"""

from __future__ import annotations

__all__ = ["OTHER", "TenantLabels"]

OTHER = "other"


class TenantLabels:
    """``spec``: "" (every tenant is "other"), "*" (every tenant its own label), or a comma-separated list."""

    def __init__(self, spec: str) -> None:
        names = {n.strip() for n in spec.split(",") if n.strip()}
        self.all = "*" in names
        self.names = frozenset(names - {"*"})

    def __call__(self, tenant: str) -> str:
        return tenant if tenant and (self.all or tenant in self.names) else OTHER
