"""Authorization by service identity: one server interceptor that reads the caller's identity from the mutual-TLS
auth context and checks it against the service's table in :mod:`goodput_contracts.access`.

A call without an identity (no certificate reached the handler) gets UNAUTHENTICATED; a peer the table does not
allow on the method, or one not allowed to name the request's tenant, gets PERMISSION_DENIED. Each refusal counts
in ``goodput_authz_denied_total{service,method,peer,reason}`` (reason: ``no_identity``, ``not_allowed``,
``tenant``) and is logged. A peer without a valid certificate never gets this far: the TLS handshake refuses it.

Example::

    runner = ServiceRunner(name="scheduler", ...)   # adds AuthzInterceptor("scheduler", registry) under mTLS
    peer_identity(context)                          # 'gateway', inside a handler
"""

from __future__ import annotations

import ipaddress
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from goodput_contracts.access import ACCESS, OPEN_SERVICES, Rule
from goodput_core.handlers import WrappingInterceptor, rewrap
from goodput_core.tls import DEFAULT_PREFIX, identity_in

__all__ = ["AuthzInterceptor", "normal_ip", "peer_identity", "peer_ip", "tenant_of"]

log = logging.getLogger("goodput.authz")


def peer_identity(context: aio.ServicerContext, prefix: str = DEFAULT_PREFIX) -> str | None:
    """The caller's Goodput identity from its verified certificate: its URI SAN under ``prefix`` (this release's,
    :func:`goodput_core.tls.identity_prefix`); None on a plaintext call or for a certificate naming no identity
    here (another release's or trust domain's, or a common name only).

    >>> class Ctx:
    ...     def auth_context(self): return {"peer_spiffe_id": [b"spiffe://goodput/default/gateway"]}
    >>> peer_identity(Ctx()), peer_identity(Ctx(), "spiffe://goodput/staging/")
    ('gateway', None)
    """
    auth = context.auth_context() or {}
    return identity_in((value.decode(errors="replace") for key in ("peer_spiffe_id", "peer_uri")
                        for value in auth.get(key, [])), prefix)


def peer_ip(context: aio.ServicerContext) -> str:
    """The address the caller connects from ("" when not over IP), IPv4-mapped IPv6 as IPv4.

    >>> class Ctx:
    ...     def __init__(self, peer): self._peer = peer
    ...     def peer(self): return self._peer
    >>> peer_ip(Ctx("ipv4:10.1.2.3:41234")), peer_ip(Ctx("ipv6:%5B::ffff:10.1.2.3%5D:5")), peer_ip(Ctx("unix:/s"))
    ('10.1.2.3', '10.1.2.3', '')
    """
    scheme, _, rest = urllib.parse.unquote(context.peer() or "").partition(":")
    return normal_ip(rest.rpartition(":")[0]) if scheme in ("ipv4", "ipv6") else ""


def normal_ip(text: str) -> str:
    """``text`` as an IP address in one spelling (brackets and a zone dropped, IPv4-mapped IPv6 as IPv4); "" when
    it is not one.

    >>> normal_ip("[::ffff:10.1.2.3]"), normal_ip("fe80::1%eth0"), normal_ip("worker-0")
    ('10.1.2.3', 'fe80::1', '')
    """
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return ""
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def tenant_of(request: Any, path: str) -> str:
    """The tenant a request names at ``path`` (``key.tenant``); empty when it names none.

    >>> from goodput.cache.v1 import cache_pb2
    >>> tenant_of(cache_pb2.LookupRequest(key=cache_pb2.CacheKeyParts(tenant="acme")), "key.tenant")
    'acme'
    """
    value: Any = request
    for part in path.split("."):
        value = getattr(value, part, "")
    return value if isinstance(value, str) else ""


class AuthzInterceptor(WrappingInterceptor):
    """Refuses every call whose peer identity the service's table does not allow (default deny)."""

    def __init__(self, service: str, registry: CollectorRegistry, *,
                 table: Mapping[str, Rule] | None = None, prefix: str = DEFAULT_PREFIX) -> None:
        self.service = service
        self.prefix = prefix
        self.table: Mapping[str, Rule] = ACCESS.get(service, {}) if table is None else table
        self.denied = Counter("goodput_authz_denied_total", "Internal gRPC calls refused by identity.",
                              ["service", "method", "peer", "reason"], registry=registry)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = details.method
        service = method.lstrip("/").split("/", 1)[0]
        rule = None if service in OPEN_SERVICES else self.table.get(method)
        check_tenant = rule is not None and bool(rule.tenant_field) and not handler.request_streaming
        open_ = service in OPEN_SERVICES

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: aio.ServicerContext) -> Any:
                await self._refusal(request, context, method, rule, open_=open_, check_tenant=check_tenant)
                return await fn(request, context)
            return call

        def stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
                await self._refusal(request, context, method, rule, open_=open_, check_tenant=check_tenant)
                async for item in fn(request, context):
                    yield item
            return call

        return rewrap(handler, unary=unary, stream=stream)

    async def _refusal(self, request: Any, context: aio.ServicerContext, method: str, rule: Rule | None, *,
                       open_: bool, check_tenant: bool) -> None:
        peer = peer_identity(context, self.prefix)
        if peer is None:
            await self._deny(context, method, "", "no_identity", grpc.StatusCode.UNAUTHENTICATED,
                             f"a client certificate naming an identity under {self.prefix} is required")
            return
        if open_:
            return
        if rule is None or peer not in rule.callers:
            await self._deny(context, method, peer, "not_allowed", grpc.StatusCode.PERMISSION_DENIED,
                             f"{peer} may not call {method} on {self.service}")
            return
        if check_tenant and rule is not None and peer not in rule.tenant_from and tenant_of(request,
                                                                                          rule.tenant_field):
            await self._deny(context, method, peer, "tenant", grpc.StatusCode.PERMISSION_DENIED,
                             f"{peer} may not act for a tenant on {method}")

    async def _deny(self, context: aio.ServicerContext, method: str, peer: str, reason: str,
                    code: grpc.StatusCode, message: str) -> None:
        self.denied.labels(self.service, method.rsplit("/", 1)[-1], peer or "none", reason).inc()
        log.warning("call refused", extra={"method": method, "peer": peer or None, "reason": reason,
                                           "address": context.peer()})
        await context.abort(code, message)
