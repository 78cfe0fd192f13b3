"""Domain errors and the one place that maps them to gRPC status codes and OpenAI-shaped REST errors.

Domain code raises these; gRPC servers map them with :class:`ErrorInterceptor`, REST handlers with
:meth:`GoodputError.openai_body`, and gRPC clients turn a downstream failure back into one with
:func:`from_rpc_error`, so an error keeps its meaning across every hop.

Example:
    >>> err = InvalidArgument("messages must not be empty", param="messages")
    >>> err.grpc_code, err.http_status
    (<StatusCode.INVALID_ARGUMENT: (3, 'invalid argument')>, 400)
    >>> err.openai_body()["error"]["param"], err.openai_body()["error"]["type"]
    ('messages', 'invalid_request_error')
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import grpc
from grpc import aio

from goodput_core.handlers import WrappingInterceptor, rewrap

RETRY_AFTER_KEY = "retry-after"
# The machine-readable code and the offending parameter travel in trailing metadata, so an error raised by a worker
# reaches the REST caller with the same `code` and `param` it had at its source.
ERROR_CODE_KEY = "goodput-error-code"
ERROR_PARAM_KEY = "goodput-error-param"


class GoodputError(Exception):
    """Base of every error a caller may see. Subclasses fix the gRPC code, HTTP status and OpenAI type."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        # More trailing metadata for the caller (e.g. the id of the job a shed request was parked as).
        self.extra_metadata: tuple[tuple[str, str], ...] = ()
        # Response headers for a REST caller (e.g. OpenAI's x-ratelimit-*); gRPC callers get them as trailing
        # metadata, their names lowercased.
        self.headers: dict[str, str] = {}

    def openai_body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API returns for an error."""
        return {"error": {"message": self.message, "type": self.openai_type, "param": self.param,
                          "code": self.code or self.grpc_code.name.lower()}}

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = []
        if self.retry_after_s is not None:
            md.append((RETRY_AFTER_KEY, f"{self.retry_after_s:.3f}"))
        if self.code:
            md.append((ERROR_CODE_KEY, self.code))
        if self.param:
            md.append((ERROR_PARAM_KEY, self.param))
        return (*md, *self.extra_metadata, *((k.lower(), v) for k, v in self.headers.items()))


class InvalidArgument(GoodputError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    openai_type = "invalid_request_error"


class FailedPrecondition(GoodputError):
    """A well-formed request the platform will not run as it is now (e.g. quarantined: it may crash a worker); 422,
    not 5xx, so that clients do not resend it on their own. ``retry_after_s`` says when it would be taken again."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 422
    openai_type = "invalid_request_error"


class Unauthenticated(GoodputError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    openai_type = "authentication_error"


class PermissionDenied(GoodputError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    openai_type = "permission_error"


class NotFound(GoodputError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    openai_type = "not_found_error"


class ResourceExhausted(GoodputError):
    """Shed or rate limited. ``retry_after_s`` says when trying again is likely to succeed."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    openai_type = "rate_limit_error"


class Unavailable(GoodputError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    openai_type = "server_error"


class DeadlineExceeded(GoodputError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    openai_type = "timeout_error"


class Cancelled(GoodputError):
    grpc_code = grpc.StatusCode.CANCELLED
    http_status = 499
    openai_type = "cancelled"


class Unimplemented(GoodputError):
    """The API exists but this deployment does not provide it (a feature not configured)."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501
    openai_type = "not_implemented"


class Internal(GoodputError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[GoodputError]] = {
    cls.grpc_code: cls
    for cls in (InvalidArgument, FailedPrecondition, Unauthenticated, PermissionDenied, NotFound, ResourceExhausted,
                Unavailable, DeadlineExceeded, Cancelled, Unimplemented)
}


def from_rpc_error(err: grpc.RpcError) -> GoodputError:
    """Turns a failed downstream gRPC call into the matching domain error (keeping retry-after)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    retry_after: float | None = None
    md = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else {}
    if RETRY_AFTER_KEY in md:
        try:
            retry_after = float(md[RETRY_AFTER_KEY])
        except (TypeError, ValueError):
            retry_after = None
    return from_status(code, details, retry_after_s=retry_after, code=_text(md.get(ERROR_CODE_KEY)),
                       param=_text(md.get(ERROR_PARAM_KEY)))


def from_status(status: grpc.StatusCode, message: str, *, code: str | None = None, param: str | None = None,
                retry_after_s: float | None = None) -> GoodputError:
    """The domain error of a gRPC status (an error carried in a message rather than ending a call).

    >>> err = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", code="overloaded", retry_after_s=2.0)
    >>> type(err).__name__, err.code, err.retry_after_s
    ('ResourceExhausted', 'overloaded', 2.0)
    """
    return _BY_CODE.get(status, Internal)(message, retry_after_s=retry_after_s, code=code, param=param)


def _text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


async def abort_with(context: aio.ServicerContext, err: GoodputError) -> None:
    """Ends the RPC with the error's status, message and trailing metadata."""
    if err.trailing_metadata():
        context.set_trailing_metadata(err.trailing_metadata())
    await context.abort(err.grpc_code, err.message)


class ErrorInterceptor(WrappingInterceptor):
    """Maps :class:`GoodputError` raised by any handler to its gRPC status (unary and streaming alike)."""

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return rewrap(handler, unary=_wrap_unary, stream=_wrap_stream)


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except GoodputError as err:
            await abort_with(context, err)
    return wrapper


def _wrap_stream(fn: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except GoodputError as err:
            await abort_with(context, err)
    return wrapper
