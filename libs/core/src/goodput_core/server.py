"""The gRPC server bootstrap every service uses: ``grpc.aio`` with tracing, metrics and error-mapping interceptors,
the standard health service, reflection, an HTTP side port for `/metrics` and `/healthz`, and graceful drain on
SIGTERM/SIGINT (health turns NOT_SERVING, in-flight RPCs get ``drain_grace_s`` to finish).

Example::

    runner = ServiceRunner(name="scheduler", settings=settings, registry=registry, provider=provider)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "goodput.scheduler.v1.Scheduler")
    await runner.run()   # until SIGTERM
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
import uvicorn
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_core.authz import AuthzInterceptor
from goodput_core.errors import ErrorInterceptor
from goodput_core.metrics import GrpcServerMetrics, ops_app
from goodput_core.settings import ServiceSettings, env_prefix
from goodput_core.tls import server_credentials
from goodput_core.tracing import server_interceptor

log = logging.getLogger("goodput.server")

# Keepalive so that a vanished peer (crashed gateway, cut network) is noticed within seconds, which is what
# releases its leases and aborts its generations.
GRPC_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]

Hook = Callable[[], Coroutine[Any, Any, None]]


class ServiceRunner:
    """Owns one service's gRPC server, health state, HTTP side port and shutdown sequence.

    The gRPC server is internal unless ``public``: it serves mutual TLS (a client certificate from the platform's
    CA is required) and authorizes every call by the peer's identity (:class:`AuthzInterceptor`, the table of
    ``goodput_contracts.access`` under ``name``), or plaintext when the settings say ``insecure_internal``. A public
    server (the gateway's, which product teams call with API keys) is plaintext here; TLS for it ends at the
    ingress.
    """

    def __init__(self, *, name: str, settings: ServiceSettings, registry: CollectorRegistry,
                 provider: TracerProvider | None, interceptors: Sequence[aio.ServerInterceptor] = (),
                 http_app: Any = None, public: bool = False) -> None:
        self.name = name
        self.settings = settings
        self.registry = registry
        self.public = public
        self._credentials = None if public else server_credentials(settings, prefix=env_prefix(type(settings)))
        authz = [] if self._credentials is None else [AuthzInterceptor(name, registry)]
        self.server = aio.server(
            interceptors=[server_interceptor(provider), GrpcServerMetrics(registry), ErrorInterceptor(), *authz,
                          *interceptors],
            options=GRPC_SERVER_OPTIONS,
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self._http_app = http_app
        self._http_server: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._ready = False
        self._stop = asyncio.Event()
        self.on_drain: list[Hook] = []
        self.on_stop: list[Hook] = []
        self.grpc_port = 0

    def add(self, add_fn: Callable[[Any, aio.Server], None], servicer: Any, full_name: str) -> None:
        add_fn(servicer, self.server)
        self._service_names.append(full_name)

    @property
    def ready(self) -> bool:
        return self._ready

    async def set_serving(self, serving: bool) -> None:
        """Marks every service (and the overall "" entry) SERVING or NOT_SERVING."""
        self._ready = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ["", *self._service_names[1:]]:
            await self.health.set(svc, status)

    async def start(self, *, serving: bool = True) -> None:
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME], self.server)
        address = f"{self.settings.grpc_host}:{self.settings.grpc_port}"
        if self._credentials is not None:
            self.grpc_port = self.server.add_secure_port(address, self._credentials)
        else:
            self.grpc_port = self.server.add_insecure_port(address)
        if self.grpc_port == 0:
            raise RuntimeError(f"cannot bind gRPC port {address}")
        # Health first: a loading worker must never answer SERVING, not even for the first check.
        await self.set_serving(serving)
        await self.server.start()
        app = self._http_app or ops_app(self.registry, ready=lambda: self._ready)
        if self.settings.http_port or self._http_app is not None:
            config = uvicorn.Config(app, host=self.settings.grpc_host, port=self.settings.http_port,
                                    log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30)
            self._http_server = uvicorn.Server(config)
            # The runner owns SIGTERM/SIGINT (drain first); uvicorn must not install its own handlers.
            setattr(self._http_server, "install_signal_handlers", lambda: None)  # noqa: B010
            self._http_task = asyncio.create_task(self._http_server.serve())
        log.info("serving", extra={"grpc": address, "http_port": self.settings.http_port,
                                   "services": self._service_names})

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, serving: bool = True, after_start: Hook | None = None) -> None:
        """Starts (NOT_SERVING until ``after_start`` finishes when given), waits for SIGTERM/SIGINT, drains."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start(serving=serving and after_start is None)
        if after_start is not None:
            starter = asyncio.create_task(after_start())
            done, _ = await asyncio.wait([starter, asyncio.create_task(self._stop.wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            if starter in done:
                starter.result()
                await self.set_serving(True)
            else:
                starter.cancel()
        await self._stop.wait()
        await self.stop()

    async def stop(self) -> None:
        grace = self.settings.drain_grace_s
        log.info("draining", extra={"grace_s": grace})
        self._ready = False
        await self.health.enter_graceful_shutdown()
        for hook in self.on_drain:
            await hook()
        await self.server.stop(grace)
        if self._http_server is not None:
            self._http_server.should_exit = True
            if self._http_task is not None:
                await asyncio.wait([self._http_task], timeout=5)
        for hook in self.on_stop:
            await hook()
        log.info("stopped")


async def wait_channel_ready(channel: aio.Channel, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        return True
    except (asyncio.TimeoutError, grpc.RpcError):
        return False
