"""Size limits at the REST edge, applied before anything is parsed: the request head (request line and headers,
431) and the body (413), chunked bodies included. Both answer in OpenAI's error shape.

The body is read in the pieces the server hands over and reading stops as soon as the limit is passed, so a body
without a ``Content-Length`` (``Transfer-Encoding: chunked``) is never read to its end; a declared length above the
limit is refused before any of it is read.

Example:
    >>> import asyncio
    >>> async def pieces():
    ...     for _ in range(1000):
    ...         yield b"x" * 1024
    >>> asyncio.run(read_limited(pieces(), limit=4096))
    Traceback (most recent call last):
    goodput_gateway.limits.PayloadTooLarge: request body is larger than 4096 bytes
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from goodput_core.errors import GoodputError, InvalidArgument

__all__ = ["HeaderLimit", "HeadersTooLarge", "PayloadTooLarge", "read_limited"]


class PayloadTooLarge(GoodputError):
    """A request body or message above its limit (REST 413, gRPC RESOURCE_EXHAUSTED as gRPC itself says it)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413
    openai_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str = "request_too_large") -> None:
        super().__init__(message, param=param, code=code)


class HeadersTooLarge(PayloadTooLarge):
    http_status = 431

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_header_fields_too_large")


async def read_limited(chunks: AsyncIterator[bytes], *, limit: int, declared: str | None = None) -> bytes:
    """The body from ``chunks``, or PayloadTooLarge as soon as more than ``limit`` bytes came (or were declared by
    ``declared``, the Content-Length header, before any is read)."""
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidArgument("Content-Length is not a number", code="invalid_content_length")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class HeaderLimit:
    """ASGI middleware: a request whose head (method, path, query string and headers) is larger than ``max_bytes``
    is answered 431 before the app sees it. The HTTP server's own parser bounds what it buffers; this makes the
    limit exact and the answer OpenAI-shaped."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = len(scope.get("method", "")) + len(scope.get("raw_path") or scope.get("path", "")) \
                + len(scope.get("query_string", b"")) + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if size > self.max_bytes:
                err = HeadersTooLarge(f"request headers are larger than {self.max_bytes} bytes")
                body = json.dumps(err.openai_body()).encode()
                await send({"type": "http.response.start", "status": err.http_status,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
