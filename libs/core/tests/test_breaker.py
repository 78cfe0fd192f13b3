"""The circuit breaker as the gateway uses it in front of a dependency: when it opens, refuses and probes again,
what counts as a failure, and what SREs see (metrics, log lines). Time is a fake clock: no test sleeps."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from goodput_core.breaker import BreakerMetrics, BreakerSettings, BreakerState, CircuitBreaker
from goodput_core.context import request_context
from goodput_core.errors import InvalidArgument, NotFound, Unavailable
from goodput_core.settings import ServiceSettings, service_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Dependency:
    """Stands for the cache or the retriever: counts the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    async def call(self, breaker: CircuitBreaker, error: BaseException | None = None) -> str:
        async with breaker.guard():
            self.calls += 1
            if error is not None:
                raise error
        return "ok"


async def fail(breaker: CircuitBreaker, times: int = 1, error: Exception | None = None) -> None:
    for _ in range(times):
        with pytest.raises(type(error) if error is not None else ConnectionError):
            async with breaker.guard():
                raise error if error is not None else ConnectionError("connection refused")


async def succeed(breaker: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        async with breaker.guard():
            pass


async def opened(clock: FakeClock, **options: object) -> CircuitBreaker:
    """A breaker just opened by one failure (reset timeout 5 s unless told)."""
    breaker = CircuitBreaker("retriever", failure_threshold=1, clock=clock, **options)  # type: ignore[arg-type]
    await fail(breaker)
    assert breaker.state is BreakerState.OPEN
    return breaker


async def test_opens_after_consecutive_failures() -> None:
    breaker = CircuitBreaker("cache", failure_threshold=3, clock=FakeClock())
    await fail(breaker, 2)
    await succeed(breaker)  # a success starts the count again
    await fail(breaker, 2)
    assert breaker.state is BreakerState.CLOSED
    await fail(breaker)
    assert breaker.state is BreakerState.OPEN and breaker.state == "open"


async def test_opens_when_the_failure_ratio_of_the_window_is_reached() -> None:
    breaker = CircuitBreaker("embedder", failure_threshold=100, failure_ratio=0.5, window=10, min_calls=6,
                             clock=FakeClock())
    await fail(breaker, 4)  # 100 % failures, but too few calls to judge
    assert breaker.state is BreakerState.CLOSED
    await succeed(breaker)  # 4 of 5
    await succeed(breaker)  # 4 of 6: 67 %
    assert breaker.state is BreakerState.OPEN


async def test_the_ratio_is_over_the_last_window_calls_only() -> None:
    breaker = CircuitBreaker("embedder", failure_threshold=100, failure_ratio=0.5, window=4, min_calls=4,
                             clock=FakeClock())
    await fail(breaker)
    await succeed(breaker, 3)  # 1 of 4
    await fail(breaker)  # the first failure leaves the window: still 1 of 4
    assert breaker.state is BreakerState.CLOSED
    await fail(breaker)  # 2 of 4
    assert breaker.state is BreakerState.OPEN


async def test_refuses_at_once_while_open_without_calling_the_dependency() -> None:
    clock = FakeClock()
    breaker = await opened(clock)
    dependency = Dependency()
    with pytest.raises(Unavailable) as refused:
        await dependency.call(breaker)
    assert dependency.calls == 0
    assert "retriever" in refused.value.message and refused.value.code == "circuit_open"
    assert refused.value.retry_after_s == pytest.approx(5.0)
    assert breaker.retry_after_s() > 0  # still refusing


async def test_retry_after_counts_down_to_the_next_probe() -> None:
    clock = FakeClock()
    breaker = await opened(clock, reset_timeout_s=5.0)
    left = []
    for _ in range(3):
        clock.advance(1.5)
        with pytest.raises(Unavailable) as refused:
            await succeed(breaker)
        left.append(refused.value.retry_after_s)
    assert left == pytest.approx([3.5, 2.0, 0.5])
    clock.advance(0.5)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.retry_after_s() == 0.0


async def test_half_open_lets_exactly_max_calls_probes_through_at_once() -> None:
    clock = FakeClock()
    breaker = await opened(clock, half_open_max_calls=2, half_open_successes=2)
    clock.advance(5.0)
    dependency, answer = Dependency(), asyncio.Event()

    async def slow_probe() -> None:
        async with breaker.guard():
            dependency.calls += 1
            await answer.wait()

    probes = [asyncio.create_task(slow_probe()) for _ in range(2)]
    while dependency.calls < 2:
        await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="probe"):
        await dependency.call(breaker)  # a third caller while both probes are out
    assert dependency.calls == 2 and breaker.state is BreakerState.HALF_OPEN
    answer.set()
    await asyncio.gather(*probes)
    assert breaker.state is BreakerState.CLOSED


async def test_a_probe_success_closes_the_breaker() -> None:
    clock = FakeClock()
    breaker = await opened(clock, half_open_successes=2)
    clock.advance(5.0)
    await succeed(breaker)
    assert breaker.state is BreakerState.HALF_OPEN  # one of two successes needed
    await succeed(breaker)
    assert breaker.state is BreakerState.CLOSED
    await fail(breaker)  # closed again from scratch: one failure (the threshold) opens it
    assert breaker.state is BreakerState.OPEN


async def test_a_probe_failure_reopens_with_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker = await opened(clock, reset_timeout_s=5.0, backoff_factor=2.0, max_reset_timeout_s=12.0)
    waits = []
    for _ in range(3):
        clock.advance(breaker.retry_after_s())
        await fail(breaker)  # the probe fails
        assert breaker.state is BreakerState.OPEN
        waits.append(breaker.retry_after_s())
    assert waits == pytest.approx([10.0, 12.0, 12.0])
    clock.advance(12.0)
    await succeed(breaker)
    await fail(breaker)  # a later opening starts from the base timeout again
    assert breaker.retry_after_s() == pytest.approx(5.0)


async def test_without_backoff_the_timeout_restarts_unchanged() -> None:
    clock = FakeClock()
    breaker = await opened(clock, reset_timeout_s=5.0, backoff_factor=1.0)
    clock.advance(5.0)
    await fail(breaker)
    assert breaker.retry_after_s() == pytest.approx(5.0)


async def test_ignored_exceptions_neither_open_nor_close_it() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("scheduler", failure_threshold=2, ignore=(InvalidArgument,), clock=clock)
    await fail(breaker, 10, InvalidArgument("max_tokens too large"))  # the caller's fault, raised unchanged
    assert breaker.state is BreakerState.CLOSED
    await fail(breaker)
    await fail(breaker, 1, InvalidArgument("bad"))  # not a success either: the failures in a row go on
    await fail(breaker)
    assert breaker.state is BreakerState.OPEN
    clock.advance(5.0)
    await fail(breaker, 1, InvalidArgument("bad"))  # the probe's slot is freed, the breaker stays half-open
    assert breaker.state is BreakerState.HALF_OPEN
    await succeed(breaker)
    assert breaker.state is BreakerState.CLOSED


async def test_is_failure_decides_which_exceptions_are_failures() -> None:
    breaker = CircuitBreaker("cache", failure_threshold=2, is_failure=lambda exc: not isinstance(exc, NotFound),
                             clock=FakeClock())
    await fail(breaker)
    await fail(breaker, 1, NotFound("no such entry"))  # the dependency answered: a success
    await fail(breaker)
    assert breaker.state is BreakerState.CLOSED
    await fail(breaker)
    assert breaker.state is BreakerState.OPEN


async def test_one_tenants_own_failures_do_not_open_it_for_everyone() -> None:
    """Tenant a's calls fail (its own input, its own deadline too short for the hop) while b's latest call succeeded:
    they are a's, not the dependency's, and b's calls keep reaching it; once b's fail too, failures count again."""
    registry = CollectorRegistry()
    breaker = CircuitBreaker("retriever", failure_threshold=2, window=4, min_calls=2, clock=FakeClock(),
                             metrics=BreakerMetrics(registry, service="gateway"))
    with request_context(tenant="b"):
        await succeed(breaker)
    with request_context(tenant="a"):
        await fail(breaker, 10, TimeoutError())
    assert breaker.state is BreakerState.CLOSED
    assert registry.get_sample_value("goodput_gateway_breaker_tenant_failures_total",
                                     {"dependency": "retriever"}) == 10
    with request_context(tenant="b"):
        await succeed(breaker)
        await fail(breaker)  # b's call fails too: the dependency's failure
    with request_context(tenant="a"):
        await fail(breaker)  # and now a's counts as well
    assert breaker.state is BreakerState.OPEN


async def test_a_breaker_one_tenant_opened_alone_is_not_kept_open_by_its_probes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("retriever", failure_threshold=2, clock=clock)
    with request_context(tenant="a"):
        await fail(breaker, 2)  # nobody else calls: a's failures count, and open it
        assert breaker.state is BreakerState.OPEN
        clock.advance(5.0)
        await fail(breaker, 3)  # a's probes fail: nothing new, the slot is freed each time, no backoff
    assert breaker.state is BreakerState.HALF_OPEN
    with request_context(tenant="b"):
        await succeed(breaker)  # b's probe decides
    assert breaker.state is BreakerState.CLOSED
    with request_context(tenant="a"):
        await fail(breaker, 2)
    clock.advance(5.0)
    with request_context(tenant="b"):
        await fail(breaker)  # b's probe fails: the dependency's failure, reopened with backoff
    assert breaker.state is BreakerState.OPEN and breaker.retry_after_s() == pytest.approx(10.0)


async def test_failures_of_no_tenant_always_count() -> None:
    breaker = CircuitBreaker("scheduler", failure_threshold=2, clock=FakeClock())
    with request_context(tenant="b"):
        await succeed(breaker)
    await fail(breaker, 2)  # a call of no tenant (a background refresh): nothing to tell apart
    assert breaker.state is BreakerState.OPEN


async def test_cancelled_calls_do_not_count_and_free_the_probe_slot() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("retriever", failure_threshold=1, clock=clock)
    started = asyncio.Event()

    async def hung() -> None:
        async with breaker.guard():
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hung())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.state is BreakerState.CLOSED  # the caller went away: not a failure

    await fail(breaker)
    clock.advance(5.0)
    started.clear()
    probe = asyncio.create_task(hung())
    await started.wait()
    assert breaker.retry_after_s() > 0  # the only probe slot is taken
    probe.cancel()
    await asyncio.gather(probe, return_exceptions=True)
    assert breaker.state is BreakerState.HALF_OPEN  # neither closed nor reopened...
    await succeed(breaker)  # ...and the next caller gets the slot
    assert breaker.state is BreakerState.CLOSED


async def test_an_outer_timeout_is_a_cancellation_an_inner_one_a_failure() -> None:
    breaker = CircuitBreaker("retriever", failure_threshold=1, clock=FakeClock())
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            async with breaker.guard():
                await asyncio.Event().wait()
    assert breaker.state is BreakerState.CLOSED
    with pytest.raises(TimeoutError):
        async with breaker.guard():
            async with asyncio.timeout(0):
                await asyncio.Event().wait()
    assert breaker.state is BreakerState.OPEN


async def test_results_of_calls_admitted_before_a_state_change_are_ignored() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("scheduler", failure_threshold=1, clock=clock)
    late = breaker.guard()
    await late.__aenter__()  # a slow call admitted while closed
    await fail(breaker)
    clock.advance(5.0)
    assert breaker.state is BreakerState.HALF_OPEN
    await late.__aexit__(None, None, None)  # its success says nothing of the dependency now
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.retry_after_s() == 0  # and it took no probe slot


async def test_metrics() -> None:
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = BreakerMetrics(registry, service="gateway")
    cache = CircuitBreaker("cache", failure_threshold=1, metrics=metrics, clock=clock)
    CircuitBreaker("retriever", metrics=metrics, clock=clock)  # a second breaker on the same metrics

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"goodput_gateway_breaker_{name}", labels)

    assert sample("state", dependency="cache") == 0.0 and sample("rejected_total", dependency="cache") == 0.0
    assert sample("transitions_total", dependency="cache", to="open") == 0.0
    await fail(cache)
    assert sample("state", dependency="cache") == 2.0
    for _ in range(3):
        with pytest.raises(Unavailable):
            async with cache.guard():
                pass
    assert sample("rejected_total", dependency="cache") == 3.0
    clock.advance(5.0)
    assert cache.state is BreakerState.HALF_OPEN and sample("state", dependency="cache") == 1.0
    await succeed(cache)
    assert sample("state", dependency="cache") == 0.0
    assert [sample("transitions_total", dependency="cache", to=to) for to in ("open", "half_open", "closed")] \
        == [1.0, 1.0, 1.0]
    assert sample("state", dependency="retriever") == 0.0


def test_metric_names_without_a_service() -> None:
    registry = CollectorRegistry()
    CircuitBreaker("cache", metrics=BreakerMetrics(registry))
    assert registry.get_sample_value("goodput_breaker_state", {"dependency": "cache"}) == 0.0


async def test_a_log_line_on_each_transition(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("cache", failure_threshold=1, clock=clock)
    with caplog.at_level(logging.INFO, logger="goodput.breaker"):
        await fail(breaker)
        clock.advance(5.0)
        await succeed(breaker)
    moves = [(r.__dict__["dependency"], r.__dict__["from"], r.__dict__["to"], r.levelname) for r in caplog.records]
    assert moves == [("cache", "closed", "open", "WARNING"), ("cache", "open", "half_open", "INFO"),
                     ("cache", "half_open", "closed", "INFO")]


def test_settings_are_validated_and_embed_in_a_service_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="min_calls"):
        BreakerSettings(window=5, min_calls=10)
    with pytest.raises(ValidationError, match="max_reset_timeout_s"):
        BreakerSettings(reset_timeout_s=30, max_reset_timeout_s=10)
    with pytest.raises(ValidationError):
        CircuitBreaker("cache", failure_ratio=0)

    class GatewayLike(ServiceSettings):
        model_config = service_config("GOODPUT_BREAKERTEST_")
        breaker: BreakerSettings = BreakerSettings()

    monkeypatch.setenv("GOODPUT_BREAKERTEST_BREAKER", '{"failure_threshold": 3, "reset_timeout_s": 2}')
    settings = GatewayLike()
    breaker = CircuitBreaker.from_settings("cache", settings.breaker, clock=FakeClock())
    assert breaker.settings.failure_threshold == 3 and breaker.settings.reset_timeout_s == 2.0
    assert breaker.settings.window == 20  # the rest keep their defaults
