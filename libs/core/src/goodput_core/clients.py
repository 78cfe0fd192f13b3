"""gRPC channels to other Goodput services, with tracing, keepalive and sane message limits, and the typed
clients several services share (:class:`EmbeddingClient`).

Example::

    channel = make_channel("127.0.0.1:50052", provider, credentials=channel_credentials(settings))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio
from opentelemetry.sdk.trace import TracerProvider

from goodput_core.errors import from_rpc_error
from goodput_core.tls import PLATFORM_NAME, ClientCertificates
from goodput_core.tracing import client_interceptors

__all__ = ["CHANNEL_OPTIONS", "GRPC_EXPERIMENTS", "EmbeddingClient", "Embeddings", "RenewingChannel",
           "make_channel"]

# gRPC's own experiments, as every service's process starts with them (the GRPC_EXPERIMENTS environment variable;
# gRPC reads it once, before the first channel or server, so the launchers set it: the images, the chart's
# common.grpcExperiments and the local supervisor; an environment that sets it wins). "-event_engine_client" gives
# client channels gRPC's classic TCP client instead of the EventEngine one: the thread that polls the completion
# queue reads the socket itself, one thread hand-off less per message received (the gateway receives every token
# from a worker). loadtests/reports/grpc-client-ab.md: 3-9% less gateway CPU per request, and 0.5-0.7 ms less added
# TTFT p50 at 128 streams (docs/operations.md, "Sizing the gateway").
GRPC_EXPERIMENTS = "-event_engine_client"
# How long a channel replaced by a renewed certificate (RenewingChannel) lets its calls in flight finish.
RETIRE_GRACE_S = 300.0

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


def replicated(address: str, service: str) -> tuple[str, list[tuple[str, Any]]]:
    """The target and channel options for a service run as replicas of which only some serve at a time (the
    scheduler's leader): ``address`` is one address, a comma-separated list of ``ip:port`` or a ``dns:///`` name
    resolving to every replica; the channel balances over the replicas whose gRPC health for ``service`` is SERVING
    (client-side health checking), so calls reach the leader and move with it when it changes.

    >>> replicated("127.0.0.1:50052,127.0.0.1:50152", "pkg.Svc")[0]
    'ipv4:127.0.0.1:50052,127.0.0.1:50152'
    """
    target = address
    if "," in address and "://" not in address and not address.startswith(("ipv4:", "ipv6:")):
        target = "ipv4:" + ",".join(a.strip() for a in address.split(",") if a.strip())
    config = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": service}}
    return target, [("grpc.service_config", json.dumps(config))]


def make_channel(address: str, provider: TracerProvider | None, *, traced: bool = True,
                 credentials: ClientCertificates | grpc.ChannelCredentials | None = None,
                 health_service: str = "") -> aio.Channel:
    """A channel to another Goodput service: mutual TLS with ``credentials`` (the caller's own certificate, from
    :func:`goodput_core.tls.channel_credentials`: the channel takes its renewed files without a restart), plaintext
    when they are None (``insecure_internal``). With ``health_service``, to the replicas of ``address`` that serve
    it (:func:`replicated`)."""
    interceptors = client_interceptors(provider) if traced else []
    extra: list[tuple[str, Any]] = []
    if health_service:
        address, extra = replicated(address, health_service)
    if credentials is None:
        return aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *extra], interceptors=interceptors)
    # Peers are dialled by address (a worker by its pod IP): the server's certificate is checked for the
    # platform's name instead (goodput_core.tls.PLATFORM_NAME), signed by the platform's CA.
    options = [*CHANNEL_OPTIONS, *extra, ("grpc.ssl_target_name_override", PLATFORM_NAME)]

    def secure(creds: grpc.ChannelCredentials) -> aio.Channel:
        return aio.secure_channel(address, creds, options=options, interceptors=interceptors)

    return RenewingChannel(credentials, secure) if isinstance(credentials, ClientCertificates) else secure(credentials)


class RenewingChannel(aio.Channel):
    """A channel whose certificate follows its files (:class:`goodput_core.tls.ClientCertificates`): gRPC fixes a
    channel's credentials when it is made, so once they were renewed the next call opens a new channel with them and
    the previous one closes after ``RETIRE_GRACE_S`` (its calls in flight finish; a stream still open then is cut,
    as when a peer restarts). Stubs made on it keep working: each call goes to the current channel."""

    def __init__(self, certificates: ClientCertificates, build: Callable[[grpc.ChannelCredentials], aio.Channel]):
        self._certificates, self._build = certificates, build
        self._generation, credentials = certificates.current()
        self._channel = build(credentials)
        self._retiring: dict[aio.Channel, asyncio.Task[None]] = {}

    def current(self) -> aio.Channel:
        generation, credentials = self._certificates.current()
        if generation != self._generation:
            old, self._channel, self._generation = self._channel, self._build(credentials), generation
            task = asyncio.get_running_loop().create_task(old.close(grace=RETIRE_GRACE_S))
            self._retiring[old] = task
            task.add_done_callback(lambda _: self._retiring.pop(old, None))
        return self._channel

    def _method(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        made: list[Any] = [None, None]  # the channel it was made on, the multicallable

        def call(*a: Any, **kw: Any) -> Any:
            channel = self.current()
            if made[0] is not channel:
                made[:] = [channel, getattr(channel, kind)(*args, **kwargs)]
            return made[1](*a, **kw)

        return call

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._method("unary_unary", *args, **kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._method("unary_stream", *args, **kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._method("stream_unary", *args, **kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._method("stream_stream", *args, **kwargs)

    async def close(self, grace: float | None = None) -> None:
        for old, task in list(self._retiring.items()):
            task.cancel()
            await old.close(grace)
        await self._channel.close(grace)

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()


@dataclass(frozen=True)
class Embeddings:
    """What the Embedding service answered: one unit-length vector per text, in order."""

    model: str
    vectors: list[list[float]]
    tokens: int


class EmbeddingClient:
    """The Embedding service (``goodput.embedder.v1.Embedding``), typed: texts in, vectors out.

    The one client of every caller (gateway, retriever, cache), so the request shape, the deadline and the error
    mapping are the same everywhere: a failed call raises the matching :class:`goodput_core.errors.GoodputError`.

    Example::

        client = EmbeddingClient(make_channel("127.0.0.1:50053", provider), timeout_s=2.0)
        (await client.embed(["how do I reset my password?"])).vectors[0][:2]   # [0.0123, -0.0456]
    """

    def __init__(self, channel: aio.Channel, *, timeout_s: float) -> None:
        from goodput.embedder.v1 import embedder_pb2_grpc

        self._stub = embedder_pb2_grpc.EmbeddingStub(channel)
        self.timeout_s = timeout_s

    async def embed(self, texts: Sequence[str], *, model: str = "", timeout_s: float | None = None) -> Embeddings:
        from goodput.embedder.v1 import embedder_pb2

        try:
            resp = await self._stub.Embed(embedder_pb2.EmbedRequest(texts=list(texts), model=model),
                                          timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return Embeddings(model=resp.model, vectors=[list(v.values) for v in resp.vectors], tokens=resp.tokens)

    async def describe(self, *, timeout_s: float | None = None) -> tuple[str, int]:
        """The served model's name and vector length."""
        from goodput.embedder.v1 import embedder_pb2

        try:
            resp = await self._stub.DescribeModel(embedder_pb2.DescribeModelRequest(),
                                                  timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return resp.name, resp.dimensions

    async def embed_one(self, text: str, *, timeout_s: float | None = None) -> list[float]:
        return (await self.embed([text], timeout_s=timeout_s)).vectors[0]
