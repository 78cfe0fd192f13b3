"""A circuit breaker per dependency (cache, retriever, embedder, scheduler): when a dependency keeps failing, calls
to it are refused at once with :class:`~goodput_core.errors.Unavailable` instead of each waiting out its own
timeout, so the gateway takes the next step of its degradation ladder quickly and the dependency gets room to
recover.

States:

- ``closed``: calls pass. It opens after ``failure_threshold`` failures in a row, or when at least ``min_calls`` of
  the last ``window`` calls are known and the share of failures among them reaches ``failure_ratio``.
- ``open``: calls are refused without touching the dependency; the error's ``retry_after_s`` is the time left until
  the next probe. After the reset timeout (``reset_timeout_s`` at first) the next call finds it ``half_open``.
- ``half_open``: at most ``half_open_max_calls`` probe calls are let through at once (others are refused).
  ``half_open_successes`` probe successes close it; one probe failure opens it again, with the reset timeout
  multiplied by ``backoff_factor`` for each failed probe in a row, up to ``max_reset_timeout_s``.

What counts: leaving a :meth:`CircuitBreaker.guard` block normally is a success; an exception is a failure unless
it is an instance of a type in ``ignore`` (the caller's fault, e.g. :class:`~goodput_core.errors.InvalidArgument`:
neither a success nor a failure) or ``is_failure(exc)`` says it is not one (the dependency answered, e.g. a
``NotFound``: a success). ``asyncio.CancelledError`` (the caller went away) is neither, and gives a probe's slot
back. A timeout counts only when it is raised inside the block: put ``asyncio.timeout`` (or the gRPC ``timeout=``)
inside ``guard()``, since an outer timeout reaches the block as a cancellation.

Whose failure: a call runs for a tenant (:data:`~goodput_core.context.tenant_id_var` when it is entered). A tenant's
failure while the latest call of another tenant succeeded (since the last state change) is that tenant's own, not
the dependency's: its own input, its own short deadline or budget. It counts as neither, so one tenant's failing
calls cannot open the breaker for all; once another tenant's call fails too, failures count again. Calls of no
tenant always count. A breaker opened by the failures of one tenant alone (nobody else called) is not reopened by
that tenant's failed probes (they free the slot): another tenant's probe decides. Everything runs on the event loop's
thread without awaiting, so no lock is needed. The state moves from ``open`` to ``half_open`` when it is next read
(a call, :attr:`CircuitBreaker.state`) after the reset timeout, not on a timer.

Example (a fake clock; a service passes none and gets ``time.monotonic``):
    >>> import asyncio, contextlib
    >>> from goodput_core.errors import Unavailable
    >>> now = [0.0]
    >>> breaker = CircuitBreaker("retriever", failure_threshold=2, reset_timeout_s=5.0, clock=lambda: now[0])
    >>> async def search(ok: bool) -> str:
    ...     try:
    ...         async with breaker.guard():
    ...             if not ok:
    ...                 raise ConnectionError("connection refused")
    ...         return "answered"
    ...     except ConnectionError:
    ...         return "failed"
    ...     except Unavailable as err:
    ...         return f"refused, next probe in {err.retry_after_s:.0f}s"
    >>> [asyncio.run(search(ok=False)) for _ in range(2)]
    ['failed', 'failed']
    >>> print(breaker.state)
    open
    >>> now[0] += 2.0
    >>> asyncio.run(search(ok=True))
    'refused, next probe in 3s'
    >>> now[0] += 3.0
    >>> print(breaker.state)
    half_open
    >>> asyncio.run(search(ok=True)), str(breaker.state)
    ('answered', 'closed')

Tenant ``a``'s calls fail (say, its own deadline is too short for the hop) while ``b``'s succeed: it stays closed.
    >>> from goodput_core.context import request_context
    >>> breaker = CircuitBreaker("retriever", failure_threshold=2, clock=lambda: now[0])
    >>> async def call(tenant: str, ok: bool) -> None:
    ...     with request_context(tenant=tenant), contextlib.suppress(TimeoutError):
    ...         async with breaker.guard():
    ...             if not ok:
    ...                 raise TimeoutError
    >>> for tenant, ok in [("b", True), ("a", False), ("a", False), ("a", False)]:
    ...     asyncio.run(call(tenant, ok))
    >>> print(breaker.state)
    closed
    >>> for tenant in ("b", "a"):  # b's calls fail too: the dependency's failures
    ...     asyncio.run(call(tenant, False))
    >>> print(breaker.state)
    open

Several breakers of one service share one :class:`BreakerMetrics` (so their metrics are registered once):
    >>> from prometheus_client import CollectorRegistry
    >>> registry = CollectorRegistry()
    >>> metrics = BreakerMetrics(registry, service="gateway")
    >>> cache = CircuitBreaker.from_settings("cache", BreakerSettings(), metrics=metrics)
    >>> registry.get_sample_value("goodput_gateway_breaker_state", {"dependency": "cache"})
    0.0
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, model_validator

from goodput_core.context import tenant_id_var
from goodput_core.errors import Unavailable

__all__ = ["BreakerMetrics", "BreakerSettings", "BreakerState", "CircuitBreaker"]

log = logging.getLogger("goodput.breaker")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The value of the state gauge: higher is worse, so `max by (dependency)` over replicas shows the worst.
_GAUGE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class BreakerSettings(BaseModel):
    """When a dependency's breaker opens and how it tries again; a service's settings embed one (or one per
    dependency) as a field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    failure_threshold: int = Field(5, ge=1, le=10_000, description="Failures in a row that open the breaker.")
    failure_ratio: float = Field(0.5, gt=0, le=1, description="Share of failures among the last `window` calls "
                                 "that opens the breaker (once at least `min_calls` of them are known).")
    window: int = Field(20, ge=1, le=10_000, description="Calls the failure ratio is computed over.")
    min_calls: int = Field(10, ge=1, le=10_000, description="Calls the window must hold before the failure ratio "
                           "can open the breaker (at most `window`).")
    reset_timeout_s: float = Field(5.0, gt=0, le=3600, description="Seconds the breaker stays open before it lets "
                                   "a probe call through.")
    max_reset_timeout_s: float = Field(60.0, gt=0, le=3600, description="Cap of the reset timeout as it grows "
                                       "after failed probes (at least `reset_timeout_s`).")
    backoff_factor: float = Field(2.0, ge=1, le=10, description="The reset timeout is multiplied by this for each "
                                  "failed probe in a row (1 = no backoff).")
    half_open_max_calls: int = Field(1, ge=1, le=1000, description="Probe calls let through at once while "
                                     "half-open.")
    half_open_successes: int = Field(1, ge=1, le=1000, description="Probe successes that close the breaker again.")

    @model_validator(mode="after")
    def _consistent(self) -> BreakerSettings:
        if self.min_calls > self.window:
            raise ValueError(f"min_calls ({self.min_calls}) must not exceed window ({self.window})")
        if self.max_reset_timeout_s < self.reset_timeout_s:
            raise ValueError(f"max_reset_timeout_s ({self.max_reset_timeout_s}) must not be below reset_timeout_s "
                             f"({self.reset_timeout_s})")
        return self


class BreakerMetrics:
    """The breakers' metrics, registered once in ``registry`` and shared by every breaker of a service (one
    ``dependency`` label value each). Named ``goodput_{service}_breaker_*`` (``goodput_breaker_*`` without a
    service): ``..._state{dependency}`` (0 closed, 1 half_open, 2 open), ``..._transitions_total{dependency,to}``
    and ``..._rejected_total{dependency}`` (calls refused by the breaker). ``registry=None`` registers nothing.

    Example:
        >>> registry = CollectorRegistry()
        >>> metrics = BreakerMetrics(registry, service="gateway")
        >>> for name in ("cache", "retriever"):
        ...     _ = CircuitBreaker(name, metrics=metrics)
        >>> registry.get_sample_value("goodput_gateway_breaker_rejected_total", {"dependency": "retriever"})
        0.0
    """

    def __init__(self, registry: CollectorRegistry | None, *, service: str | None = None) -> None:
        base = f"goodput_{service}_breaker" if service else "goodput_breaker"
        self.state = Gauge(f"{base}_state", "Circuit breaker state per dependency (0 closed, 1 half_open, 2 open).",
                           ["dependency"], registry=registry)
        self.transitions = Counter(f"{base}_transitions_total", "Circuit breaker state changes, by the state "
                                   "entered.", ["dependency", "to"], registry=registry)
        self.rejected = Counter(f"{base}_rejected_total", "Calls refused by an open (or half-open and busy) "
                                "circuit breaker without reaching the dependency.", ["dependency"], registry=registry)
        self.tenant_failures = Counter(f"{base}_tenant_failures_total", "Failed calls of a tenant while another "
                                       "tenant's latest call succeeded: that tenant's own, not counted against the "
                                       "dependency.", ["dependency"], registry=registry)

    def add(self, dependency: str) -> None:
        """Reports a new breaker (closed, nothing counted yet), so that its series exist before anything happens."""
        self.state.labels(dependency).set(_GAUGE_VALUE[BreakerState.CLOSED])
        self.rejected.labels(dependency)
        self.tenant_failures.labels(dependency)
        for state in BreakerState:
            self.transitions.labels(dependency, state.value)


@dataclass(frozen=True, slots=True)
class _Permit:
    """One admitted call: the state epoch it was admitted in (a result from an earlier epoch is stale and ignored),
    whether it holds a half-open probe slot, and the tenant it runs for (None: none)."""

    epoch: int
    probe: bool
    tenant: str | None = None


class CircuitBreaker:
    """The breaker of one dependency ``name``; see the module's docstring for what it does.

    Wrap each call in ``async with breaker.guard():``."""

    def __init__(self, name: str, *, failure_threshold: int = 5, failure_ratio: float = 0.5, window: int = 20,
                 min_calls: int = 10, reset_timeout_s: float = 5.0, max_reset_timeout_s: float = 60.0,
                 backoff_factor: float = 2.0, half_open_max_calls: int = 1, half_open_successes: int = 1,
                 ignore: Iterable[type[BaseException]] = (),
                 is_failure: Callable[[BaseException], bool] | None = None,
                 metrics: BreakerMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        # Validated as settings are, so a bad argument fails here rather than misbehaving later.
        self.settings = BreakerSettings(
            failure_threshold=failure_threshold, failure_ratio=failure_ratio, window=window, min_calls=min_calls,
            reset_timeout_s=reset_timeout_s, max_reset_timeout_s=max_reset_timeout_s, backoff_factor=backoff_factor,
            half_open_max_calls=half_open_max_calls, half_open_successes=half_open_successes)
        self.ignore = tuple(ignore)
        self.is_failure = is_failure
        self.metrics = metrics
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._epoch = 0
        self._outcomes: deque[bool] = deque(maxlen=window)  # True: success, over the last `window` calls
        self._failures_in_window = 0
        self._consecutive_failures = 0
        self._failed_probes = 0  # probe failures in a row: the exponent of the backoff
        self._open_until = 0.0
        self._probes = 0  # probe calls out while half-open
        self._probe_successes = 0
        # The latest outcome of the two tenants heard from last (newest first, distinct): the latest call of a tenant
        # other than any given one is the first entry of another tenant.
        self._recent: list[tuple[str, bool]] = []
        self._failing: set[str | None] = set()  # the tenants of the failures counted since the last state change
        self._blamed: str | None = None  # the one tenant whose failures opened it, if they were one tenant's
        if metrics is not None:
            metrics.add(name)

    @classmethod
    def from_settings(cls, name: str, settings: BreakerSettings, *, metrics: BreakerMetrics | None = None,
                      clock: Callable[[], float] = time.monotonic, ignore: Iterable[type[BaseException]] = (),
                      is_failure: Callable[[BaseException], bool] | None = None) -> CircuitBreaker:
        return cls(name, **settings.model_dump(), ignore=ignore, is_failure=is_failure, metrics=metrics, clock=clock)

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, state={self._state.value!r})"

    @property
    def state(self) -> BreakerState:
        """The current state (``open`` becomes ``half_open`` here once the reset timeout has passed)."""
        self._refresh()
        return self._state

    def guard(self) -> _Guard:
        """``async with breaker.guard():`` around one call to the dependency. Entering raises
        :class:`~goodput_core.errors.Unavailable` when the breaker refuses the call; how the block ends is recorded
        (see the module's docstring), and its exception, if any, propagates unchanged."""
        return _Guard(self)

    def retry_after_s(self) -> float:
        """Seconds until the breaker lets a call through again as far as it knows now: 0 when it would; while
        half-open with every probe slot taken, the current reset timeout (what a failing probe would bring)."""
        self._refresh()
        if self._state is BreakerState.OPEN:
            return max(0.0, self._open_until - self._clock())
        if self._state is BreakerState.HALF_OPEN and self._probes >= self.settings.half_open_max_calls:
            return self._reset_timeout_s()
        return 0.0

    # -- the machine -------------------------------------------------------------------------------------------

    def _refresh(self) -> None:
        if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._transition(BreakerState.HALF_OPEN, "reset timeout passed")

    def _admit(self) -> _Permit | None:
        self._refresh()
        if self._state is BreakerState.CLOSED:
            return _Permit(self._epoch, probe=False, tenant=tenant_id_var.get())
        if self._state is BreakerState.HALF_OPEN and self._probes < self.settings.half_open_max_calls:
            self._probes += 1
            return _Permit(self._epoch, probe=True, tenant=tenant_id_var.get())
        if self.metrics is not None:
            self.metrics.rejected.labels(self.name).inc()
        return None

    def _refusal(self) -> Unavailable:
        retry_after = self.retry_after_s()
        if self._state is BreakerState.OPEN:
            why = f"its circuit breaker is open after repeated failures; the next try is in {retry_after:.1f}s"
        else:
            why = "its circuit breaker is half-open and a probe call is already out"
        return Unavailable(f"{self.name} is unavailable: {why}", code="circuit_open", retry_after_s=retry_after)

    def _verdict(self, exc: BaseException | None) -> bool | None:
        """True: a success, False: a failure, None: neither (cancelled, or an ignored exception)."""
        if exc is None:
            return True
        if not isinstance(exc, Exception) or isinstance(exc, self.ignore):
            return None  # CancelledError, GeneratorExit, KeyboardInterrupt: nothing is known of the dependency
        return self.is_failure is not None and not self.is_failure(exc)

    def _settle(self, permit: _Permit, success: bool | None) -> None:
        if permit.epoch != self._epoch:
            return  # admitted before the last state change: its slot and its outcome belong to a past state
        if permit.probe:
            self._probes -= 1
        if success is None:
            return
        if self._own_failure(permit.tenant, success):
            if self.metrics is not None:
                self.metrics.tenant_failures.labels(self.name).inc()
            return
        if self._state is BreakerState.HALF_OPEN:
            if not success and permit.tenant is not None and permit.tenant == self._blamed:
                return  # the tenant that alone opened it fails again: nothing new of the dependency
            if not success:
                self._failed_probes += 1
                self._transition(BreakerState.OPEN, "probe failed")
            else:
                self._probe_successes += 1
                if self._probe_successes >= self.settings.half_open_successes:
                    self._transition(BreakerState.CLOSED, "probe succeeded")
            return
        # closed (an admitted call of this epoch never finds the breaker open: opening starts a new epoch)
        if len(self._outcomes) == self._outcomes.maxlen and not self._outcomes[0]:
            self._failures_in_window -= 1  # the oldest outcome is about to leave the window
        self._outcomes.append(success)
        if success:
            self._consecutive_failures = 0
        else:
            self._failures_in_window += 1
            self._consecutive_failures += 1
            self._failing.add(permit.tenant)
        calls = len(self._outcomes)
        if self._consecutive_failures >= self.settings.failure_threshold:
            self._transition(BreakerState.OPEN, f"{self._consecutive_failures} failures in a row")
        elif calls >= self.settings.min_calls and self._failures_in_window / calls >= self.settings.failure_ratio:
            self._transition(BreakerState.OPEN, f"{self._failures_in_window} of the last {calls} calls failed")

    def _own_failure(self, tenant: str | None, success: bool) -> bool:
        """Records the outcome under its tenant; True for a failure of the tenant's own: the latest call of another
        tenant, since the last state change, succeeded."""
        if not tenant:
            return False
        other = next((ok for t, ok in self._recent if t != tenant), None)
        self._recent = [(tenant, success), *((t, ok) for t, ok in self._recent if t != tenant)][:2]
        return not success and other is True

    def _reset_timeout_s(self) -> float:
        s = self.settings
        return min(s.max_reset_timeout_s, s.reset_timeout_s * s.backoff_factor ** self._failed_probes)

    def _transition(self, to: BreakerState, reason: str) -> None:
        before = self._state
        self._state = to
        self._epoch += 1
        self._probes = 0
        self._probe_successes = 0
        extra: dict[str, Any] = {"dependency": self.name, "from": before.value, "to": to.value, "reason": reason}
        if to is BreakerState.OPEN:
            self._blamed = next(iter(self._failing)) if before is BreakerState.CLOSED and len(self._failing) == 1 \
                else None
            timeout = self._reset_timeout_s()
            self._open_until = self._clock() + timeout
            extra["retry_after_s"] = round(timeout, 3)
        # Each state starts from nothing: the window is of calls made while closed, since the last close.
        self._outcomes.clear()
        self._failures_in_window = 0
        self._consecutive_failures = 0
        self._recent.clear()
        self._failing.clear()
        if to is BreakerState.CLOSED:
            self._failed_probes = 0
        if self.metrics is not None:
            self.metrics.state.labels(self.name).set(_GAUGE_VALUE[to])
            self.metrics.transitions.labels(self.name, to.value).inc()
        log.log(logging.WARNING if to is BreakerState.OPEN else logging.INFO,
                "circuit breaker %s: %s -> %s (%s)", self.name, before.value, to.value, reason, extra=extra)


class _Guard:
    """What :meth:`CircuitBreaker.guard` returns: admits the call on entry, records how the block ended on exit."""

    __slots__ = ("_breaker", "_permit")

    def __init__(self, breaker: CircuitBreaker) -> None:
        self._breaker = breaker
        self._permit: _Permit | None = None

    async def __aenter__(self) -> None:
        if self._permit is not None:
            raise RuntimeError("a guard() is entered once; call guard() again for the next call")
        permit = self._breaker._admit()
        if permit is None:
            raise self._breaker._refusal()
        self._permit = permit

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._permit is not None:
            self._breaker._settle(self._permit, self._breaker._verdict(exc))
