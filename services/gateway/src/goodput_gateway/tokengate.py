"""First tokens before later ones: a bound on how many of a stream's later tokens the gateway relays per event-loop
turn (:data:`PER_TURN`).

An engine step ends with a token for every open stream at the same moment. The gateway relays each with a read from
the worker and a write to the caller; one core does them one after another, and an event-loop turn runs everything
that was ready when it began. Without a bound, a turn relays the whole step's tokens (at 128 streams, ~128 writes of
~100 µs), and whatever else became ready meanwhile waits for the next turn: a new request's first token, and each
step of a new request's start (its lease, its worker call), which is where a gateway's added TTFT grows with the
number of streams it relays (``loadtests/reports/relay-floor.md``). The gate lets at most ``per_turn`` later tokens
through per turn and parks the rest, first come first served, for the turns after; a first token never waits, nor
does anything that is not a later token. A later token is late by the turns before its own, a few ms at most, the
same for every token of a stream, so the stream's inter-token latency is unchanged; only the order of work within a
burst changes, not its amount.

    >>> import asyncio
    >>> async def burst() -> list[str]:
    ...     gate, order = TokenGate(per_turn=2), []
    ...     async def later(i: int) -> None:
    ...         await gate.through()
    ...         order.append(f"later-{i}")
    ...     async def first() -> None:
    ...         order.append("first")
    ...     await asyncio.gather(*(later(i) for i in range(5)), first())
    ...     return order
    >>> asyncio.run(burst())
    ['later-0', 'later-1', 'first', 'later-2', 'later-3', 'later-4']
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

__all__ = ["PER_TURN", "TokenGate"]

# Added TTFT p50 at 128 streams +9.0 -> +3.2 ms (gRPC), ITL unchanged; 4 was no better (loadtests/reports/
# token-gate-ab.md, token-gate4-ab.md).
PER_TURN = 8


class TokenGate:
    """At most ``per_turn`` passes per event-loop turn; the rest wait, in order, for the turns after. One per event
    loop (its futures belong to the loop that made them)."""

    __slots__ = ("per_turn", "_passed", "_waiting", "_turn_scheduled", "parked", "_on_park")

    def __init__(self, per_turn: int = PER_TURN, *, on_park: Callable[[], None] | None = None) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self._passed = 0  # passes in the current turn
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._turn_scheduled = False
        self.parked = 0  # passes that had to wait for a later turn
        self._on_park = on_park  # called for each (the gateway's counter)

    def wait(self) -> asyncio.Future[None] | None:
        """None when this turn still has room (go on at once, no await: the common case costs a few attribute
        reads); else a future to await, done in a later turn. Used as ``if (f := gate.wait()) is not None: await f``
        by the hot path, or awaited through :meth:`through`."""
        if not self._waiting and self._passed < self.per_turn:
            self._passed += 1
            self._schedule()
            return None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.parked += 1
        if self._on_park is not None:
            self._on_park()
        self._schedule()
        return future

    async def through(self) -> None:
        """Waits for this turn's room (returns at once where there is some)."""
        future = self.wait()
        if future is not None:
            await future

    def _schedule(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            # runs after everything ready now: the start of the next turn's work
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        self._passed = 0
        waiting = self._waiting
        while waiting and self._passed < self.per_turn:
            future = waiting.popleft()
            if not future.done():  # a cancelled waiter (its request ended) takes no room
                future.set_result(None)
                self._passed += 1
        if waiting or self._passed:
            self._schedule()
