"""The gRPC server bootstrap every service uses: ``grpc.aio`` with tracing, metrics and error-mapping interceptors,
the standard health service, reflection, an HTTP side port for `/metrics` and `/healthz` (or the service's own
HTTP app, with `/metrics` on ``metrics_port`` when that is set), and graceful drain on SIGTERM/SIGINT: health and
`/healthz` turn NOT_SERVING at once, new RPCs and HTTP requests are refused (UNAVAILABLE, 503), the gRPC calls and
HTTP requests (streams included) in flight get ``drain_grace_s`` to finish, and only then do the ``on_stop`` hooks
close what the service dials, so an answer in flight is never cut by its own upstream channel closing.

Example::

    runner = ServiceRunner(name="scheduler", settings=settings, registry=registry, provider=provider)
    runner.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "goodput.scheduler.v1.Scheduler")
    await runner.run()   # until SIGTERM
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import uvicorn
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Gauge

from goodput_core.authz import AuthzInterceptor
from goodput_core.errors import ErrorInterceptor
from goodput_core.metrics import GrpcServerMetrics, ops_app
from goodput_core.settings import ServiceSettings
from goodput_core.tls import channel_credentials, identity_prefix, server_certificates
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

# After the drain, how long uvicorn may take to close connections that are left (idle keep-alives, a client
# that does not read its last bytes) before their tasks are cancelled.
HTTP_CLOSE_S = 5


class DrainGate:
    """ASGI middleware around a service's HTTP app: counts the requests in flight (a streamed response counts
    until its last byte), and once :meth:`close` is called answers new requests 503 (``/healthz`` and
    ``/metrics`` still pass, so probes see NOT_SERVING and the last scrape works) while those in flight finish.

    Example::

        gate = DrainGate(app)
        ...
        gate.close()
        await gate.idle(timeout_s=30)   # True when every request in flight has finished
    """

    PASS = ("/healthz", "/health", "/metrics")

    def __init__(self, app: Any) -> None:
        self.app = app
        self.closed = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closed and scope.get("path") not in self.PASS:
            body = b'{"error":{"message":"the server is shutting down; retry on another replica",' \
                   b'"type":"server_error","param":null,"code":"unavailable"}}'
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self._inflight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        self.closed = True

    async def idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
            return True
        except asyncio.TimeoutError:
            return False


class _HttpServer(uvicorn.Server):
    """uvicorn without its signal handlers: the runner owns SIGTERM/SIGINT and stops the HTTP servers after the
    drain. (uvicorn's own handler would start its shutdown on the same signal, cutting streams in flight after its
    graceful-shutdown timeout, whatever the drain grace.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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
                 http_app: Any = None, public: bool = False, grpc_options: Sequence[tuple[str, Any]] = (),
                 http_options: dict[str, Any] | None = None) -> None:
        self.name = name
        self.settings = settings
        self.registry = registry
        self.public = public
        self.certificates = None if public else server_certificates(settings)
        self._credentials = None if self.certificates is None else self.certificates.credentials()
        authz = [] if self._credentials is None else [
            AuthzInterceptor(name, registry, prefix=identity_prefix(settings))]
        dial = None if settings.insecure_internal else channel_credentials(settings)
        if dial is not None:
            expiry = Gauge("goodput_tls_certificate_expiry_timestamp_seconds", "When the certificate this process "
                           "uses ends (Unix time): use=serve, the one its server presents; use=dial, the one its "
                           "channels dial with (both follow the files when they are renewed).", ["use"],
                           registry=registry)
            expiry.labels("dial").set_function(dial.expiry)
            if (certificates := self.certificates) is not None:
                expiry.labels("serve").set_function(lambda: certificates.not_after)
        self.server = aio.server(
            interceptors=[server_interceptor(provider), GrpcServerMetrics(registry), ErrorInterceptor(), *authz,
                          *interceptors],
            # A service's own options (e.g. a smaller receive limit on a public port) override the defaults.
            options=[*(o for o in GRPC_SERVER_OPTIONS if o[0] not in dict(grpc_options)), *grpc_options],
        )
        self._http_options = dict(http_options or {})
        self.health = HealthServicer()
        self._gates: dict[str, bool] = {}
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self.http_app = http_app
        self._http_servers: list[uvicorn.Server] = []
        self._http_tasks: list[asyncio.Task[None]] = []
        self._gate: DrainGate | None = None
        self._ready = False
        self._stop = asyncio.Event()
        self.on_start: list[Hook] = []  # once serving (background work such as store readings)
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
        """Marks every service (and the overall "" entry) SERVING or NOT_SERVING; a gated service (:meth:`set_gate`)
        is SERVING only while its gate is open too."""
        self._ready = serving
        for svc in ["", *self._service_names[1:]]:
            await self.health.set(svc, _status(serving and self._gates.get(svc, True)))

    async def set_gate(self, service: str, open_: bool) -> None:
        """One service's health also follows a condition of its own (the scheduler's leadership): while closed it is
        NOT_SERVING, which gRPC clients checking its health see at once (they then call only a replica where it is
        open); the process itself stays SERVING ("" entry) for probes."""
        self._gates[service] = open_
        await self.health.set(service, _status(self._ready and open_))

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
        ops = ops_app(self.registry, ready=lambda: self._ready)
        metrics_port = self.settings.metrics_port
        if self.http_app is not None:
            self._gate = DrainGate(self.http_app)
            self._serve_http(self._gate, self.settings.http_port)
        elif self.settings.http_port:
            self._serve_http(ops, self.settings.http_port)
        if metrics_port and metrics_port != self.settings.http_port:
            self._serve_http(ops, metrics_port)
        await self._http_bound()
        for hook in self.on_start:
            await hook()
        if _owns_process and serving:  # a service's own process (run_main), not a test's in-process service;
            tune_gc()  # one still starting (run's after_start) is tuned once that is done
        log.info("serving", extra={"grpc": address, "http_port": self.settings.http_port,
                                   "metrics_port": metrics_port or self.settings.http_port,
                                   "services": self._service_names})

    async def _http_bound(self) -> None:
        """Returns once every HTTP server listens (a port that cannot be bound fails the start)."""
        while not all(server.started for server in self._http_servers):
            for task in self._http_tasks:
                if task.done():
                    task.result()
                    raise RuntimeError("an HTTP server stopped while starting (is its port free?)")
            await asyncio.sleep(0.01)

    def _serve_http(self, app: Any, port: int) -> None:
        config = uvicorn.Config(app, host=self.settings.grpc_host, port=port, log_config=None, access_log=False,
                                lifespan="off", timeout_keep_alive=30, timeout_graceful_shutdown=HTTP_CLOSE_S,
                                **self._http_options)
        server = _HttpServer(config)
        self._http_servers.append(server)
        self._http_tasks.append(asyncio.create_task(server.serve()))

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
                if _owns_process:  # after what the start made too (a worker's engine)
                    tune_gc()
                await self.set_serving(True)
            else:
                starter.cancel()
        await self._stop.wait()
        await self.stop()

    async def stop(self) -> None:
        """The drain, in order: NOT_SERVING and refuse new work; let the gRPC calls and HTTP requests in flight
        finish within ``drain_grace_s`` (one deadline for both); stop the HTTP servers; then the ``on_stop``
        hooks, which close the channels the service dials, last."""
        grace = self.settings.drain_grace_s
        log.info("draining", extra={"grace_s": grace, "http_inflight": self._gate.inflight if self._gate else 0})
        deadline = asyncio.get_running_loop().time() + grace
        self._ready = False
        if self._gate is not None:
            self._gate.close()
        await self.health.enter_graceful_shutdown()
        for hook in self.on_drain:
            await hook()
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
        http_idle = self._gate.idle(remaining) if self._gate is not None else asyncio.sleep(0, True)
        _, idle = await asyncio.gather(self.server.stop(remaining), http_idle)
        if not idle:
            log.warning("drain grace over with HTTP requests in flight",
                        extra={"http_inflight": self._gate.inflight if self._gate else 0})
        for server in self._http_servers:
            server.should_exit = True
        if self._http_tasks:
            await asyncio.wait(self._http_tasks, timeout=HTTP_CLOSE_S + 1)
        for hook in self.on_stop:
            await hook()
        log.info("stopped")


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def tune_gc() -> None:
    """What start-up made (modules, the app, its clients) leaves the garbage collector's walks (``gc.freeze``): a
    collection of the oldest generation then walks only what requests made instead of stopping the event loop for
    the whole heap (gRPC TTFT p99 at 128 streams +55 against +254 ms: loadtests/reports/gc-freeze-ab.md). Called
    once the service serves, in a process that :func:`run_main` started (the collector is the whole process's)."""
    gc.collect()  # what start-up left as garbage goes now, not frozen
    gc.freeze()


EVENT_LOOP_ENV = "GOODPUT_EVENT_LOOP"
_owns_process = False  # run_main started this process: its ServiceRunner tunes the collector (tune_gc)


def run_main(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs a service's main coroutine to its end on uvloop, the faster event loop (``GOODPUT_EVENT_LOOP=asyncio``:
    the standard library's). Every Goodput process starts here.

    A native crash (a segfault or abort in grpc's or another extension's C code) writes every thread's Python stack
    to stderr, the service's log, before the process dies: without it such a crash leaves only an exit status."""
    global _owns_process
    _owns_process = True
    faulthandler.enable(all_threads=True)
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower() or "uvloop"
    if choice == "asyncio":
        asyncio.run(main())
    elif choice == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        raise SystemExit(f"{EVENT_LOOP_ENV} must be uvloop or asyncio, not {choice!r}")
