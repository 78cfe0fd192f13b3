"""The Files and Batch APIs' store against a real Redis: a batch's lines become P2 jobs due by the end of its
window, its status follows its jobs, its output and error files are written once, and everything is its tenant's
alone. The jobs' runs are played here (the Celery worker that runs them has its own tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from goodput_core.errors import InvalidArgument, NotFound, ResourceExhausted

from goodput_gateway.api.batches import check_lines
from goodput_gateway.config import GatewaySettings
from goodput_gateway.jobs.batches import BatchStore
from goodput_gateway.jobs.records import Job
from goodput_gateway.jobs.store import JobQueue

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str = "hi", **extra: object) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4}, **extra}


def nested(depth: int) -> object:
    return [nested(depth - 1)] if depth else []


def jsonl(*lines: dict[str, object]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture
def store(redis_url: str, redis_prefix: str) -> Iterator[BatchStore]:
    client = redis.Redis.from_url(redis_url)
    sent: list[str] = []
    queue = JobQueue(GatewaySettings(redis_url=redis_url, jobs={"prefix": redis_prefix},
                                     quotas={"prefix": f"{redis_prefix}:quota"}), client,
                     send=lambda job_id, dispatch, delay_s: sent.append(job_id))
    yield BatchStore(queue)
    client.close()


def make_batch(store: BatchStore, *ids: str, tenant: str = "acme") -> str:
    content = jsonl(*(line(i) for i in ids))
    f = store.put_file(tenant=tenant, filename="in.jsonl", purpose="batch", content=content)
    lines = check_lines(store.file_content(f.id, tenant=tenant), endpoint=CHAT, settings=store.settings)
    return store.create(tenant=tenant, endpoint=CHAT, input_file_id=f.id, window="24h", metadata={"run": "1"},
                        lines=lines).id


def finish(store: BatchStore, job_id: str, state: str, result: dict[str, object] | None = None,
           error: str = "") -> None:
    def change(job: Job) -> Job:
        job.state, job.result, job.error = state, result, error
        return job

    assert store.queue.update(job_id, change)[1]


def test_a_batch_runs_its_lines_as_p2_jobs_and_writes_its_files_once(store: BatchStore) -> None:
    batch_id = make_batch(store, "a", "b", "c")
    batch = store.get(batch_id, tenant="acme")
    assert batch.status == "in_progress" and batch.public()["request_counts"] == {"total": 3, "completed": 0,
                                                                                 "failed": 0}
    jobs = [store.queue.load(j) for j in batch.jobs]
    assert all(j is not None and j.body["priority"] == "P2" and j.deadline_at == batch.expires_at for j in jobs)
    assert batch.expires_at - batch.created_at == 86_400
    finish(store, batch.jobs[0], "completed", {"choices": [{"message": {"content": "A"}}]})
    finish(store, batch.jobs[1], "failed", error="InvalidArgument: too long")
    assert store.get(batch_id, tenant="acme").status == "in_progress"  # c is still queued
    finish(store, batch.jobs[2], "expired", error="the job's deadline passed")
    done = store.get(batch_id, tenant="acme")
    assert done.status == "expired" and done.public()["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert done.output_file_id and done.error_file_id
    out = [json.loads(x) for x in store.file_content(done.output_file_id, tenant="acme").splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"], o["response"]["body"]["choices"][0]["message"]["content"])
            for o in out] == [("a", 200, "A")]
    errors = {e["custom_id"]: e["error"]["code"] for e in
              (json.loads(x) for x in store.file_content(done.error_file_id, tenant="acme").splitlines())}
    assert errors == {"b": "request_failed", "c": "batch_expired"}
    # read again: the same files, not new ones
    again = store.get(batch_id, tenant="acme")
    assert (again.output_file_id, again.error_file_id) == (done.output_file_id, done.error_file_id)


def test_cancelling_fails_the_lines_not_started_and_keeps_what_finished(store: BatchStore) -> None:
    batch_id = make_batch(store, "a", "b")
    batch = store.get(batch_id, tenant="acme")
    finish(store, batch.jobs[0], "completed", {"ok": True})
    cancelled = store.cancel(batch_id, tenant="acme")
    assert cancelled.status == "cancelled" and cancelled.public()["cancelled_at"] is not None
    errors = [json.loads(x) for x in store.file_content(str(cancelled.error_file_id), tenant="acme").splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("b", "batch_cancelled")]


def test_files_and_batches_are_their_tenants_alone(store: BatchStore) -> None:
    batch_id = make_batch(store, "a")
    batch = store.get(batch_id, tenant="acme")
    for call in (lambda: store.get(batch_id, tenant="globex"), lambda: store.cancel(batch_id, tenant="globex"),
                 lambda: store.get_file(batch.input_file_id, tenant="globex"),
                 lambda: store.file_content(batch.input_file_id, tenant="globex")):
        with pytest.raises(NotFound):
            call()
    assert [b.id for b in store.list_batches(tenant="acme", limit=10)] == [batch_id]
    assert store.list_batches(tenant="globex", limit=10) == []


@pytest.mark.parametrize("content,why", [
    (jsonl(line("a"), line("a")), "not unique"),
    (jsonl(line("a"), {**line("b"), "url": "/v1/completions"}), "line 2"),
    (b'{"custom_id": "a"\n', "not valid JSON"),
    (jsonl(line("a", "caf\ud800")), "line 1 of the input file: body.messages[0].content is not Unicode text"),
    (jsonl(line("a"), {**line("b"), "body": {"metadata": {"x": nested(32)}}}),
     "line 2 of the input file: body.metadata.x[0][0]"),
    (jsonl(line("a", extra=1)), "unrecognized field 'extra'"),
    (jsonl({**line("a"), "body": {"messages": [], "max_tokens": 4}}), "body:"),
    (jsonl({**line("a"), "body": {"messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}}),
     "tools"),
    (b"\n\n", "no requests"),
    (jsonl(line("a"), line("b", "x" * (1 << 20))), "line 2 of the input file: longer than 1048576 bytes"),
    (jsonl(line("a")) + b'{"custom_id": "\xff"}\n', "line 2 of the input file: it is not valid UTF-8"),
])
def test_a_bad_input_file_is_refused_naming_its_line(content: bytes, why: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_lines(content, endpoint=CHAT, settings=GatewaySettings())
    assert why in err.value.message and err.value.param == "input_file_id"


def test_a_batch_is_bounded_by_a_setting() -> None:
    with pytest.raises(InvalidArgument, match="more than 2 requests"):
        check_lines(jsonl(line("a"), line("b"), line("c")), endpoint=CHAT,
                    settings=GatewaySettings(limits={"batch_requests": 2}))


def test_a_tenant_creates_one_batch_at_a_time_and_others_are_not_held_up(store: BatchStore) -> None:
    with store.creating("acme"):
        with pytest.raises(ResourceExhausted) as busy:  # a second of acme's, while its first is being checked
            with store.creating("acme"):
                pass
        assert busy.value.code == "batch_in_progress" and busy.value.retry_after_s == 1.0
        with store.creating("globex"):  # another tenant's goes ahead
            pass
        with store.creating("b"), store.creating("c"), store.creating("d"):  # up to four tenants' at once
            with pytest.raises(ResourceExhausted, match="creating 4 batches"):
                with store.creating("e"):
                    pass
    with store.creating("acme"):  # and acme's next, once its first is done
        pass

