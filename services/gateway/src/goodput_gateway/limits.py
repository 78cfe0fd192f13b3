"""Limits at the REST edge, applied before anything is parsed: the request head (request line and headers, 431) and
the body (413), chunked bodies included; then what a body's JSON may be (:func:`load_json`: nesting depth, text
that is Unicode). All answer in OpenAI's error shape.

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
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc

from goodput_core.errors import GoodputError, InvalidArgument

__all__ = ["HeaderLimit", "HeadersTooLarge", "PayloadTooLarge", "load_json", "read_limited"]


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


_SURROGATE = re.compile("[\ud800-\udfff]")


def load_json(raw: bytes, *, max_depth: int, what: str = "request body") -> Any:
    """``raw`` as JSON a request can be made of, or InvalidArgument naming the field: UTF-8, JSON, nested at most
    ``max_depth`` arrays and objects deep, and every string (keys too) Unicode text. JSON's ``\\ud800`` escapes
    decode to lone surrogates, which no encoder downstream accepts (protobuf, Redis, the tokenizer), so such a
    request could never succeed: it is refused here rather than failing, or being retried, later.

    >>> load_json(b'{"messages": [{"content": "a\\\\ud800b"}]}', max_depth=8)
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: messages[0].content is not Unicode text: it holds a lone surrogate (U+D800)
    >>> load_json(b'{"a": [[[1]]]}', max_depth=3)
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: a[0][0] nests deeper than 3 levels of arrays and objects
    >>> load_json(b'{"a": [[1]]}', max_depth=3)
    {'a': [[1]]}
    """
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidArgument(f"{what} is not valid UTF-8 (byte {err.start})", code="invalid_encoding") from None
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"{what} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
                              code="invalid_json") from None
    except RecursionError:  # deeper than the interpreter's own bound, far past any max_depth
        raise InvalidArgument(f"{what} nests deeper than {max_depth} levels of arrays and objects",
                              code="json_too_deep") from None
    _check_json(value, max_depth)
    return value


def _lone_surrogate(text: str) -> str:
    """Why ``text`` is not Unicode text, or "" when it is."""
    bad = None if text.isascii() else _SURROGATE.search(text)
    return f"it holds a lone surrogate (U+{ord(bad.group()):04X})" if bad else ""


def _check_json(value: Any, max_depth: int) -> None:
    # Depth-first without recursion; each entry keeps its parent and key, so a path is only built for an error.
    Entry = tuple[Any, int, Any, "str | int | None"]
    stack: list[Entry] = [(value, 1, None, None)]

    def path(entry: Entry) -> str:
        keys: list[str | int] = []
        while entry[2] is not None:
            keys.append(entry[3])  # type: ignore[arg-type]
            entry = entry[2]
        return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)).lstrip(".") or "body"

    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if isinstance(item, str):
            if why := _lone_surrogate(item):
                where = path(entry)
                raise InvalidArgument(f"{where} is not Unicode text: {why}", param=where, code="invalid_encoding")
        elif isinstance(item, dict | list):
            if depth > max_depth:
                where = path(entry)
                raise InvalidArgument(f"{where} nests deeper than {max_depth} levels of arrays and objects",
                                      param=where, code="json_too_deep")
            if isinstance(item, list):
                stack.extend((child, depth + 1, entry, i) for i, child in enumerate(item))
                continue
            for key, child in item.items():
                if why := _lone_surrogate(key):  # checked before the key can be part of a path
                    where = path(entry)
                    raise InvalidArgument(f"a key of {where} is not Unicode text: {why}", param=where,
                                          code="invalid_encoding")
                stack.append((child, depth + 1, entry, key))


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
