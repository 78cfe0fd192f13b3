"""Per-request context (request id, tenant id) carried in ``contextvars`` so logs and spans pick it up anywhere.

Example (inside the block, every log line and span carries ``request_id`` and ``tenant_id``):
    >>> with request_context(request_id="req-1", tenant="acme"):
    ...     request_id_var.get(), tenant_id_var.get()
    ('req-1', 'acme')
    >>> request_id_var.get() is None
    True
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from contextvars import ContextVar

request_id_var: ContextVar[str | None] = ContextVar("goodput_request_id", default=None)
tenant_id_var: ContextVar[str | None] = ContextVar("goodput_tenant_id", default=None)

REQUEST_ID_HEADER = "x-request-id"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


@contextlib.contextmanager
def request_context(*, request_id: str | None = None, tenant: str | None = None) -> Iterator[None]:
    tokens = []
    if request_id is not None:
        tokens.append((request_id_var, request_id_var.set(request_id)))
    if tenant is not None:
        tokens.append((tenant_id_var, tenant_id_var.set(tenant)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            try:
                var.reset(token)
            except ValueError:
                # An async generator (a streaming RPC) can be finalised in another task's context when its caller
                # goes away; that context never saw these values, so there is nothing to restore.
                pass
