"""Prefix and session affinity stay inside a tenant (or its cache sharing group): a request is never steered to the
worker that holds another tenant's prompt, which would tell its sender, by where and how fast it was served, that
someone else had sent that prompt."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import PlacementRequest, PrefixAffinity, PrefixIndex, Profile, build_pipeline
from goodput_scheduler.registry import Worker

SYSTEM = "You are the support assistant of a bank; answer only questions about accounts and cards. " * 10


def fleet(n: int = 4) -> list[Worker]:
    load = SimpleNamespace(max_num_seqs=8, waiting=0, kv_cache_usage=0.0, stalled_s=0.0)
    return [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True, load=load)  # type: ignore[arg-type]
            for i in range(n)]


def pipeline(seed: int = 7, **settings: object):  # type: ignore[no-untyped-def]
    profile = Profile.parse('{"scorers": [{"name": "least_loaded", "weight": 1}, '
                            '{"name": "prefix_affinity", "weight": 2}, {"name": "session_affinity", "weight": 3}]}')
    return build_pipeline(profile, SchedulerSettings(**settings), rng=random.Random(seed))  # type: ignore[arg-type]


def place(p, workers, tenant: str, n: int, *, prefix: str = SYSTEM, session: str = ""):  # type: ignore[no-untyped-def]
    req = PlacementRequest(f"{tenant}-{n}", tenant, 2, "", 100, 10, prefix_hint=prefix + f"question {n}",
                           session_id=session)
    decision = p.place(req, workers)
    p.commit(req, decision)
    return decision


def test_a_tenants_repeated_prefix_keeps_its_affinity() -> None:
    p, workers = pipeline(), fleet()
    first = place(p, workers, "acme", 0)
    for n in range(1, 6):
        again = place(p, workers, "acme", n)
        assert again.worker is first.worker and again.reason == "prefix_affinity"


def test_another_tenants_identical_prompt_gets_no_affinity_to_that_worker() -> None:
    for seed in range(20):  # wherever acme's prompt lands, globex is never drawn to that worker by it
        p, workers = pipeline(seed), fleet()
        acme = place(p, workers, "acme", 0)
        index = next(s for _, s in p.scorers if isinstance(s, PrefixAffinity)).index
        assert index.match(index.hashes(SYSTEM, scope="tenant:acme")) == {acme.worker.worker_id: 6}
        assert index.match(index.hashes(SYSTEM, scope="tenant:globex")) == {}
        other = place(p, workers, "globex", 0)
        assert other.reason != "prefix_affinity"
        # and globex's own repeat now has affinity to where globex went
        again = place(p, workers, "globex", 1)
        assert again.worker is other.worker and again.reason == "prefix_affinity"


def test_a_sharing_group_shares_affinity_and_only_it() -> None:
    p, workers = pipeline(cache_sharing_groups={"bank": ["bank-eu", "bank-us"]}), fleet()
    eu = place(p, workers, "bank-eu", 0)
    us = place(p, workers, "bank-us", 1)
    assert us.worker is eu.worker and us.reason == "prefix_affinity"
    outsider = place(p, workers, "bank", 2)  # a tenant named like the group is not in it
    assert outsider.reason != "prefix_affinity"


def test_a_session_id_is_the_tenants_own() -> None:
    p, workers = pipeline(), fleet()
    mine = place(p, workers, "acme", 0, prefix="", session="chat-1")
    assert place(p, workers, "acme", 1, prefix="", session="chat-1").worker is mine.worker
    theirs = place(p, workers, "globex", 0, prefix="", session="chat-1")
    assert theirs.reason != "session_affinity"


def test_the_index_hashes_the_same_text_apart_per_scope() -> None:
    idx = PrefixIndex(block_chars=8)
    a, b = idx.hashes("x" * 64, scope="tenant:a"), idx.hashes("x" * 64, scope="tenant:b")
    assert len(a) == len(b) == 8 and not set(a) & set(b)
    idx.record(a, "w1")
    assert idx.match(a) == {"w1": 8} and idx.match(b) == {}


def test_sharing_groups_are_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_SCHEDULER_CACHE_SHARING_GROUPS", '{"bank": ["eu", "us"]}')
    assert SchedulerSettings().cache_sharing_groups == {"bank": ["eu", "us"]}
    monkeypatch.setenv("GOODPUT_SCHEDULER_CACHE_SHARING_GROUPS", '{"a": ["t"], "b": ["t"]}')
    with pytest.raises(ValueError, match="tenant 't' is in two cache sharing groups"):
        SchedulerSettings()
