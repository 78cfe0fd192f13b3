"""The token gate: later tokens at most ``per_turn`` per event-loop turn, in order; anything else never waits."""

from __future__ import annotations

import asyncio

import pytest

from goodput_gateway.tokengate import TokenGate


def test_under_the_bound_nothing_waits() -> None:
    async def run() -> int:
        gate = TokenGate(per_turn=4)
        waited = 0
        for _ in range(3):  # one turn, three passes
            if gate.wait() is not None:
                waited += 1
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for _ in range(4):  # a later turn has its own room
            if gate.wait() is not None:
                waited += 1
        return waited + gate.parked

    assert asyncio.run(run()) == 0


def test_a_burst_is_spread_over_turns_in_order_and_first_tokens_go_ahead() -> None:
    """64 later tokens and, arriving after them in the same turn, 4 first tokens: the first tokens are relayed
    after at most `per_turn` later ones, and the later ones keep their order."""

    async def run() -> list[str]:
        gate, order = TokenGate(per_turn=8), []

        async def later(i: int) -> None:
            await gate.through()
            order.append(f"later-{i}")

        async def first(i: int) -> None:
            order.append(f"first-{i}")

        await asyncio.gather(*(later(i) for i in range(64)), *(first(i) for i in range(4)))
        return order

    order = asyncio.run(run())
    assert order[:12] == [f"later-{i}" for i in range(8)] + [f"first-{i}" for i in range(4)]
    assert [o for o in order if o.startswith("later")] == [f"later-{i}" for i in range(64)]


def test_at_most_per_turn_pass_in_any_turn() -> None:
    """Counted per loop turn: each turn runs what was ready when it began, so the passes per turn are what one
    turn's writes can be."""

    async def run() -> list[int]:
        gate = TokenGate(per_turn=5)
        loop = asyncio.get_running_loop()
        per_turn: list[int] = []
        turn = {"n": 0}

        def tick() -> None:  # one callback per turn, counting the passes of the turn before
            per_turn.append(turn["n"])
            turn["n"] = 0
            if len(per_turn) < 40:
                loop.call_soon(tick)

        async def later() -> None:
            await gate.through()
            turn["n"] += 1

        loop.call_soon(tick)
        await asyncio.gather(*(later() for _ in range(50)))
        return per_turn

    counts = asyncio.run(run())
    assert sum(counts) == 50
    assert max(counts) <= 5


def test_a_cancelled_waiter_takes_no_room_and_the_rest_go_on() -> None:
    counted: list[int] = []

    async def run() -> tuple[int, bool]:
        gate = TokenGate(per_turn=1, on_park=lambda: counted.append(1))
        assert gate.wait() is None  # this turn's one pass
        parked = [gate.wait() for _ in range(3)]
        assert all(f is not None for f in parked)
        parked[0].cancel()  # its request ended while it waited
        await asyncio.wait_for(asyncio.gather(parked[1], parked[2]), timeout=2)
        return gate.parked, parked[0].cancelled()

    assert asyncio.run(run()) == (3, True)
    assert len(counted) == 3  # the gateway's counter of parked tokens


def test_a_gate_needs_room() -> None:
    with pytest.raises(ValueError):
        TokenGate(per_turn=0)
