"""The public gRPC port's guard: the API key is checked before the request message is read, and the message's size
before it is parsed.

gRPC runs server interceptors when a call's metadata has arrived and before its message is received, but a unary
request is received and deserialised before the handler runs. So :class:`PublicApiGuard` hands gRPC a
request-streaming handler in its place: a call without a valid ``authorization`` is ended UNAUTHENTICATED without
its message being read at all (an unauthenticated caller costs the gateway its metadata, which gRPC bounds, and
what flow control lets in); an authenticated call's message is taken as raw bytes, refused RESOURCE_EXHAUSTED when
larger than ``max_message_bytes``, and only then parsed (INVALID_ARGUMENT when it cannot be, as when a string's bytes
are not UTF-8) and handed to the servicer, which sees the usual
(request, context) call, its caller's principal in :func:`goodput_gateway.auth.caller` (authenticated once, here).

What gRPC's transport receives before that is bounded by the server's ``grpc.max_receive_message_length``.

Example (the gateway's servers, :func:`goodput_gateway.__main__.build`)::

    runner = ServiceRunner(name="gateway", ..., interceptors=[PublicApiGuard(keys, max_message_bytes=4 << 20)])
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from goodput_core.context import tenant_id_var
from goodput_core.errors import GoodputError, InvalidArgument, abort_with
from goodput_core.handlers import WrappingInterceptor

from goodput_gateway.auth import ApiKeyStore, Principal, caller_var
from goodput_gateway.limits import PayloadTooLarge

__all__ = ["GUARDED_SERVICE", "PublicApiGuard"]

GUARDED_SERVICE = "goodput.gateway.v1.Gateway"  # every method needs an API key; health and reflection do not


def _authorization(details: grpc.HandlerCallDetails) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class PublicApiGuard(WrappingInterceptor):
    def __init__(self, keys: ApiKeyStore, *, max_message_bytes: int) -> None:
        self.keys = keys
        self.max_message_bytes = max_message_bytes

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if details.method.rpartition("/")[0].lstrip("/") != GUARDED_SERVICE:
            return handler
        try:
            principal = self.keys.authenticate(_authorization(details))
        except GoodputError as err:
            return _refusal(handler, err)
        if handler.request_streaming:  # the API has no request-streaming method
            return _refusal(handler, InvalidArgument("request streams are not served on the public API"))
        return self._bounded(handler, principal)

    def _bounded(self, handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
        """The same unary-request method, its message read as bytes and checked for size before it is parsed, run
        as ``principal``."""
        limit, parse = self.max_message_bytes, handler.request_deserializer

        async def message(requests: AsyncIterator[bytes]) -> Any:
            caller_var.set(principal)  # the handler runs in this task: the servicer reads it (auth.caller)
            tenant_id_var.set(principal.tenant)
            async for raw in requests:
                if len(raw) > limit:
                    raise PayloadTooLarge(f"request message is {len(raw)} bytes; the limit is {limit}")
                if parse is None:
                    return raw
                try:
                    return parse(raw)
                except DecodeError as err:  # e.g. a string field whose bytes are not UTF-8: it can never be served
                    raise InvalidArgument(f"request message cannot be parsed: {err}", code="invalid_message") from None
            raise InvalidArgument("the call carried no request message")

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream(requests: AsyncIterator[bytes], context: aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    request = await message(requests)
                except GoodputError as err:
                    await abort_with(context, err)
                    return
                async for item in inner_stream(request, context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream, None, handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary(requests: AsyncIterator[bytes], context: aio.ServicerContext) -> Any:
            try:
                request = await message(requests)
            except GoodputError as err:
                await abort_with(context, err)
                return None
            return await inner_unary(request, context)

        return grpc.stream_unary_rpc_method_handler(unary, None, handler.response_serializer)


def _refusal(handler: grpc.RpcMethodHandler, err: GoodputError) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``err`` and never reads its request."""
    if handler.response_streaming:
        async def refuse_stream(requests: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            await abort_with(context, err)
            yield  # pragma: no cover - abort raises

        return grpc.stream_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)

    async def refuse(requests: Any, context: aio.ServicerContext) -> Any:
        await abort_with(context, err)

    return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)
