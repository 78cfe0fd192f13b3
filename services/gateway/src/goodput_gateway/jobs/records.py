"""A deferred job as stored (:class:`Job`), its states and the other names a job's life is told in, and the retry
policy of parked work (:func:`retry_delay`); :mod:`.store` keeps jobs in Redis.

What ``GET /v1/jobs/{id}`` answers for a job, in OpenAI's shape:

    >>> public = Job(id="job-1", tenant="acme", route="chat", body={}, deadline_at=400.0).public()
    >>> public["object"], public["status"], public["endpoint"], public["expires_at"]
    ('job', 'queued', '/v1/chat/completions', 400)
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from goodput_core.errors import DeadlineExceeded, ResourceExhausted, Unavailable

__all__ = ["ENDPOINTS", "FINAL_CODES", "JOB_HEADER", "JOB_ID_KEY", "OUTCOMES", "RECOVERIES", "RETRYABLE", "ROUTES",
           "SHED_CODES", "STATES", "TERMINAL", "VERDICTS", "WAITING", "Job", "Seal", "retry_delay"]

STATES = ("queued", "running", "parked", "completed", "failed", "expired")
TERMINAL = ("completed", "failed", "expired")
WAITING = ("queued", "parked")
# How an attempt (a claim on a "running" job) ends; "lost": its worker died and the claim lapsed.
OUTCOMES = ("completed", "parked", "failed", "lost")
# What a delivered message did: started an attempt, expired the job, or nothing (a duplicate: the job is running
# under a live claim or finished; stale: an earlier dispatch's message; missing: no such job; forged: a record whose
# MAC does not verify, deleted unrun).
VERDICTS = ("claimed", "expired", "duplicate", "stale", "missing", "forged")
# Why the sweeper (or a redelivered message) stepped in.
RECOVERIES = ("lost_message", "lease_expired", "deadline")
JOB_HEADER = "X-Goodput-Job-Id"
JOB_ID_KEY = "x-goodput-job-id"  # gRPC trailing metadata of a shed request that was parked
# Worth retrying later: shed, scheduler or workers unreachable, expired in the queue.
RETRYABLE = (ResourceExhausted, Unavailable, DeadlineExceeded)
SHED_CODES = ("overloaded", "queue_full")
# Refusals no retry helps: the month's budget is spent, or one request is larger than its tokens-per-minute limit.
FINAL_CODES = ("insufficient_quota", "request_too_large")


def retry_delay(attempt: int, retry_after_s: float | None, *, base_s: float = 1.0, cap_s: float = 60.0,
                rng: random.Random | None = None) -> float:
    """Seconds before re-submitting shed work: the scheduler's retry-after (from its drain rate) or an exponential
    backoff, whichever is longer, capped, with jitter so parked work does not return all at once.

    >>> 1.0 <= retry_delay(1, None, rng=random.Random(0)) <= 1.5
    True
    >>> 8.0 <= retry_delay(2, 8.0, rng=random.Random(0)) <= 12.0
    True
    """
    rng = rng or random.Random()
    backoff = min(cap_s, base_s * 2 ** max(attempt - 1, 0))
    return min(max(backoff, retry_after_s or 0.0), cap_s) * rng.uniform(1.0, 1.5)


class Seal:
    """The MAC of the records that cross from one Redis user to another (jobs, batches): HMAC-SHA256 with the key
    only the gateways and the jobs workers hold, over the record's canonical JSON, stored in it as ``mac``. A record
    written by anyone else (another service's Redis user, someone with the gateway's Redis password but not the key)
    does not verify. ``previous``: a key being rotated out, still accepted.

        >>> seal = Seal("k")
        >>> raw = seal.seal({"id": "job-1", "tenant": "acme"})
        >>> seal.open(raw)
        {'id': 'job-1', 'tenant': 'acme'}
        >>> seal.open(raw.replace("acme", "other")) is None, Seal("other-key").open(raw) is None
        (True, True)
    """

    def __init__(self, key: str, previous: str = "") -> None:
        if not key:
            raise ValueError("JOBS__MAC_KEY is not set: jobs and batches need the key their records are sealed "
                             "with (the same on every gateway and jobs worker)")
        self._keys = [k.encode() for k in (key, previous) if k]

    @classmethod
    def of(cls, settings: Any) -> Seal:
        return cls(settings.jobs.mac_key.get_secret_value(), settings.jobs.mac_key_previous.get_secret_value())

    @staticmethod
    def _mac(key: bytes, record: dict[str, Any]) -> str:
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(key, body, hashlib.sha256).hexdigest()

    def seal(self, record: dict[str, Any]) -> str:
        return json.dumps({**record, "mac": self._mac(self._keys[0], record)})

    def open(self, raw: str | bytes) -> dict[str, Any] | None:
        """The record, or None when it is not one a key-holder wrote."""
        try:
            record = json.loads(raw)
            mac = record.pop("mac", "")
        except (ValueError, TypeError, AttributeError):
            return None
        ok = isinstance(mac, str) and any(hmac.compare_digest(self._mac(k, record), mac) for k in self._keys)
        return record if ok else None


@dataclass
class Job:
    id: str
    tenant: str
    route: str  # "chat" or "completions"
    body: dict[str, Any]
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    deadline_at: float = 0.0
    attempts: int = 0
    next_attempt_at: float = 0.0
    error: str = ""
    result: dict[str, Any] | None = None
    # Each hand-over to the queue (submitted, parked again, requeued after its worker died) is a new dispatch; its
    # message carries the number, and only a message of the current dispatch may start an attempt.
    dispatch: int = 0
    due_at: float = 0.0  # when the current dispatch's message is due (or was last sent again)
    claim: str = ""  # the running attempt's fencing token ("" when none runs)
    lease_until: float = 0.0  # the claim lapses then unless renewed
    # Who submitted it: the key's id (the job runs under that key's limits as well as its tenant's; "" = the tenant's
    # alone, as jobs stored before keys were recorded) and the tenant's fair-share weight among waiting jobs.
    key: str = ""
    weight: float = 1.0
    batch: str = ""  # the batch this job is a line of ("" = none): its end is counted for the batch (JobQueue)

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Job:
        """A stored job; fields this version does not know (written by a newer one) are ignored."""
        return cls(**{k: v for k, v in data.items() if k in _FIELDS})

    def public(self) -> dict[str, Any]:
        """The REST shape (an OpenAI-style object)."""
        out: dict[str, Any] = {"id": self.id, "object": "job", "status": self.state, "endpoint": ENDPOINTS[self.route],
                               "created_at": int(self.created_at), "updated_at": int(self.updated_at),
                               "expires_at": int(self.deadline_at), "attempts": self.attempts}
        if self.state == "parked":
            out["next_attempt_at"] = int(self.next_attempt_at)
        if self.error:
            out["last_error"] = self.error
        if self.result is not None:
            out["response"] = self.result
        return out


_FIELDS = {f.name for f in dataclasses.fields(Job)}
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ROUTES = {v: k for k, v in ENDPOINTS.items()}
