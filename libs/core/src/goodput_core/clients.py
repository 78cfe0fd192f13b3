"""gRPC channels to other Goodput services, with tracing, keepalive and sane message limits.

Example:
    >>> channel = make_channel("127.0.0.1:50052", provider)
    >>> stub = scheduler_pb2_grpc.SchedulerStub(channel)
"""

from __future__ import annotations

from typing import Any

from grpc import aio
from opentelemetry.sdk.trace import TracerProvider

from goodput_core.tracing import client_interceptors

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Reconnect quickly after a worker restarts, instead of the default exponential backoff up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]


def make_channel(address: str, provider: TracerProvider | None, *, traced: bool = True) -> aio.Channel:
    interceptors = client_interceptors(provider) if traced else []
    return aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
