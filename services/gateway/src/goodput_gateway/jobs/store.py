"""Jobs in Redis, run effectively once.

A job's message is delivered at least once (Celery acknowledges late; Redis redelivers what a dead worker held) and
may be lost (a crash between storing a job and sending its message, a broker that lost writes). Every change of a
job is a compare-and-set on its key (``WATCH``/``MULTI``: read, decide, write the job with its indexes and counters
in one transaction, retried when another writer got in between), so:

* **Claim.** An attempt starts only by moving the job from ``queued``/``parked`` to ``running`` with a fresh claim
  (a fencing token) and a lease (``job_lease_s``, renewed while the attempt runs). A message that finds the job
  running under a live lease, finished, or waiting for a later *dispatch* (each hand-over to the queue has a number,
  and a message carries it) does nothing: a redelivered or duplicated message runs nothing twice.
* **Finish.** The attempt's outcome (completed with its result, parked again, failed) is written only while the
  job still holds that claim: a worker that lost it (its lease ran out) cannot overwrite the result of the attempt
  that replaced it, nor count its own.
* **Sweep** (:meth:`JobQueue.sweep`, run by one jobs worker at a time): a job whose message is overdue by
  ``job_lost_after_s`` is sent again (the copy that arrives first runs it); a running job whose lease ran out (its
  worker died) is queued again under a new dispatch; a job past its deadline expires.

Keys, under ``jobs_prefix`` (``<p>``):

* ``<p>:job:<id>``: the job (JSON), kept ``job_result_ttl_s`` past its deadline;
* ``<p>:index:<state>``: a sorted set per state, written in the same transaction as the job: waiting jobs scored by
  when their message is due, running ones by when their lease ends, finished ones by when their key expires. They
  are what the gauges count and what the sweeper reads;
* ``<p>:deadlines``: unfinished jobs by deadline;
* ``<p>:batch:<id>:ended``: a batch's lines that have ended, by outcome (``completed``, ``failed``), counted in the
  transaction that ends each, so a batch's status is read in one step, not from its 10,000 jobs;
* ``<p>:attempts`` (by outcome), ``<p>:messages`` (by verdict), ``<p>:recoveries`` (by reason): counters every
  process adds to.

**Fair order.** Jobs that wait their turn do not share one FIFO: each tenant's queued jobs sit in their own sorted set
(``<p>:ready:<tenant>``, ``<id>:<dispatch>`` in the order they were queued), written in the same transaction as the
job, and the tenants take turns by start-time fair queuing with the tenant's weight (the keys file's, as the
scheduler's live queues use): ``<p>:turns`` holds each tenant with waiting jobs scored by its virtual start, a tenant
served moves on by ``1 / weight``, and one that comes back from idle starts at the virtual time now (what it did not
use while idle is not saved up). A job's message is a turn, not an order: the worker that receives it takes the next
job in fair order (:meth:`JobQueue.take`, one Lua script, so several workers never take the same one) -- its own job
when its tenant's turn has come -- and claims that. A parked job joins its tenant's turns when its message arrives
(:meth:`JobQueue.wake`). Every waiting job has a message still to come, so every one gets a turn; a worker that dies
between taking and claiming leaves its job queued without a place, which the sweeper's resend (a lost message)
puts back, as before. So tenant A's 10,000 queued lines delay tenant B's ten by about ten of A's, not by 10,000:
A has run some lines when B queues ten; the next turns go B A B A ... (B A with weight 1 each; B B B A with B's
weight 3) until B's ten are done, then A's remaining lines.

Example (with a Redis at ``settings.redis_url``)::

    queue = JobQueue(settings, redis.Redis.from_url(settings.redis_url))
    job = queue.submit(tenant="acme", route="chat", body={"messages": [...]})
    queue.get(job.id, tenant="acme").state    # 'queued'
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry
from redis.exceptions import WatchError

from goodput_core.errors import InvalidArgument, NotFound, Unavailable

from goodput_gateway.jobs.messages import Send, celery_send
from goodput_gateway.jobs.metrics import JobsMetrics
from goodput_gateway.jobs.records import ENDPOINTS, STATES, TERMINAL, WAITING, Job, Seal
from goodput_gateway.storage import DEFAULT_STORAGE, StorageLedger, StorageQuota, storage_prefix

__all__ = ["JobQueue"]

log = logging.getLogger("goodput.gateway.jobs")

CAS_TRIES = 20


class JobQueue:
    """Jobs in Redis and their messages. ``send`` sends a job's message (default: the Celery task of
    :mod:`.worker`); a message that could not be sent is sent again by the sweeper."""

    def __init__(self, settings: Any, redis_client: Any, *, registry: CollectorRegistry | None = None,
                 send: Send | None = None, clock: Callable[[], float] = time.time,
                 ledger: StorageLedger | None = None) -> None:
        self.settings = settings
        self.redis = redis_client
        self.seal = Seal.of(settings)
        # the tenants' storage ledger: on the quota Redis where the gateway has one, else beside the jobs
        self.ledger = ledger or StorageLedger(redis_client, prefix=storage_prefix(settings))
        self.clock = clock  # wall time: deadlines, leases and due times are stored and compared across processes
        self.prefix = settings.jobs.prefix
        self._deadlines = f"{self.prefix}:deadlines"  # unfinished jobs by deadline
        self._turns = [f"{self.prefix}:turns{part}" for part in ("", ":clock", ":finish", ":weight")]
        self._join = redis_client.register_script(_JOIN)
        self._take = redis_client.register_script(_TAKE)
        self._send = send or celery_send(settings)
        self.metrics = JobsMetrics(registry, self)

    # ---- keys and counters ----
    def key(self, job_id: str) -> str:
        """Where a job's record is stored."""
        return f"{self.prefix}:job:{job_id}"

    def _index(self, state: str) -> str:
        return f"{self.prefix}:index:{state}"

    def count(self, state: str) -> int:
        """Jobs in ``state`` (finished ones until their key expires)."""
        return int(self.redis.zcard(self._index(state)))

    def tally(self, name: str) -> dict[str, int]:
        """A shared counter: ``attempts`` (by outcome), ``messages`` (by verdict), ``recoveries`` (by reason)."""
        raw = self.redis.hgetall(f"{self.prefix}:{name}")
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    def attempts(self) -> dict[str, int]:
        """Attempts ever ended per outcome (completed, parked, failed, lost), over every worker."""
        return self.tally("attempts")

    # ---- reads ----
    def load(self, job_id: str) -> Job | None:
        return self.open(self.redis.get(self.key(job_id)))

    def open(self, raw: str | bytes | None) -> Job | None:
        """A stored job record, or None: none, or one whose MAC does not verify (not written by a gateway or a jobs
        worker: it is never run nor shown)."""
        record = None if raw is None else self.seal.open(raw)
        return None if record is None else Job.from_record(record)

    def get(self, job_id: str, *, tenant: str) -> Job:
        job = self.load(job_id)
        if job is None or job.tenant != tenant:
            raise NotFound(f"no job {job_id!r}", param="job_id", code="job_not_found")
        return job

    # ---- writes: every one a compare-and-set ----
    def _write(self, pipe: Any, job: Job, *, old: Job | None, count: tuple[str, str] | None = None) -> None:
        """Queues the writes of ``job`` (and of its indexes and counters) on ``pipe``, inside its MULTI."""
        now = self.clock()
        job.updated_at = now
        ttl = max(int(max(job.deadline_at - now, 0) + self.settings.jobs.result_ttl_s), 60)
        pipe.set(self.key(job.id), self.seal.seal(asdict(job)), ex=ttl)
        if old is not None and old.state != job.state:
            pipe.zrem(self._index(old.state), job.id)
        score = now + ttl if job.state in TERMINAL else job.lease_until if job.state == "running" else job.due_at
        pipe.zadd(self._index(job.state), {job.id: score})
        if job.state in TERMINAL:
            pipe.zrem(self._deadlines, job.id)
        else:
            pipe.zadd(self._deadlines, {job.id: job.deadline_at})
        if old is not None and old.state == "running" and (job.state != "running" or job.claim != old.claim):
            # The attempt under old.claim has ended: with the state it wrote, or lost (the claim lapsed).
            outcome = job.state if job.state in ("completed", "parked", "failed") else "lost"
            pipe.hincrby(f"{self.prefix}:attempts", outcome, 1)
        if count is not None:
            pipe.hincrby(f"{self.prefix}:{count[0]}", count[1], 1)
        if job.batch and job.state in TERMINAL and (old is None or old.state not in TERMINAL):
            pipe.hincrby(self.batch_ended(job.batch), "completed" if job.state == "completed" else "failed", 1)
            pipe.expire(self.batch_ended(job.batch), ttl)  # as long as the line's job, and so its batch, is kept
        if old is not None and old.state == "queued" and (job.state, job.dispatch) != ("queued", old.dispatch):
            pipe.zrem(self._ready(old.tenant), f"{old.id}:{old.dispatch}")  # taken, cancelled or expired
        if job.state == "queued":  # waits its tenant's turn (a place it holds already is kept)
            self._join(keys=[self._ready(job.tenant), *self._turns],
                       args=[job.tenant, f"{job.id}:{job.dispatch}", job.due_at, job.weight], client=pipe)

    def batch_ended(self, batch_id: str) -> str:
        """Where the lines of batch ``batch_id`` that have ended are counted, by outcome (a hash)."""
        return f"{self.prefix}:batch:{batch_id}:ended"

    def _ready(self, tenant: str) -> str:
        return f"{self.prefix}:ready:{tenant}"

    def take(self, *, prefer: tuple[str, str, int] = ("", "", 0)) -> tuple[str, int] | None:
        """The next queued job in weighted fair order across tenants, taken from its place: (job id, dispatch);
        ``prefer`` (a message's own job: tenant, job id, dispatch) when its tenant's turn is next and it is queued
        under that dispatch. None: nothing waits."""
        tenant, job_id, dispatch = prefer
        taken = self._take(keys=self._turns, args=[self._ready(""), tenant, f"{job_id}:{dispatch}"])
        if not taken:
            return None
        taken_id, _, taken_dispatch = (taken.decode() if isinstance(taken, bytes) else taken).rpartition(":")
        return taken_id, int(taken_dispatch)

    def wake(self, job_id: str, dispatch: int) -> Job | None:
        """A message of ``dispatch`` arrived: a job parked under it is due now and queues for its tenant's turn.
        Returns the job as stored (None: no such job)."""
        def change(job: Job) -> Job | None:
            if job.state != "parked" or job.dispatch != dispatch:
                return None
            job.state = "queued"
            return job
        return self.update(job_id, change)[0]

    def update(self, job_id: str, change: Callable[[Job], Job | None], *,
               count: tuple[str, str] | None = None) -> tuple[Job | None, bool]:
        """Compare-and-set on one job: ``change`` gets a copy of the stored job and returns it changed, or None to
        leave it; the change is written with the job's indexes and counters in one transaction, and decided again
        on what another writer stored meanwhile. Returns (the job as stored now, whether this call changed it);
        (None, False) when there is no such job. ``count``: a counter (name, field) added to with the change.
        """
        key = self.key(job_id)
        for _ in range(CAS_TRIES):
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    old = self.open(pipe.get(key))
                    if old is None:
                        return None, False
                    new = change(dataclasses.replace(old))
                    if new is None:
                        return old, False
                    pipe.multi()
                    self._write(pipe, new, old=old, count=count)
                    pipe.execute()
                except WatchError:
                    continue
            if new.state != old.state:
                self.metrics.transitions.labels(new.state).inc()
            return new, True
        raise Unavailable(f"job {job_id} is changing too often to update; try again", code="job_busy")

    def _dispatch(self, job: Job, delay_s: float) -> None:
        try:
            self._send(job.id, job.dispatch, delay_s)
        except Exception as err:  # noqa: BLE001 - the job is stored; a lost message is the sweeper's to recover
            log.warning("job message not sent; the sweeper sends it again",
                        extra={"job": job.id, "dispatch": job.dispatch, "error": repr(err)[:200]})

    def submit(self, *, tenant: str, route: str, body: dict[str, Any], delay_s: float = 0.0,
               error: str = "", deadline_at: float | None = None, key: str = "", weight: float = 1.0, batch: str = "",
               quota: StorageQuota | None = DEFAULT_STORAGE) -> Job:
        """Stores a new job and sends its message, due in ``delay_s`` seconds; it expires at ``deadline_at``
        (default: ``job_deadline_s`` from now). ``key`` (the submitting key's id), ``weight`` (its tenant's) and
        ``batch`` (the batch it is a line of): see :class:`Job`. Its place in the tenant's storage ``quota`` is
        reserved first, kept until its result expires (None: counted elsewhere, as a batch's line)."""
        if route not in ENDPOINTS:
            raise InvalidArgument(f"unknown route {route!r}", param="endpoint")
        now = self.clock()
        body = {**body, "stream": False, "priority": "P2"}
        job = Job(id=f"job-{uuid.uuid4().hex}", tenant=tenant, route=route, body=body, created_at=now,
                  state="parked" if delay_s > 0 else "queued",
                  deadline_at=deadline_at if deadline_at is not None else now + self.settings.jobs.deadline_s,
                  next_attempt_at=now + delay_s, due_at=now + delay_s, dispatch=1, error=error, key=key, weight=weight,
                  batch=batch)
        if quota is not None:
            self.ledger.reserve(tenant, "jobs", job.id, amount=len(json.dumps(body)), quota=quota,
                                expires_at=job.deadline_at + self.settings.jobs.result_ttl_s)
        try:
            with self.redis.pipeline(transaction=True) as pipe:
                self._write(pipe, job, old=None)
                pipe.execute()
        except BaseException:
            if quota is not None:
                self.ledger.release(tenant, "jobs", job.id)
            raise
        self.metrics.transitions.labels(job.state).inc()
        self._dispatch(job, delay_s)
        return job

    def claim(self, job_id: str, dispatch: int) -> tuple[str, Job | None]:
        """What a delivered message of ``dispatch`` does:
        ``claimed`` (the job is now running under a fresh claim and lease: run it), ``expired`` (its deadline had
        passed), or nothing: ``duplicate``, ``stale``, ``missing`` (see :data:`VERDICTS`). Returns the verdict and
        the job as stored now."""
        now = self.clock()
        verdict, recovered = "missing", False

        def change(job: Job) -> Job | None:
            nonlocal verdict, recovered
            if job.state in TERMINAL:
                verdict = "duplicate"
                return None
            if dispatch != job.dispatch:
                verdict = "stale"
                return None
            if job.state == "running" and job.lease_until > now:
                verdict = "duplicate"
                return None
            recovered = job.state == "running"  # redelivered after its worker died: the claim lapsed
            if now >= job.deadline_at:
                verdict = "expired"
                job.state, job.claim, job.error = "expired", "", job.error or "the job's deadline passed"
                return job
            verdict = "claimed"
            job.state, job.claim, job.lease_until = "running", uuid.uuid4().hex, now + self.settings.jobs.lease_s
            job.attempts += 1
            return job

        job, changed = self.update(job_id, change)
        if job is None and self.redis.exists(self.key(job_id)):
            verdict = "forged"  # a record no key-holder wrote: whoever it names, it never runs
            log.warning("job record refused: its MAC does not verify; deleted unrun", extra={"job": job_id})
            self.redis.delete(self.key(job_id))
            self._forget(job_id)
        self.redis.hincrby(f"{self.prefix}:messages", verdict, 1)
        if changed and recovered:
            self.redis.hincrby(f"{self.prefix}:recoveries", "lease_expired", 1)
        return verdict, job

    def renew(self, job: Job) -> bool:
        """Extends the lease of ``job``'s claim; False when the claim is no longer the job's."""
        def change(current: Job) -> Job | None:
            if current.state != "running" or current.claim != job.claim:
                return None
            current.lease_until = self.clock() + self.settings.jobs.lease_s
            return current
        return self.update(job.id, change)[1]

    def finish(self, job: Job, state: str, *, result: dict[str, Any] | None = None, error: str = "",
               delay_s: float = 0.0) -> tuple[Job | None, bool]:
        """Ends the attempt that holds ``job.claim`` as ``completed`` (with ``result``), ``parked`` (its next
        attempt in ``delay_s``, under a new dispatch) or ``failed``; only while the job still holds that claim.
        Returns (the job as stored now, whether this attempt's outcome was written)."""
        if state not in ("completed", "parked", "failed"):
            raise ValueError(f"an attempt does not end as {state!r}")
        now = self.clock()

        def change(current: Job) -> Job | None:
            if current.state != "running" or current.claim != job.claim:
                return None
            current.state, current.error, current.claim = state, error, ""
            if state == "completed":
                current.result = result
            if state == "parked":
                current.dispatch += 1
                current.next_attempt_at = current.due_at = now + delay_s
            return current

        stored, changed = self.update(job.id, change)
        if changed and stored is not None and state == "parked":
            self._dispatch(stored, delay_s)
        if not changed:
            log.warning("job attempt ended after its claim was lost; its outcome is dropped",
                        extra={"job": job.id, "outcome": state, "now": stored.state if stored else "missing"})
        return stored, changed

    def cancel(self, job_id: str, *, error: str = "cancelled") -> Job | None:
        """Fails the job if it has not started (queued or parked); a running one finishes."""
        def change(job: Job) -> Job | None:
            if job.state not in WAITING:
                return None
            job.state, job.error = "failed", error
            return job
        return self.update(job_id, change)[0]

    # ---- the sweeper ----
    def lead(self, hold_s: float, owner: str) -> bool:
        """True when ``owner`` may sweep now: one sweep per ``hold_s`` over every process (others that ask
        meanwhile get False). Sweeping twice at once would be safe too: every step is a compare-and-set."""
        return bool(self.redis.set(f"{self.prefix}:sweeper", owner, nx=True, px=max(int(hold_s * 1000), 1)))

    def _due(self, index: str, before: float, limit: int) -> list[str]:
        ids = self.redis.zrangebyscore(index, "-inf", before, start=0, num=limit)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    def _forget(self, job_id: str) -> None:
        """Drops a job whose key has expired from every index."""
        pipe = self.redis.pipeline(transaction=True)
        for state in STATES:
            pipe.zrem(self._index(state), job_id)
        pipe.zrem(self._deadlines, job_id)
        pipe.execute()

    def sweep(self) -> dict[str, int]:
        """One pass of the sweeper; returns how many jobs it expired (``deadline``), requeued after their worker
        died (``lease_expired``) and sent again (``lost_message``). At most ``job_sweep_batch`` of each."""
        now = self.clock()
        limit = int(self.settings.jobs.sweep_batch)
        done: Tally[str] = Tally()

        def sweep_one(job_id: str, reason: str, change: Callable[[Job], Job | None]) -> Job | None:
            job, changed = self.update(job_id, change, count=("recoveries", reason))
            if job is None:
                self._forget(job_id)
            elif changed:
                done[reason] += 1
                return job
            return None

        def expire(job: Job) -> Job | None:
            if job.state in TERMINAL or (job.state == "running" and job.lease_until > now):
                return None  # a live attempt past the deadline may finish
            job.state, job.claim, job.error = "expired", "", job.error or "the job's deadline passed"
            return job

        for job_id in self._due(self._deadlines, now, limit):
            if sweep_one(job_id, "deadline", expire) is None and (job := self.load(job_id)) is not None \
                    and job.state in TERMINAL:
                self.redis.zrem(self._deadlines, job_id)  # repair: a finished job is never due

        def requeue(job: Job) -> Job | None:  # its worker died: the claim lapsed
            if job.state != "running" or job.lease_until > now:
                return None
            job.state, job.claim, job.dispatch = "queued", "", job.dispatch + 1
            job.due_at = job.next_attempt_at = now
            return job

        for job_id in self._due(self._index("running"), now, limit):
            if (job := sweep_one(job_id, "lease_expired", requeue)) is not None:
                self._dispatch(job, 0.0)

        lost_before = now - self.settings.jobs.lost_after_s

        def resend(job: Job) -> Job | None:  # the same dispatch: whichever of its messages comes first runs it
            if job.state not in WAITING or job.due_at > lost_before:
                return None
            job.state, job.due_at = "queued", now
            return job

        for state in WAITING:
            for job_id in self._due(self._index(state), lost_before, limit):
                if (job := sweep_one(job_id, "lost_message", resend)) is not None:
                    self._dispatch(job, 0.0)

        for state in TERMINAL:  # finished jobs whose keys have expired
            self.redis.zremrangebyscore(self._index(state), "-inf", now)
        if done:
            log.info("jobs swept", extra=dict(done))
        return dict(done)


# Joins a tenant's turns: KEYS ready set of the tenant, turns, virtual clock, last finish per tenant, weight per
# tenant; ARGV tenant, member, its order, the tenant's weight. A tenant that had no place starts at the virtual time
# now, or where its last turn ended if that is later.
_JOIN = """
if redis.call('ZADD', KEYS[1], 'NX', ARGV[3], ARGV[2]) == 1 then
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[4])
  if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
    local now = tonumber(redis.call('GET', KEYS[3]) or '0')
    local last = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
    redis.call('ZADD', KEYS[2], math.max(now, last), ARGV[1])
  end
end
"""

# Takes the next job: the tenant of the lowest virtual start (a tenant whose places were all taken otherwise is
# dropped on the way); the preferred member when it is that tenant's, else its oldest. The tenant moves on by
# 1 / weight. KEYS turns, virtual clock, last finish, weight; ARGV ready-set prefix, preferred tenant and member.
_TAKE = """
while true do
  local top = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #top == 0 then return false end
  local tenant, start = top[1], tonumber(top[2])
  local ready = ARGV[1] .. tenant
  local member = nil
  if tenant == ARGV[2] and redis.call('ZREM', ready, ARGV[3]) == 1 then
    member = ARGV[3]
  else
    member = redis.call('ZPOPMIN', ready)[1]
  end
  if member then
    local finish = start + 1 / tonumber(redis.call('HGET', KEYS[4], tenant) or '1')
    redis.call('SET', KEYS[2], start)
    redis.call('HSET', KEYS[3], tenant, finish)
    if redis.call('ZCARD', ready) > 0 then
      redis.call('ZADD', KEYS[1], finish, tenant)
    else
      redis.call('ZREM', KEYS[1], tenant)
    end
    return member
  end
  redis.call('ZREM', KEYS[1], tenant)
end
"""
