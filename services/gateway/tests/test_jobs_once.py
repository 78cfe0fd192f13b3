"""Deferred jobs run effectively once, against a real Redis: messages are delivered here by calling the Celery task's
body (:func:`run_job`) as a broker would, twice, late, or never, and workers "die" mid-run. A duplicated or
redelivered message runs nothing twice; a lost message is sent again by the sweeper and runs once; a dead worker's
claim lapses and the job runs exactly once more, with one result; a job whose request crashed its inference worker
(goodput_gateway.quarantine) fails instead of being parked again; the counters agree with the jobs after each.
Time passes on the queue's clock (:class:`FakeClock`), moved by the test, not slept through. The same with a real
Celery worker is in test_jobs.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry

from goodput_core.errors import ResourceExhausted, Unauthenticated, Unavailable
from goodput_testing import wait_until

from goodput_gateway.auth import ApiKeyStore, parse_keys_document
from goodput_gateway.config import GatewaySettings
from goodput_gateway.jobs.parking import Parked, park
from goodput_gateway.jobs.records import STATES, TERMINAL, Job
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.quarantine import Quarantined
from goodput_gateway.requests import GenerationRequest, Message
from goodput_gateway.worker import Sweeper, run_job

from .helpers import FakeClock

LEASE_S = 0.4
LOST_AFTER_S = 30.0


class Broker:
    """Records the messages a queue sends; a test delivers them (in any order, any number of times) or loses them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, float]] = []
        self.lose = False

    def send(self, job_id: str, dispatch: int, delay_s: float) -> None:
        if not self.lose:
            self.sent.append((job_id, dispatch, delay_s))

    def last(self, job_id: str) -> int:
        return [d for j, d, _ in self.sent if j == job_id][-1]


class Runs:
    """The attempt's work (the gateway's pipeline in a worker): counts runs, answers, or fails as told; with
    ``held``, each run waits until the test sets ``release`` (a long generation)."""

    def __init__(self) -> None:
        self.count = 0
        self.held = False
        self.release = threading.Event()
        self.fail: list[BaseException] = []
        self.lock = threading.Lock()
        self.tenants: list[str] = []  # whose job each run was, in order

    def __call__(self, job: Job) -> dict[str, Any]:
        with self.lock:
            self.count += 1
            n = self.count
            self.tenants.append(job.tenant)
        if self.held:
            assert self.release.wait(timeout=10), "the test never released the run"
        if self.fail:
            raise self.fail.pop(0)
        return {"object": "chat.completion", "run": n}


class WorkerDied(BaseException):
    """The worker process is gone mid-run: nothing after this line of its code runs (not even an except Exception)."""


@pytest.fixture
def broker() -> Broker:
    return Broker()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(time.time())  # wall time: the job keys' TTLs in Redis are computed from it


@pytest.fixture
def queue(redis_url: str, redis_prefix: str, broker: Broker, clock: FakeClock) -> Iterator[JobQueue]:
    settings = GatewaySettings(redis_url=redis_url, jobs={"prefix": redis_prefix, "lease_s": LEASE_S,
                                                          "lost_after_s": LOST_AFTER_S, "retry_base_s": 0.1,
                                                          "retry_cap_s": 0.2},
                                quotas={"prefix": f"{redis_prefix}:quota"})  # the storage ledger's keys too
    client = redis.Redis.from_url(redis_url)
    yield JobQueue(settings, client, registry=CollectorRegistry(), send=broker.send, clock=clock)
    client.close()


def submit(queue: JobQueue, tenant: str = "acme", **kw: Any) -> Job:
    return queue.submit(tenant=tenant, route="chat", body={"messages": [{"role": "user", "content": "hi"}]}, **kw)


def assert_consistent(queue: JobQueue, *job_ids: str) -> None:
    """Every job is in the index of its state and no other, unfinished ones are due by their deadline, and the
    attempts counted by outcome are the attempts that have ended."""
    ended = 0
    for job_id in job_ids:
        job = queue.load(job_id)
        assert job is not None
        indexes = [s for s in STATES if queue.redis.zscore(queue._index(s), job_id) is not None]  # noqa: SLF001
        assert indexes == [job.state], (job_id, indexes, job.state)
        assert (queue.redis.zscore(queue._deadlines, job_id) is not None) == (job.state not in TERMINAL)  # noqa: SLF001
        ended += job.attempts - (1 if job.state == "running" else 0)
    assert sum(queue.count(s) for s in STATES) == len(job_ids)
    assert sum(queue.attempts().values()) == ended


def test_a_message_delivered_twice_runs_the_job_once(queue: JobQueue, broker: Broker) -> None:
    runs = Runs()
    runs.held = True
    job = submit(queue)
    [(job_id, dispatch, _)] = broker.sent
    # The same message delivered four times at once (a broker's redelivery racing the first delivery): one claims.
    barrier = threading.Barrier(4)
    outcomes: list[Job | None] = []

    def deliver() -> None:
        barrier.wait()
        outcomes.append(run_job(queue, job_id, runner=runs, dispatch=dispatch))

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(outcomes) == 3, timeout=10)  # the three that lost the race returned while one runs
    runs.release.set()
    for t in threads:
        t.join()
    assert runs.count == 1
    done = queue.load(job.id)
    assert done is not None and done.state == "completed" and done.attempts == 1 and done.result == {
        "object": "chat.completion", "run": 1}
    # ... and once more after it finished: nothing runs, the result stays.
    assert run_job(queue, job_id, runner=runs, dispatch=dispatch) == done
    assert runs.count == 1 and queue.load(job.id) == done
    assert queue.tally("messages") == {"claimed": 1, "duplicate": 4}
    assert queue.attempts() == {"completed": 1}
    assert queue.count("completed") == 1 and queue.count("running") == 0
    assert queue.metrics.transitions.labels("completed")._value.get() == 1  # noqa: SLF001 - one transition
    assert_consistent(queue, job.id)


def test_a_lost_message_is_sent_again_by_the_sweeper_and_runs_once(queue: JobQueue, broker: Broker,
                                                                   clock: FakeClock) -> None:
    runs = Runs()
    broker.lose = True  # stored, but its message never reaches the broker
    job = submit(queue)
    broker.lose = False
    assert broker.sent == [] and queue.load(job.id).state == "queued"  # type: ignore[union-attr]
    assert queue.sweep() == {}  # not overdue yet: a message in a long queue is not taken for lost
    clock.advance(LOST_AFTER_S + 1)
    assert queue.sweep() == {"lost_message": 1}
    [(job_id, dispatch, delay)] = broker.sent
    assert (job_id, dispatch, delay) == (job.id, 1, 0.0)
    run_job(queue, job_id, runner=runs, dispatch=dispatch)
    # the first message was only late after all, and arrives too: nothing runs twice
    assert run_job(queue, job.id, runner=runs, dispatch=1) is not None
    assert runs.count == 1
    done = queue.load(job.id)
    assert done is not None and done.state == "completed" and done.attempts == 1
    clock.advance(LOST_AFTER_S + 1)
    assert queue.sweep() == {}  # finished: nothing to recover
    assert queue.tally("recoveries") == {"lost_message": 1}
    assert queue.tally("messages") == {"claimed": 1, "duplicate": 1}
    assert queue.attempts() == {"completed": 1}
    assert_consistent(queue, job.id)


def test_a_parked_jobs_lost_message_is_recovered_and_old_messages_are_stale(queue: JobQueue, broker: Broker,
                                                                           clock: FakeClock) -> None:
    runs = Runs()
    runs.fail = [ResourceExhausted("scheduler queue is full", code="queue_full", retry_after_s=0.1)]
    job = submit(queue)
    broker.lose = True  # the parked attempt's message (dispatch 2) is lost
    parked = run_job(queue, job.id, runner=runs, dispatch=1)
    broker.lose = False
    assert parked is not None and parked.state == "parked" and parked.dispatch == 2
    # a copy of dispatch 1's message turns up: stale, the job waits for its second dispatch
    assert run_job(queue, job.id, runner=runs, dispatch=1) is not None and runs.count == 1
    clock.advance(LOST_AFTER_S + 1)
    assert queue.sweep() == {"lost_message": 1}
    assert broker.sent[-1] == (job.id, 2, 0.0)
    done = run_job(queue, job.id, runner=runs, dispatch=2)
    assert done is not None and done.state == "completed" and done.attempts == 2 and runs.count == 2
    assert queue.attempts() == {"parked": 1, "completed": 1}
    assert queue.tally("messages") == {"claimed": 2, "stale": 1}
    assert_consistent(queue, job.id)


def test_a_worker_that_dies_mid_run_lets_its_claim_lapse_and_the_job_runs_once_more(
        queue: JobQueue, broker: Broker, clock: FakeClock) -> None:
    runs = Runs()
    job = submit(queue)
    runs.fail = [WorkerDied()]
    with pytest.raises(WorkerDied):  # the first worker dies mid-run: its claim is never released
        run_job(queue, job.id, runner=runs, dispatch=1)
    orphan = queue.load(job.id)
    assert orphan is not None and orphan.state == "running" and orphan.claim
    assert_consistent(queue, job.id)
    # While its lease runs, nothing takes the job: not the sweeper, not a copy of the message.
    assert queue.sweep() == {}
    assert run_job(queue, job.id, runner=runs, dispatch=1) is not None and runs.count == 1
    clock.advance(LEASE_S + 0.1)
    assert queue.sweep() == {"lease_expired": 1}  # lapsed: queued again under a new dispatch
    assert broker.sent[-1] == (job.id, 2, 0.0)
    assert queue.attempts() == {"lost": 1}
    assert_consistent(queue, job.id)
    # Redis redelivers the dead worker's message later: a message is a turn, so it runs the job's new dispatch (the
    # next queued job); the new dispatch's own message then finds it done.
    run_job(queue, job.id, runner=runs, dispatch=1)
    done = run_job(queue, job.id, runner=runs, dispatch=2)
    assert done is not None and done.state == "completed" and done.attempts == 2 and runs.count == 2
    assert done.result == {"object": "chat.completion", "run": 2}
    # The first worker was only frozen, not dead, and ends its attempt now: refused; the result stays the one.
    stored, written = queue.finish(orphan, "completed", result={"object": "chat.completion", "run": 1})
    assert not written and stored is not None and stored.result == done.result
    assert queue.attempts() == {"lost": 1, "completed": 1}
    assert queue.tally("recoveries") == {"lease_expired": 1}
    assert queue.tally("messages") == {"claimed": 2, "duplicate": 2}
    assert_consistent(queue, job.id)


def test_a_redelivered_message_takes_over_a_dead_workers_lapsed_claim(queue: JobQueue, broker: Broker,
                                                                      clock: FakeClock) -> None:
    runs = Runs()
    job = submit(queue)
    runs.fail = [WorkerDied()]
    with pytest.raises(WorkerDied):
        run_job(queue, job.id, runner=runs, dispatch=1)
    clock.advance(LEASE_S + 0.1)
    # Celery's redelivery of the unacknowledged message comes before the sweeper does: it claims the job afresh.
    done = run_job(queue, job.id, runner=runs, dispatch=1)
    assert done is not None and done.state == "completed" and done.attempts == 2 and runs.count == 2
    assert queue.sweep() == {}
    assert queue.attempts() == {"lost": 1, "completed": 1}
    assert queue.tally("recoveries") == {"lease_expired": 1}
    assert_consistent(queue, job.id)


def test_a_live_worker_keeps_its_claim_past_the_lease(queue: JobQueue, broker: Broker, clock: FakeClock) -> None:
    runs = Runs()
    runs.held = True  # a long generation: its heartbeat renews the lease
    job = submit(queue)
    worker = threading.Thread(target=run_job, args=(queue, job.id), kwargs={"runner": runs, "dispatch": 1})
    worker.start()
    wait_until(lambda: queue.load(job.id).state == "running", timeout=10)  # type: ignore[union-attr]
    for _ in range(4):  # four times most of a lease: each time its heartbeat renews it from the new time
        clock.advance(LEASE_S * 0.75)
        wait_until(lambda: queue.load(job.id).lease_until == clock.now + LEASE_S, timeout=10,  # type: ignore[union-attr]
                   message="the heartbeat did not renew the lease")
        assert queue.sweep() == {}  # meanwhile the sweeper and copies of the message find the claim live
        run_job(queue, job.id, runner=runs, dispatch=1)
    runs.release.set()
    worker.join()
    done = queue.load(job.id)
    assert done is not None and done.state == "completed" and done.attempts == 1 and runs.count == 1
    assert queue.attempts() == {"completed": 1} and queue.tally("recoveries") == {}
    assert_consistent(queue, job.id)


def test_the_sweeper_expires_jobs_past_their_deadline(queue: JobQueue, broker: Broker, clock: FakeClock) -> None:
    runs = Runs()
    soon = clock.now + 0.3
    queued = submit(queue, deadline_at=soon)
    parked = submit(queue, deadline_at=soon, delay_s=5.0)
    running = submit(queue, deadline_at=soon)
    runs.fail = [WorkerDied()]
    with pytest.raises(WorkerDied):
        run_job(queue, running.id, runner=runs, dispatch=1)
    alive = submit(queue, deadline_at=soon)
    runs.held = True
    worker = threading.Thread(target=run_job, args=(queue, alive.id), kwargs={"runner": runs, "dispatch": 1})
    worker.start()
    wait_until(lambda: queue.load(alive.id).state == "running", timeout=10)  # type: ignore[union-attr]
    clock.advance(0.6)  # past the deadline, and past the dead worker's lease; the live one's heartbeat renews its own
    wait_until(lambda: queue.load(alive.id).lease_until == clock.now + LEASE_S, timeout=10)  # type: ignore[union-attr]
    # Three expire (the dead worker's attempt counted lost); the live attempt past its deadline may finish.
    assert queue.sweep() == {"deadline": 3}
    for job in (queued, parked, running):
        expired = queue.load(job.id)
        assert expired is not None and expired.state == "expired" and "deadline" in expired.error
    runs.release.set()
    worker.join()
    assert queue.load(alive.id).state == "completed"  # type: ignore[union-attr]
    # their messages arrive later: nothing runs
    for job in (queued, parked, running):
        run_job(queue, job.id, runner=runs, dispatch=1)
    assert runs.count == 2
    assert queue.count("expired") == 3 and queue.redis.zcard(queue._deadlines) == 0  # noqa: SLF001
    assert queue.tally("recoveries") == {"deadline": 3}
    assert queue.attempts() == {"lost": 1, "completed": 1}
    assert_consistent(queue, queued.id, parked.id, running.id, alive.id)


def test_one_sweep_per_interval_over_every_worker(queue: JobQueue, broker: Broker) -> None:
    a, b = Sweeper(queue, interval_s=0.3), Sweeper(queue, interval_s=0.3)
    assert a.sweep_once() == {} and b.sweep_once() is None  # b's turn is taken this interval
    # the turn is a key that Redis expires after the interval, by Redis's own clock: b waits for it
    wait_until(lambda: b.sweep_once() == {}, timeout=5, interval=0.05, message="b never got a turn")


def test_the_counters_are_exported_from_redis(queue: JobQueue, broker: Broker) -> None:
    runs = Runs()
    job = submit(queue)
    run_job(queue, job.id, runner=runs, dispatch=1)
    run_job(queue, job.id, runner=runs, dispatch=1)
    registry = CollectorRegistry()
    from goodput_gateway.jobs.metrics import JobsMetrics

    JobsMetrics(registry, queue, scrape_wait_s=2.0)
    sample = registry.get_sample_value
    assert sample("goodput_gateway_deferred_jobs", {"state": "completed"}) == 1
    assert sample("goodput_gateway_deferred_job_attempts_total", {"outcome": "completed"}) == 1
    assert sample("goodput_gateway_deferred_job_attempts_total", {"outcome": "lost"}) == 0
    assert sample("goodput_gateway_deferred_job_messages_total", {"verdict": "duplicate"}) == 1
    assert sample("goodput_gateway_deferred_job_recoveries_total", {"reason": "lost_message"}) == 0


def test_cancelling_a_batch_line_never_touches_a_running_one(queue: JobQueue, broker: Broker) -> None:
    runs = Runs()
    waiting, started = submit(queue), submit(queue)
    runs.fail = [WorkerDied()]
    with pytest.raises(WorkerDied):
        run_job(queue, started.id, runner=runs, dispatch=1)
    assert queue.cancel(waiting.id).state == "failed"  # type: ignore[union-attr]
    assert queue.cancel(started.id).state == "running"  # type: ignore[union-attr]
    assert run_job(queue, waiting.id, runner=runs, dispatch=1).state == "failed"  # type: ignore[union-attr]
    assert runs.count == 1
    assert_consistent(queue, waiting.id, started.id)


@pytest.mark.parametrize("weight_b,within", [(1.0, 20), (3.0, 14)])
def test_a_tenants_backlog_delays_another_tenants_few_jobs_by_about_as_many(queue: JobQueue, broker: Broker,
                                                                           weight_b: float, within: int) -> None:
    """Tenant A has 300 lines queued (their messages first in the broker's FIFO), B then queues 10: the messages are
    turns taken in weighted fair order, so B's ten finish within the next 20 runs (weights 1:1; 10 + 10/3 with
    weight 3), however long A's backlog. Then every job runs exactly once, delivered by four workers at once."""
    runs = Runs()
    a = [submit(queue, tenant="a").id for _ in range(300)]
    for job_id, dispatch, _ in broker.sent[:50]:  # A's batch has been running for a while
        run_job(queue, job_id, runner=runs, dispatch=dispatch)
    b = [submit(queue, tenant="b", weight=weight_b).id for _ in range(10)]
    pending = broker.sent[50:]  # A's 250 remaining messages, then B's ten
    for job_id, dispatch, _ in pending[:within]:
        run_job(queue, job_id, runner=runs, dispatch=dispatch)
    assert runs.tenants[50:].count("b") == 10, runs.tenants[50:]
    assert all(queue.load(j).state == "completed" for j in b)  # type: ignore[union-attr]

    rest = iter(pending[within:])
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                message = next(rest, None)
            if message is None:
                return
            run_job(queue, message[0], runner=runs, dispatch=message[1])

    workers = [threading.Thread(target=worker) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert runs.count == 310 and queue.count("completed") == 310
    assert queue.tally("messages") == {"claimed": 310}
    assert_consistent(queue, *a, *b)


def test_a_parked_request_remembers_its_key_and_waits_its_tenants_turn(queue: JobQueue, broker: Broker) -> None:
    keys = ApiKeyStore(parse_keys_document("inline", {"tenants": {"acme": {"weight": 2}}, "keys": [
        {"id": "acme-ci", "key": "k-1", "tenant": "acme", "max_priority": "P2", "rpm": 5}]}))
    principal = keys.authenticate("Bearer k-1")
    shed = ResourceExhausted("scheduler queue is full", code="queue_full", retry_after_s=0.1)
    request = GenerationRequest(messages=(Message("user", "hi"),), priority=types_pb2.PRIORITY_P2)
    parked = asyncio.run(park(queue, shed, tenant="acme", request=request, principal=principal))
    assert isinstance(parked, Parked)
    job = queue.load(parked.job_id)
    assert job is not None and job.state == "parked" and (job.key, job.weight) == ("acme-ci", 2.0)
    [(job_id, dispatch, delay)] = broker.sent
    assert delay > 0 and queue.take() is None  # not queued before its retry time
    runs = Runs()
    done = run_job(queue, job_id, runner=runs, dispatch=dispatch)  # its message comes: queued, taken, run
    assert done is not None and done.state == "completed" and runs.count == 1
    # the worker runs it as that key, as the keys file says now: with its own limits, or not at all once revoked
    again = keys.key_principal("acme-ci", tenant="acme", priority=types_pb2.PRIORITY_P2)
    assert (again.key_id, again.key_quota.rpm, again.max_priority) == ("acme-ci", 5, types_pb2.PRIORITY_P2)
    keys.replace([])
    with pytest.raises(Unauthenticated, match="revoked"):
        keys.key_principal("acme-ci", tenant="acme", priority=types_pb2.PRIORITY_P2)


def test_a_worker_that_dies_between_taking_and_claiming_loses_no_job(queue: JobQueue, broker: Broker,
                                                                      clock: FakeClock) -> None:
    runs = Runs()
    job = submit(queue)
    assert queue.take() == (job.id, 1)  # a worker takes the job from its tenant's turns, then dies
    assert queue.take() is None and queue.load(job.id).state == "queued"  # type: ignore[union-attr]
    clock.advance(LOST_AFTER_S + 1)
    assert queue.sweep() == {"lost_message": 1}  # its message is sent again, and the job gets its place back
    assert len(broker.sent) == 2 and queue.redis.zcard(queue._ready("acme")) == 1  # noqa: SLF001
    for job_id, dispatch, _ in broker.sent:  # both copies of its message arrive: it runs once
        run_job(queue, job_id, runner=runs, dispatch=dispatch)
    done = queue.load(job.id)
    assert done is not None and done.state == "completed" and runs.count == 1
    assert_consistent(queue, job.id)



def test_a_forged_job_ahead_in_the_fair_order_does_not_spend_another_jobs_message(queue: JobQueue,
                                                                                  broker: Broker) -> None:
    """A record written without the jobs' key (or gone) that waits in a tenant's turn is deleted unrun, and the
    message that took it goes on to the next job: the sealed job behind it still runs on its own message."""
    runs = Runs()
    forged = submit(queue, tenant="early")
    raw = json.loads(queue.redis.get(queue.key(forged.id)))
    queue.redis.set(queue.key(forged.id), json.dumps({**raw, "mac": "0" * 64}))  # its tenant's turn comes first
    job = submit(queue, tenant="late")
    done = run_job(queue, job.id, runner=runs, dispatch=broker.last(job.id))
    assert done is not None and done.id == job.id and done.state == "completed" and runs.tenants == ["late"]
    assert queue.redis.get(queue.key(forged.id)) is None
    assert queue.tally("messages") == {"forged": 1, "claimed": 1}


def test_a_job_whose_request_crashed_its_worker_fails_and_is_not_parked_again(queue: JobQueue,
                                                                                broker: Broker) -> None:
    runs = Runs()
    runs.fail = [Unavailable("the inference worker failed mid-stream (unavailable)"),  # lost among others
                 Quarantined("the inference worker serving this request failed while it held it alone",
                             code="request_quarantined", retry_after_s=600.0)]
    job = submit(queue)
    parked = run_job(queue, job.id, runner=runs, dispatch=1)
    assert parked is not None and parked.state == "parked"  # an outage: tried again later
    failed = run_job(queue, job.id, runner=runs, dispatch=2)
    assert failed is not None and failed.state == "failed" and failed.error.startswith("Quarantined:")
    assert [d for j, d, _ in broker.sent if j == job.id] == [1, 2]  # no third attempt is sent
    assert_consistent(queue, job.id)
