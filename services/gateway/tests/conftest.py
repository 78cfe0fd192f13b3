"""The gateway's tests' one fixture: ``gateway``, a factory of in-process gateways (the REST app the server runs, on
an httpx transport, no port) with the settings a test gives. No backend runs: the scheduler address is a closed port,
so a request that gets past the gateway's own decisions fails with 503; a test that needs models served names them
(``models=``), and the gateway knows them as if a scheduler had listed them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from goodput.scheduler.v1 import scheduler_pb2
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from goodput_gateway.__main__ import compose
from goodput_gateway.api import create_app
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.config import GatewaySettings

from .helpers import KEYS, Gateway, GatewayFactory


@pytest.fixture
async def gateway() -> AsyncIterator[GatewayFactory]:
    async with contextlib.AsyncExitStack() as stack:
        async def make(*, models: Sequence[ModelEntry] = (), workers: Sequence[scheduler_pb2.WorkerStatus] = (),
                       **settings: Any) -> Gateway:
            registry = CollectorRegistry()
            wiring = compose(GatewaySettings(**{"grpc_port": 0, "http_port": 0, "api_keys": KEYS,
                                                "scheduler_addr": "127.0.0.1:1", **settings}), registry, None)
            stack.push_async_callback(wiring.close)
            service = wiring.service
            if models:  # what a scheduler would have listed, fresh for as long as the test runs
                service.pipeline.catalogue.pin(models, workers)
            app = create_app(service, tracer=TracerProvider().get_tracer("test"),
                             ready=lambda: True, responses_store=wiring.responses, stream_buffer=wiring.streams)
            client = await stack.enter_async_context(httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                       base_url="http://gw"))
            return Gateway(client, service, registry)
        yield make
