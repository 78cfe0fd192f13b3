"""Rebuilding a gRPC method handler around a wrapper, for server interceptors.

Example::

    class Timing(WrappingInterceptor):
        def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            return rewrap(handler, unary=lambda fn: timed(fn), stream=lambda fn: timed_stream(fn))
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

_UNARY = (("unary_unary", grpc.unary_unary_rpc_method_handler), ("stream_unary", grpc.stream_unary_rpc_method_handler))
_STREAM = (("unary_stream", grpc.unary_stream_rpc_method_handler),
           ("stream_stream", grpc.stream_stream_rpc_method_handler))


class WrappingInterceptor(aio.ServerInterceptor):
    """A server interceptor that wraps the handler of every method the server has (:meth:`wrap`)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return handler if handler is None else self.wrap(handler, handler_call_details)

    @abc.abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler of the call ``details`` names (``details.method``: ``/package.Service/Method``; its metadata)
        with its behaviour wrapped (:func:`rewrap`)."""


def rewrap(handler: grpc.RpcMethodHandler, *, unary: Wrap, stream: Wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped: ``unary`` for calls that return one response, ``stream`` for
    calls that stream responses. ``stream`` always gets an async generator function: a handler that writes its
    responses with ``context.write`` instead of yielding them (the standard health service's ``Watch``) is adapted
    first, so a wrapper's ``async for`` does not break it."""
    for kinds, wrap in ((_UNARY, unary), (_STREAM, stream)):
        for kind, factory in kinds:
            fn = getattr(handler, kind)
            if fn:
                if kinds is _STREAM:
                    fn = as_async_generator(fn)
                return factory(wrap(fn), handler.request_deserializer, handler.response_serializer)
    return handler


def as_async_generator(fn: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    """A streaming handler as an async generator function, whether it yields its responses or writes them."""
    if inspect.isasyncgenfunction(fn):
        return fn

    async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
        result = fn(request, context)
        if inspect.isawaitable(result):  # it writes with context.write and returns when done
            await result
            return
        async for item in result:
            yield item
    return generator
