"""Rebuilding a gRPC method handler around a wrapper, for server interceptors.

Example::

    return rewrap(handler, unary=lambda fn: timed(fn), stream=lambda fn: timed_stream(fn))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

_UNARY = (("unary_unary", grpc.unary_unary_rpc_method_handler), ("stream_unary", grpc.stream_unary_rpc_method_handler))
_STREAM = (("unary_stream", grpc.unary_stream_rpc_method_handler),
           ("stream_stream", grpc.stream_stream_rpc_method_handler))


def rewrap(handler: grpc.RpcMethodHandler, *, unary: Wrap, stream: Wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped: ``unary`` for calls that return one response, ``stream`` for
    calls that yield responses (async generators)."""
    for kinds, wrap in ((_UNARY, unary), (_STREAM, stream)):
        for kind, factory in kinds:
            fn = getattr(handler, kind)
            if fn:
                return factory(wrap(fn), handler.request_deserializer, handler.response_serializer)
    return handler
