"""A circuit breaker in front of each dependency the gateway calls (cache, retriever, embedder, scheduler), and
what counts as the dependency failing: it did not answer (unreachable, internal error) or, for the cache, retriever
and embedder, answered too late for the hop's budget. An answer that refuses the request (bad input, not found, a
shed) is the dependency working; so is the scheduler's own deadline refusal (it answered: the request is late).

    >>> import grpc
    >>> from goodput_core.errors import DeadlineExceeded, InvalidArgument, Unavailable
    >>> failed(Unavailable("down")), failed(InvalidArgument("bad")), failed(DeadlineExceeded("slow"))
    (True, False, True)
    >>> failed(DeadlineExceeded("late"), slow_counts=False)
    False
"""

from __future__ import annotations

import asyncio
from functools import partial

import grpc
from prometheus_client import CollectorRegistry

from goodput_core.breaker import BreakerMetrics, BreakerSettings, CircuitBreaker
from goodput_core.errors import DeadlineExceeded, GoodputError, Unavailable

__all__ = ["DEPENDENCIES", "failed", "gateway_breakers"]

DEPENDENCIES = ("cache", "retriever", "embedder", "scheduler")
_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


def failed(exc: BaseException, *, slow_counts: bool = True) -> bool:
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        return code in _DOWN or (slow_counts and code == grpc.StatusCode.DEADLINE_EXCEEDED)
    if isinstance(exc, DeadlineExceeded | asyncio.TimeoutError | TimeoutError):
        return slow_counts
    if isinstance(exc, Unavailable | ConnectionError):
        return True
    return not isinstance(exc, GoodputError)  # any other GoodputError is an answer


def gateway_breakers(settings: BreakerSettings, registry: CollectorRegistry | None) -> dict[str, CircuitBreaker]:
    """One breaker per dependency, sharing ``goodput_gateway_breaker_*`` metrics."""
    metrics = BreakerMetrics(registry, service="gateway")
    return {name: CircuitBreaker.from_settings(name, settings, metrics=metrics,
                                               is_failure=partial(failed, slow_counts=name != "scheduler"))
            for name in DEPENDENCIES}
