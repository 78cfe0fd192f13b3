"""Leader election (goodput_scheduler.leader): one replica leads at a time; it steps down when its lock is taken or
cannot be renewed in time; a stopped leader frees the lock so a standby takes over at once, a crashed one after the
lock's time to live. The Redis lock runs against the real Redis; the Kubernetes Lease against the kube-apiserver
stand-in (goodput_testing.KubeApiStandIn: no API server can run here), through the official client."""

from __future__ import annotations

import asyncio
import time

import pytest

from goodput_testing import KubeApiStandIn, async_wait_until

from goodput_scheduler.leader import KubernetesLease, LeaderElector, RedisLock


class Candidate:
    """A replica's elector with its transitions recorded."""

    def __init__(self, election: object, *, ttl_s: float = 1.0, renew_s: float = 0.2, retry_s: float = 0.1) -> None:
        self.events: list[str] = []
        self.elector = LeaderElector(election, ttl_s=ttl_s, renew_s=renew_s, retry_s=retry_s,  # type: ignore[arg-type]
                                     on_elected=self._elected, on_lost=self._lost)

    async def _elected(self) -> None:
        self.events.append("elected")

    async def _lost(self) -> None:
        self.events.append("lost")

    @property
    def leader(self) -> bool:
        return self.elector.leader


class Flaky:
    """An election whose store can fail (raise) or be taken by someone else (False)."""

    def __init__(self) -> None:
        self.mode = "ok"  # ok | down | taken

    async def acquire(self) -> bool:
        return await self.renew()

    async def renew(self) -> bool:
        if self.mode == "down":
            raise ConnectionError("store unreachable")
        return self.mode == "ok"

    async def release(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_leader_steps_down_when_its_lock_is_taken_or_cannot_be_renewed_in_time() -> None:
    store = Flaky()
    c = Candidate(store, ttl_s=1.0, renew_s=0.2)
    await c.elector.start()
    await async_wait_until(lambda: c.leader, timeout=5)
    store.mode = "taken"  # someone else holds it: step down at the next renewal
    await async_wait_until(lambda: not c.leader, timeout=5)
    store.mode = "ok"
    await async_wait_until(lambda: c.leader, timeout=5)
    # the store is unreachable: it keeps leading while its lock may still be valid, and steps down before the TTL
    store.mode = "down"
    started = time.monotonic()
    await async_wait_until(lambda: not c.leader, timeout=5)
    assert 0.5 <= time.monotonic() - started < 1.0
    await c.elector.stop()
    assert c.events == ["elected", "lost", "elected", "lost"]


async def test_no_election_means_always_the_leader() -> None:
    c = Candidate(None)
    await c.elector.start()
    assert c.leader and c.events == ["elected"]
    await c.elector.stop()
    assert c.events == ["elected", "lost"]


async def test_one_redis_lock_one_leader_and_failover(redis_url: str, redis_prefix: str) -> None:
    key = f"{redis_prefix}:leader"
    a, b = (Candidate(RedisLock(redis_url, key=key, me=name, ttl_s=1.0)) for name in ("a", "b"))
    await a.elector.start()
    await async_wait_until(lambda: a.leader, timeout=5)
    await b.elector.start()
    await asyncio.sleep(0.5)
    assert not b.leader  # a renews: b stays a standby
    # a stops (a rolling update): it frees the lock, b leads within a retry interval
    started = time.monotonic()
    await a.elector.stop()
    await async_wait_until(lambda: b.leader, timeout=5)
    assert time.monotonic() - started < 0.5
    # b crashes (its task dies, the lock is not freed): a new candidate leads once the TTL has passed
    assert b.elector._task is not None  # noqa: SLF001
    b.elector._task.cancel()  # noqa: SLF001 - a crash: no release
    c = Candidate(RedisLock(redis_url, key=key, me="c", ttl_s=1.0))
    started = time.monotonic()
    await c.elector.start()
    await async_wait_until(lambda: c.leader, timeout=5)
    assert 0.5 < time.monotonic() - started < 2.0
    await c.elector.stop()
    await b.elector.election.close()  # type: ignore[union-attr]


async def test_kubernetes_lease_one_leader_conflicts_and_failover() -> None:
    api = KubeApiStandIn()
    await api.start()
    try:
        def candidate(name: str) -> Candidate:
            return Candidate(KubernetesLease(namespace="goodput", name="goodput-scheduler", me=name, ttl_s=1.0,
                                             api_url=api.url))

        a, b = candidate("a"), candidate("b")
        await a.elector.start()
        await b.elector.start()
        await async_wait_until(lambda: a.leader or b.leader, timeout=5)
        await asyncio.sleep(0.6)
        assert a.leader != b.leader  # exactly one
        leader, standby = (a, b) if a.leader else (b, a)
        lease = api.leases[("goodput", "goodput-scheduler")]
        assert lease["spec"]["holderIdentity"] == ("a" if leader is a else "b")
        assert lease["spec"]["leaseDurationSeconds"] == 1
        # the leader stops: it empties the Lease and the standby takes it at once
        started = time.monotonic()
        await leader.elector.stop()
        await async_wait_until(lambda: standby.leader, timeout=5)
        assert time.monotonic() - started < 0.6
        assert api.leases[("goodput", "goodput-scheduler")]["spec"]["leaseTransitions"] >= 1
        # the API server goes away: the leader steps down before its Lease could expire for anyone else
        api.outage = True
        await async_wait_until(lambda: not standby.leader, timeout=5)
        api.outage = False
        await async_wait_until(lambda: standby.leader, timeout=5)
        await standby.elector.stop()
    finally:
        await api.stop()


async def test_a_stale_write_loses_the_race_for_an_expired_lease() -> None:
    """Two candidates read the same expired Lease; the replace at the version both read succeeds once."""
    api = KubeApiStandIn()
    await api.start()
    try:
        first = KubernetesLease(namespace="ns", name="l", me="first", ttl_s=1.0, api_url=api.url)
        assert await first.acquire()
        api.leases[("ns", "l")]["spec"]["renewTime"] = "2000-01-01T00:00:00+00:00"  # long expired
        x = KubernetesLease(namespace="ns", name="l", me="x", ttl_s=1.0, api_url=api.url)
        y = KubernetesLease(namespace="ns", name="l", me="y", ttl_s=1.0, api_url=api.url)
        results = await asyncio.gather(x.acquire(), y.acquire())
        assert sorted(results) == [False, True]
        for e in (first, x, y):
            await e.close()
    finally:
        await api.stop()


@pytest.mark.parametrize("renew_s", [1.0, 2.0])
def test_the_renew_interval_must_be_shorter_than_the_ttl(renew_s: float) -> None:
    with pytest.raises(ValueError):
        LeaderElector(Flaky(), ttl_s=1.0, renew_s=renew_s, retry_s=0.1, on_elected=_noop, on_lost=_noop)


async def _noop() -> None:
    pass
