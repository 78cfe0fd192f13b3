"""Which calls get a span: the one-function test agrees with the instrumentation's composed filters."""

from __future__ import annotations

from collections import namedtuple

import grpc
import pytest
from grpc import aio
from opentelemetry.instrumentation.grpc import filters

from goodput_core.tracing import traced

# What the services used before: the instrumentation's filters composed (each checks the details' type per call).
_COMPOSED = filters.negate(filters.any_of(filters.health_check(), filters.method_name("GetLoad"),
                                          filters.full_method_name("/goodput.scheduler.v1.Scheduler/LeaseBatches"),
                                          filters.service_prefix("grpc.reflection")))

METHODS = [
    "/goodput.gateway.v1.Gateway/GenerateStream",
    "/goodput.inference.v1.Inference/Generate",
    "/goodput.inference.v1.Inference/GetLoad",
    "/goodput.scheduler.v1.Scheduler/LeaseBatches",
    "/goodput.scheduler.v1.Scheduler/ListWorkers",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
]


class _Handler(namedtuple("_Handler", ["method", "invocation_metadata"]), grpc.HandlerCallDetails):
    pass


@pytest.mark.parametrize("method", METHODS)
def test_server_calls_are_traced_as_the_composed_filters_decide(method: str) -> None:
    details = _Handler(method, ())
    assert traced(details) == _COMPOSED(details)


@pytest.mark.parametrize("method", METHODS)
def test_channel_calls_carry_bytes_and_are_traced_alike(method: str) -> None:
    details = aio.ClientCallDetails(method.encode(), None, None, None, None)
    assert traced(details) == _COMPOSED(details)


def test_request_paths_are_traced_and_polls_are_not() -> None:
    assert traced(_Handler("/goodput.gateway.v1.Gateway/GenerateStream", ()))
    assert not traced(_Handler("/goodput.scheduler.v1.Scheduler/LeaseBatches", ()))
    assert not traced(_Handler("/grpc.health.v1.Health/Check", ()))
