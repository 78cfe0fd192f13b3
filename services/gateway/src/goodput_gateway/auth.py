"""API keys and tenants: each key maps to a tenant, the most urgent priority it may use, its default priority, and
the limits that bound it; each tenant has limits of its own and a fair-share weight.

The keys file (``GOODPUT_GATEWAY_API_KEYS_FILE``, usually a mounted Secret) holds keys only as SHA-256 digests, so
the plain key never sits on disk; ``goodput keys create`` adds one and prints the key once. A key is found by its
digest in a dict (O(1)); timing tells an attacker nothing, since what is looked up is the digest of what they sent.
The file is re-read when it changes (:class:`KeysFileWatcher`): a rotated key stops working within
``api_keys_reload_s`` and no request in flight is touched (it holds its :class:`Principal`).

Example file::

    {"defaults": {"rpm": 600, "tpm": 200000, "max_concurrent": 32},
     "tenants": {"acme": {"rpm": 1200, "monthly_tokens": 50000000, "monthly_soft": 0.8, "weight": 2}},
     "keys": [{"id": "acme-ci", "key_sha256": "9f86...", "tenant": "acme", "max_priority": "P0",
               "default_priority": "P1", "rpm": 60}]}

Limits (0 = none): ``rpm`` requests per minute, ``tpm`` tokens per minute, ``max_concurrent`` streams at once,
``monthly_tokens`` a calendar month's tokens (UTC) with ``monthly_soft`` the share at which the soft threshold's
metric and alert fire. A tenant's limits are its entry's over ``defaults``; a key's own limits (any of the same
fields on the key) apply to that key in addition to its tenant's. ``weight`` (tenants only, default 1) is the
tenant's share of each class's queue at the scheduler. ``operator: true`` lets a key read every tenant's usage.

``storage`` (tenants and ``defaults`` only) bounds what a tenant keeps (:mod:`goodput_gateway.storage`): ``files``
and ``file_bytes``, ``batches`` and ``batch_lines``, ``jobs`` and ``job_bytes``, ``responses`` and
``response_bytes``, ``resume_streams``, ``feedback``; each field is the tenant's over ``defaults.storage`` over the
built-in defaults (:class:`goodput_gateway.storage.StorageQuota`), so a tenant nobody configured is bounded too;
0 = no limit.

    >>> store = ApiKeyStore(parse_keys_document("inline", {"tenants": {"acme": {"rpm": 10, "weight": 2}},
    ...     "keys": [{"id": "acme-ci", "key": "k-1", "tenant": "acme", "tpm": 1000}]}))
    >>> p = store.authenticate("Bearer k-1")
    >>> p.tenant, p.key_id, p.weight, p.tenant_quota.rpm, p.key_quota.tpm
    ('acme', 'acme-ci', 2.0, 10, 1000)
    >>> store = ApiKeyStore(parse_keys_document("inline", {"defaults": {"storage": {"files": 10}},
    ...     "tenants": {"acme": {"storage": {"file_bytes": 1000}}}, "keys": [{"key": "k-1", "tenant": "acme"}]}))
    >>> s = store.authenticate("Bearer k-1").storage
    >>> s.files, s.file_bytes, s.batches
    (10, 1000, 20)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from goodput_core.errors import PermissionDenied, Unauthenticated
from goodput_core.names import check_name
from goodput_core.periodic import Periodic
from goodput_core.priority import check_priority, more_urgent, parse_priority, priority_name

from goodput_gateway.storage import DEFAULT_STORAGE, StorageQuota

__all__ = ["ApiKeyStore", "KeysFileWatcher", "Principal", "Quota", "caller", "caller_var", "parse_keys_document",
           "sha256_hex"]

log = logging.getLogger("goodput.gateway.auth")


@dataclass(frozen=True)
class Quota:
    """Resolved limits of one scope (a tenant or a key); 0 = no limit."""

    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    monthly_tokens: int = 0
    monthly_soft: float = 0.8

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent or self.monthly_tokens)


NO_QUOTA = Quota()


@dataclass(frozen=True)
class Principal:
    tenant: str
    max_priority: int
    default_priority: int
    key_id: str = ""  # the key's id (never the key): "" for a principal not made from a key (a job stored without one)
    weight: float = 1.0  # the tenant's fair-share weight at the scheduler
    tenant_quota: Quota = field(default=NO_QUOTA)
    key_quota: Quota = field(default=NO_QUOTA)
    operator: bool = False  # may read every tenant's usage
    model_fallback: bool = False  # may be answered by a configured lighter model (MODEL_FALLBACKS)
    storage: StorageQuota = field(default=DEFAULT_STORAGE)  # the tenant's storage quotas

    def resolve_priority(self, requested: int) -> int:
        """The request's priority: the key's default when unset; InvalidArgument when it is not a defined class
        (``priority=4`` is not "less urgent than P2"); PermissionDenied above the allowance."""
        if check_priority(requested) == types_pb2.PRIORITY_UNSPECIFIED:
            return self.default_priority
        if more_urgent(requested, self.max_priority):
            raise PermissionDenied(f"priority {priority_name(requested)} is above this API key's allowance "
                                   f"({priority_name(self.max_priority)})", param="priority")
        return requested


caller_var: ContextVar[Principal | None] = ContextVar("goodput_caller", default=None)


def caller() -> Principal:
    """The principal the gRPC API's guard authenticated for the call being served
    (:class:`goodput_gateway.guard.PublicApiGuard`)."""
    principal = caller_var.get()
    if principal is None:
        raise Unauthenticated("the call was not authenticated", code="invalid_api_key")
    return principal


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# ---- the keys file's schema --------------------------------------------------------------------------------------

class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, ge=0, description="Requests per minute (0 = none).")
    tpm: int | None = Field(None, ge=0, description="Tokens per minute, prompt and completion (0 = none).")
    max_concurrent: int | None = Field(None, ge=0, description="Requests in flight at once (0 = none).")
    monthly_tokens: int | None = Field(None, ge=0, description="Tokens per calendar month, UTC (0 = none).")
    monthly_soft: float | None = Field(None, gt=0, le=1, description="Share of monthly_tokens at which the soft "
                                                                     "threshold's metric and alert fire.")


class _Storage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: int | None = Field(None, ge=0, description="Files kept (uploaded and results; 0 = no limit).")
    file_bytes: int | None = Field(None, ge=0, description="Their bytes together (one larger file is 413).")
    batches: int | None = Field(None, ge=0, description="Batches kept until they expire.")
    batch_lines: int | None = Field(None, ge=0, description="Their lines together.")
    jobs: int | None = Field(None, ge=0, description="Jobs kept (POST /v1/jobs, parked requests).")
    job_bytes: int | None = Field(None, ge=0, description="Their request bodies' bytes together.")
    responses: int | None = Field(None, ge=0, description="Stored Responses API responses.")
    response_bytes: int | None = Field(None, ge=0, description="Their bytes together.")
    resume_streams: int | None = Field(None, ge=0, description="Streams recorded for resume at once.")
    feedback: int | None = Field(None, ge=0, description="Answers kept for feedback.")


class _Tenant(_Limits):
    weight: float | None = Field(None, gt=0, le=1000, description="Fair-share weight in the scheduler's queues.")
    storage: _Storage | None = Field(None, description="What the tenant may keep (goodput_gateway.storage).")


class _Key(_Limits):
    id: str = Field("", description="The key's name in metrics, usage and logs; default: the first 12 hex digits of "
                                    "its digest.")
    tenant: str
    key_sha256: str = Field("", pattern=r"^([0-9a-fA-F]{64})?$")
    key: str = Field("", description="The plain key (tests and development only; production stores the digest).")
    max_priority: str = "P1"
    default_priority: str | None = None
    operator: bool = False
    model_fallback: bool = Field(False, description="This key's requests may be answered by the lighter model the "
                                                    "gateway's MODEL_FALLBACKS names when theirs is saturated or down.")

    # Tenant names and key ids become parts of Redis keys, metric labels and log fields: one pattern for both
    # (goodput_core.names), checked when the keys file is loaded
    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_name(value) if value else value  # empty: named after its digest


class _KeysDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    defaults: _Tenant = Field(default_factory=_Tenant)
    tenants: dict[str, _Tenant] = Field(default_factory=dict)
    keys: list[_Key] = Field(default_factory=list)

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, _Tenant]) -> dict[str, _Tenant]:
        for name in tenants:
            check_name(name)
        return tenants


def _quota(*layers: _Limits | None) -> Quota:
    """The first value set in ``layers`` for each limit (the most specific layer first)."""
    values: dict[str, Any] = {}
    for layer in reversed(layers):
        if layer is not None:
            values.update(layer.model_dump(include=set(_Limits.model_fields), exclude_none=True))
    return Quota(**values)


def _storage(*layers: _Tenant | None) -> StorageQuota:
    """Each storage limit from the most specific layer that sets it, else the built-in default."""
    values: dict[str, Any] = {}
    for layer in reversed(layers):
        if layer is not None and layer.storage is not None:
            values.update(layer.storage.model_dump(exclude_none=True))
    return dataclasses.replace(DEFAULT_STORAGE, **values)


def parse_keys_document(source: str, doc: Any) -> list[tuple[bytes, Principal]]:
    """The (digest, principal) entries of one keys document; ValueError naming ``source`` when it is invalid."""
    if isinstance(doc, list):  # the first version's bare list of keys
        doc = {"keys": doc}
    try:
        parsed = _KeysDocument.model_validate(doc)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: {where}: {first['msg']}") from None
    entries: list[tuple[bytes, Principal]] = []
    for i, item in enumerate(parsed.keys):
        digest = item.key_sha256.lower() or (sha256_hex(item.key) if item.key else "")
        if not digest:
            raise ValueError(f"{source}: key #{i} needs key_sha256 (64 hex chars) or key")
        try:
            max_p = parse_priority(item.max_priority)
            default_p = parse_priority(item.default_priority or priority_name(max_p))
        except ValueError as err:
            raise ValueError(f"{source}: key #{i}: {err}") from None
        if more_urgent(default_p, max_p):
            raise ValueError(f"{source}: key #{i} default_priority is above max_priority")
        tenant = parsed.tenants.get(item.tenant)
        weight = next((t.weight for t in (tenant, parsed.defaults) if t is not None and t.weight is not None), 1.0)
        entries.append((bytes.fromhex(digest), Principal(
            tenant=item.tenant, max_priority=max_p, default_priority=default_p, key_id=item.id or digest[:12],
            weight=float(weight), tenant_quota=_quota(tenant, parsed.defaults), key_quota=_quota(item),
            operator=item.operator, model_fallback=item.model_fallback, storage=_storage(tenant, parsed.defaults))))
    return entries


class ApiKeyStore:
    """The keys, by digest. :meth:`replace` swaps them all at once (a reload)."""

    _by_digest: dict[bytes, Principal]
    _storage: dict[str, StorageQuota]

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self.replace(entries)

    @classmethod
    def from_sources(cls, *, file: str = "", inline: str = "") -> ApiKeyStore:
        return cls(load_entries(file=file, inline=inline))

    def replace(self, entries: list[tuple[bytes, Principal]]) -> None:
        index: dict[bytes, Principal] = {}
        for digest, principal in entries:
            if digest in index:
                raise ValueError(f"the key of tenant {principal.tenant!r} ({principal.key_id}) is listed twice")
            index[digest] = principal
        self._by_digest = index
        self._storage = {p.tenant: p.storage for p in index.values()}

    def storage_of(self, tenant: str) -> StorageQuota:
        """The tenant's storage quotas (the built-in defaults for a tenant without a key)."""
        return self._storage.get(tenant, DEFAULT_STORAGE)

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_principal(self, tenant: str, *, priority: int) -> Principal:
        """The tenant's own principal (its limits and weight, no key's) at ``priority``, for work it submitted
        earlier that runs without a key (a job stored without the key that sent it); Unauthenticated once the tenant has
        no key any more."""
        for principal in self._by_digest.values():
            if principal.tenant == tenant:
                return Principal(tenant=tenant, max_priority=priority, default_priority=priority,
                                 weight=principal.weight, tenant_quota=principal.tenant_quota,
                                 storage=principal.storage)
        raise Unauthenticated(f"tenant {tenant!r} has no API key any more", code="invalid_api_key")

    def key_principal(self, key_id: str, *, tenant: str, priority: int) -> Principal:
        """The principal of the tenant's key ``key_id`` as the keys file says now (its limits and its tenant's) at
        ``priority``, for work the key submitted earlier (a job); Unauthenticated once the key is gone."""
        for principal in self._by_digest.values():
            if principal.key_id == key_id and principal.tenant == tenant:
                return dataclasses.replace(principal, max_priority=priority, default_priority=priority)
        raise Unauthenticated(f"the API key {key_id!r} that submitted this job was revoked", code="invalid_api_key")

    def authenticate(self, authorization: str | None) -> Principal:
        """From an `Authorization: Bearer <key>` value to the key's principal, or Unauthenticated."""
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed Authorization header: expected `Bearer <key>`", code="invalid_api_key")
        found = self._by_digest.get(hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).digest())
        if found is None:
            raise Unauthenticated("invalid API key", code="invalid_api_key")
        return found


def load_entries(*, file: str = "", inline: str = "") -> list[tuple[bytes, Principal]]:
    """The entries of the keys file and of the inline JSON (merged); ValueError or OSError when unreadable."""
    entries: list[tuple[bytes, Principal]] = []
    if file:
        entries += parse_keys_document(file, _json(file, Path(file).read_text(encoding="utf-8")))
    if inline.strip():
        entries += parse_keys_document("GOODPUT_GATEWAY_API_KEYS", _json("GOODPUT_GATEWAY_API_KEYS", inline))
    return entries


def _json(source: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON: {err}") from None


class KeysFileWatcher:
    """Re-reads the keys file when it changes (its size, mtime or inode: a Kubernetes Secret volume swaps a
    symlink), every ``interval_s``. A file that no longer parses keeps the keys in force, logged and counted."""

    def __init__(self, store: ApiKeyStore, *, file: str, inline: str = "", interval_s: float,
                 registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.file = file
        self.inline = inline
        self.interval_s = interval_s
        self._seen = self._stat()
        self._periodic = Periodic(lambda: asyncio.to_thread(self.check), interval_s=interval_s, name="keys-file")
        self.reloads = Counter("goodput_gateway_keys_reloads_total", "Keys file reloads, by result (ok, error).",
                               ["result"], registry=registry)
        self.keys = Gauge("goodput_gateway_api_keys", "API keys in force.", registry=registry)
        self.keys.set_function(lambda: len(self.store))

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.file)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self) -> bool:
        """Reloads if the file changed; True when the keys were replaced."""
        seen = self._stat()
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            self.store.replace(load_entries(file=self.file, inline=self.inline))
        except (OSError, ValueError) as err:
            self.reloads.labels("error").inc()
            log.error("keys file not reloaded; the keys in force stay", extra={"error": str(err)})
            return False
        self.reloads.labels("ok").inc()
        log.info("keys file reloaded", extra={"keys": len(self.store)})
        return True

    def start(self) -> None:
        if self.file and self.interval_s > 0:
            self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
