"""OpenAI's Files and Batch APIs on the deferred-job path: each line of a batch's input file becomes a job, run at
P2 by the jobs workers (so a batch soaks spare capacity and never takes P0's), and the batch's output and error
files are written once every line has ended. Files and batches live in Redis, scoped to their tenant, so every
gateway replica serves them.

* A **file** (``purpose: batch``, JSONL, at most ``max_file_bytes``) is kept for ``file_ttl_s``.
* Files and batches count against their tenant's storage quotas (:mod:`goodput_gateway.storage`): a file's place is
  reserved before it is written and given back when it is deleted or expires; a batch holds one place and its lines
  until it expires (its jobs are not counted again as jobs); a batch's result files are counted, never refused.
* A **batch** checks every line when it is created (``custom_id`` unique, ``method: POST``, ``url`` equal to the
  batch's endpoint, a ``body`` the endpoint accepts) and refuses the batch naming the first bad line. Its jobs'
  deadline is the end of its completion window (``24h``): a line not done by then ends as ``batch_expired`` in the
  error file, and the batch as ``expired``.
* Its **status** is derived from its lines' counts when it is read (each line's job adds to them as it ends:
  :meth:`JobQueue.batch_ended`): ``in_progress`` while any line waits or runs; then ``finalizing``
  while one replica writes the output file (``{"id", "custom_id", "response": {"status_code", "request_id",
  "body"}, "error"}`` per completed line) and the error file (failed and expired lines), then ``completed``,
  ``expired`` or ``cancelled``. Cancelling fails the lines not started yet; lines already running finish.

    >>> parse_window("24h")
    86400
    >>> Batch(id="batch_1", tenant="t", endpoint="/v1/chat/completions", input_file_id="file-1",
    ...       created_at=0, expires_at=86400, jobs=["job-1"], custom_ids=["a"]).public()["request_counts"]
    {'total': 1, 'completed': 0, 'failed': 0}
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from goodput_core.errors import InvalidArgument, NotFound, ResourceExhausted

from goodput_gateway.jobs.records import ROUTES, Job
from goodput_gateway.jobs.store import JobQueue
from goodput_gateway.storage import DEFAULT_STORAGE, StorageQuota

__all__ = ["Batch", "BatchStore", "FileObject", "parse_window"]

WINDOWS = {"24h": 86_400}
READ_CHUNK = 1 << 20  # a file is read in pieces this large: a few ms of the interpreter each
# Batches checked at once in one process: each takes a 2 ms turn of the event loop per round, so four keep another
# stream's next token within about 8 ms (goodput_gateway.api.batches.check_file).
CREATING_AT_ONCE = 4


def parse_window(window: str) -> int:
    """The completion window's seconds; OpenAI accepts only ``24h``."""
    if window not in WINDOWS:
        raise InvalidArgument(f"completion_window must be one of {', '.join(WINDOWS)}", param="completion_window",
                              code="invalid_value")
    return WINDOWS[window]


@dataclass
class FileObject:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}


@dataclass
class Batch:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    created_at: int
    expires_at: int
    jobs: list[str]
    custom_ids: list[str]
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    status: str = "in_progress"  # then finalizing, completed, expired, cancelling, cancelled
    counts: dict[str, int] = field(default_factory=lambda: {"completed": 0, "failed": 0})
    output_file_id: str | None = None
    error_file_id: str | None = None
    finished_at: int | None = None
    cancelling_at: int | None = None

    def public(self) -> dict[str, Any]:
        """The OpenAI ``batch`` object."""
        done = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.created_at, "expires_at": self.expires_at,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": self.cancelling_at, "cancelled_at": None,
            "request_counts": {"total": len(self.jobs), **self.counts}, "metadata": self.metadata}
        if self.status in done and self.finished_at is not None:
            out[done[self.status]] = self.finished_at
        return out


class BatchStore:
    """Files and batches in the jobs' Redis (``<jobs_prefix>:file:*``, ``<jobs_prefix>:batch:*``)."""

    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self.ledger = queue.ledger
        self.redis = queue.redis
        self.settings = queue.settings
        self.prefix = queue.prefix
        self._creating: set[str] = set()  # tenants whose batch this process is checking and creating now

    # ---- files ----
    def _file_key(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def put_file(self, *, tenant: str, filename: str, purpose: str, content: bytes,
                 quota: StorageQuota = DEFAULT_STORAGE, enforce: bool = True) -> FileObject:
        """Keeps the file, its place in the tenant's ``quota`` reserved first (``enforce=False``: counted, never
        refused)."""
        now = int(time.time())
        ttl = int(self.settings.jobs.file_ttl_s)
        f = FileObject(id=f"file-{uuid.uuid4().hex}", tenant=tenant, filename=filename[:256], purpose=purpose,
                       bytes=len(content), created_at=now, expires_at=now + ttl)
        self.ledger.reserve(tenant, "files", f.id, amount=len(content), expires_at=f.expires_at, quota=quota,
                            enforce=enforce)
        try:
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(self._file_key(f.id), json.dumps(asdict(f)), ex=ttl)
            pipe.set(self._file_key(f.id) + ":content", content, ex=ttl)
            pipe.zadd(f"{self.prefix}:files:{tenant}", {f.id: now})
            pipe.expire(f"{self.prefix}:files:{tenant}", ttl)
            pipe.execute()
        except BaseException:
            self.ledger.release(tenant, "files", f.id)
            raise
        return f

    def get_file(self, file_id: str, *, tenant: str) -> FileObject:
        raw = self.redis.get(self._file_key(file_id))
        f = FileObject(**json.loads(raw)) if raw is not None else None
        if f is None or f.tenant != tenant:
            raise NotFound(f"No such File object: {file_id[:80]}", param="file_id", code="file_not_found")
        return f

    def file_content(self, file_id: str, *, tenant: str) -> bytes:
        """The file's bytes, read in :data:`READ_CHUNK` pieces (a 16 MiB reply read whole holds the interpreter
        long enough to stall the event loop's thread); a file deleted meanwhile is not found."""
        f = self.get_file(file_id, tenant=tenant)
        content = bytearray()
        while piece := self.redis.getrange(self._file_key(file_id) + ":content", len(content),
                                           len(content) + READ_CHUNK - 1):
            content += piece
        if len(content) != f.bytes:
            raise NotFound(f"No such File object: {file_id[:80]}", param="file_id", code="file_not_found")
        return bytes(content)

    def delete_file(self, file_id: str, *, tenant: str) -> None:
        self.get_file(file_id, tenant=tenant)
        self.redis.delete(self._file_key(file_id), self._file_key(file_id) + ":content")
        self.redis.zrem(f"{self.prefix}:files:{tenant}", file_id)
        self.ledger.release(tenant, "files", file_id)

    def list_files(self, *, tenant: str, limit: int) -> list[FileObject]:
        ids = [i.decode() if isinstance(i, bytes) else i
               for i in self.redis.zrevrange(f"{self.prefix}:files:{tenant}", 0, limit - 1)]
        out = []
        for file_id in ids:
            try:
                out.append(self.get_file(file_id, tenant=tenant))
            except NotFound:  # expired: forget it
                self.redis.zrem(f"{self.prefix}:files:{tenant}", file_id)
        return out

    # ---- batches ----
    @contextlib.contextmanager
    def creating(self, tenant: str) -> Iterator[None]:
        """Holds the tenant's one place to create a batch in this process (its file checked, its lines submitted);
        while it is held, another of the tenant's is refused (429, retry in a second), so a tenant's batches never
        take more than one turn of the event loop's checking, nor wait unbounded; so is any past
        :data:`CREATING_AT_ONCE` in this process."""
        if tenant in self._creating:
            raise ResourceExhausted("a batch of this tenant is being created; retry when it is done",
                                    code="batch_in_progress", retry_after_s=1.0)
        if len(self._creating) >= CREATING_AT_ONCE:
            raise ResourceExhausted(f"this gateway is creating {CREATING_AT_ONCE} batches; retry in a second",
                                    code="batch_in_progress", retry_after_s=1.0)
        self._creating.add(tenant)
        try:
            yield
        finally:
            self._creating.discard(tenant)

    def _batch_key(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def _save(self, batch: Batch) -> None:
        ttl = int(max(batch.expires_at - time.time(), 0) + self.settings.jobs.result_ttl_s)
        self.redis.set(self._batch_key(batch.id), self.queue.seal.seal(asdict(batch)), ex=max(ttl, 60))

    def create(self, *, tenant: str, endpoint: str, input_file_id: str, window: str,
               metadata: dict[str, str] | None, lines: list[tuple[str, bytes]],
               quota: StorageQuota = DEFAULT_STORAGE, key: str = "", weight: float = 1.0) -> Batch:
        """Submits one P2 job per checked line (custom_id, the line as uploaded: its body is parsed as it is
        submitted, so the batch's bodies are never all in memory at once), due by the end of the window, once the
        batch and its lines have their place in the tenant's ``quota``. ``key`` and ``weight``: the submitting
        key's id and its tenant's weight (:class:`goodput_gateway.jobs.records.Job`)."""
        now = int(time.time())
        expires = now + parse_window(window)
        route = ROUTES[endpoint]
        batch_id = f"batch_{uuid.uuid4().hex}"
        self.ledger.reserve(tenant, "batches", batch_id, amount=len(lines), quota=quota,
                            expires_at=expires + self.settings.jobs.result_ttl_s)
        try:
            jobs = [self.queue.submit(tenant=tenant, route=route, body=json.loads(line)["body"], deadline_at=expires,
                                      quota=None, key=key, weight=weight, batch=batch_id).id for _, line in lines]
        except BaseException:
            self.ledger.release(tenant, "batches", batch_id)
            raise
        batch = Batch(id=batch_id, tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
                      created_at=now, expires_at=expires, jobs=jobs, custom_ids=[c for c, _ in lines],
                      completion_window=window, metadata=metadata)
        self._save(batch)
        self.redis.zadd(f"{self.prefix}:batches:{tenant}", {batch.id: now})
        return batch

    def _load(self, batch_id: str, *, tenant: str) -> Batch:
        raw = self.redis.get(self._batch_key(batch_id))
        record = None if raw is None else self.queue.seal.open(raw)  # None too: not sealed by a key-holder
        batch = Batch(**record) if record is not None else None
        if batch is None or batch.tenant != tenant:
            raise NotFound(f"No such Batch object: {batch_id[:80]}", param="batch_id", code="batch_not_found")
        return batch

    def _jobs(self, batch: Batch) -> Iterator[Job | None]:
        """The batch's jobs in order (None: expired from Redis), read 500 at a time and never all kept: 10,000
        parsed jobs alive at once would make the collector's full passes long stalls of every thread."""
        keys = [self.queue.key(j) for j in batch.jobs]
        for i in range(0, len(keys), 500):
            yield from (self.queue.open(r) for r in self.redis.mget(keys[i:i + 500]))

    def get(self, batch_id: str, *, tenant: str) -> Batch:
        """The batch with its status brought up to date from its lines' counts (and its files written once every
        line has ended)."""
        batch = self._load(batch_id, tenant=tenant)
        if batch.status in ("completed", "expired", "cancelled"):
            return batch
        ended = {(k.decode() if isinstance(k, bytes) else k): int(v)
                 for k, v in self.redis.hgetall(self.queue.batch_ended(batch.id)).items()}
        batch.counts = {"completed": ended.get("completed", 0), "failed": ended.get("failed", 0)}
        if sum(batch.counts.values()) < len(batch.jobs):  # a line is still waiting or running
            return batch
        # every line has ended: one replica writes the files (the others answer "finalizing" meanwhile)
        if not self.redis.set(self._batch_key(batch.id) + ":finalizing", "1", nx=True, ex=60):
            batch.status = "finalizing"
            return batch
        self._finalize(batch)
        return batch

    def _finalize(self, batch: Batch) -> None:
        """Writes the output and error files, each line serialized as its job is read."""
        out_lines, err_lines, expired = [], [], False
        for custom_id, job_id, job in zip(batch.custom_ids, batch.jobs, self._jobs(batch), strict=True):
            line_id = f"batch_req_{job_id.removeprefix('job-')}"
            if job is not None and job.state == "completed":
                out_lines.append(_jsonl({"id": line_id, "custom_id": custom_id, "error": None, "response": {
                    "status_code": 200, "request_id": f"req-{job_id.removeprefix('job-')}", "body": job.result}}))
                continue
            if job is None or job.state == "expired":
                expired = True
                error = {"code": "batch_expired", "message": "This request could not be executed before the "
                         "completion window expired."}
            elif job.error.endswith("cancelled"):
                error = {"code": "batch_cancelled", "message": "This request was cancelled with its batch."}
            else:
                error = {"code": "request_failed", "message": job.error}
            err_lines.append(_jsonl({"id": line_id, "custom_id": custom_id, "response": None, "error": error}))
        if out_lines:
            batch.output_file_id = self._result_file(batch, "output", out_lines).id
        if err_lines:
            batch.error_file_id = self._result_file(batch, "error", err_lines).id
        batch.status = "cancelled" if batch.status == "cancelling" else "expired" if expired else "completed"
        batch.finished_at = int(time.time())
        self._save(batch)

    def _result_file(self, batch: Batch, kind: str, lines: list[str]) -> FileObject:
        return self.put_file(tenant=batch.tenant, filename=f"{batch.id}_{kind}.jsonl", purpose="batch_output",
                             content="".join(lines).encode(), enforce=False)

    def cancel(self, batch_id: str, *, tenant: str) -> Batch:
        """Fails the lines not started yet; lines already running finish; the batch ends as ``cancelled``."""
        batch = self._load(batch_id, tenant=tenant)
        if batch.status in ("completed", "expired", "cancelled"):
            return batch
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        self._save(batch)
        for job in self._jobs(batch):
            if job is not None and job.state in ("queued", "parked"):
                self.queue.cancel(job.id)  # a compare-and-set: a line that started meanwhile finishes
        return self.get(batch_id, tenant=tenant)

    def list_batches(self, *, tenant: str, limit: int, after: str | None = None) -> list[Batch]:
        ids = [i.decode() if isinstance(i, bytes) else i
               for i in self.redis.zrevrange(f"{self.prefix}:batches:{tenant}", 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for batch_id in ids[:limit]:
            try:
                out.append(self.get(batch_id, tenant=tenant))
            except NotFound:
                self.redis.zrem(f"{self.prefix}:batches:{tenant}", batch_id)
        return out


def _jsonl(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":")) + "\n"
