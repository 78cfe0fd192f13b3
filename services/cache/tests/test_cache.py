"""The cache's promises, against the real Redis and the real embedding model."""

from __future__ import annotations

from typing import Any

import pytest
import redis as sync_redis
from prometheus_client import CollectorRegistry

from goodput_core.errors import InvalidArgument, PermissionDenied
from goodput_testing import async_wait_until, dead_port

from goodput_cache.cache import Answer, ResponseCache
from goodput_cache.keys import Message

from .conftest import ask

PASSWORD = "How do I reset my password?"
PASSWORD_PARAPHRASE = "How can I reset my password?"
ANSWER = Answer(text="Open Settings, then Security, then Reset password.", completion_tokens=12, prompt_tokens=30)


async def test_exact_hit_after_store(cache: ResponseCache) -> None:
    stored = await cache.store(ask(PASSWORD), ANSWER)
    assert stored.stored and stored.ttl_s == cache.settings.ttl_chat_s
    hit = await cache.lookup(ask("How do I  reset my password? "))  # whitespace is normalised
    assert (hit.hit, hit.layer, hit.similarity) == (True, "l1", 1.0)
    assert hit.answer is not None and hit.answer.text == ANSWER.text
    assert hit.key == stored.key


async def test_paraphrase_is_a_semantic_hit(cache: ResponseCache) -> None:
    await cache.store(ask(PASSWORD), ANSWER)
    hit = await cache.lookup(ask(PASSWORD_PARAPHRASE))
    assert hit.hit and hit.layer == "l2" and hit.similarity >= cache.settings.threshold
    assert hit.matched_query == PASSWORD
    assert not (await cache.lookup(ask(PASSWORD_PARAPHRASE), allow_semantic=False)).hit


@pytest.mark.parametrize("memo_entries, model_calls", [(4096, 1), (0, 2)])
async def test_a_missed_question_is_embedded_once_for_lookup_and_store(make_cache: Any, memo_entries: int,
                                                                        model_calls: int) -> None:
    registry = CollectorRegistry()
    cache = make_cache(registry, vector_memo_entries=memo_entries)
    assert not (await cache.lookup(ask(PASSWORD))).hit
    assert (await cache.store(ask(PASSWORD), ANSWER)).stored  # the answer generated after the miss

    def embedded(source: str) -> float:
        return registry.get_sample_value("goodput_cache_embeddings_total", {"source": source}) or 0.0

    assert (embedded("model"), embedded("memo")) == (model_calls, 2 - model_calls)
    hit = await cache.lookup(ask(PASSWORD_PARAPHRASE))  # the stored vector is the question's own
    assert hit.hit and hit.layer == "l2" and hit.matched_query == PASSWORD


async def test_two_tenants_never_share(cache: ResponseCache) -> None:
    await cache.store(ask(PASSWORD, tenant="acme"), ANSWER)
    for question in (PASSWORD, PASSWORD_PARAPHRASE):
        miss = await cache.lookup(ask(question, tenant="globex"))
        assert not miss.hit, question
    assert (await cache.lookup(ask(PASSWORD, tenant="acme"))).hit


@pytest.mark.parametrize("stored, asked", [
    ("How do I turn on two-factor authentication?", "How do I turn off two-factor authentication?"),
    ("Can I get a refund within 30 days?", "Can I get a refund within 60 days?"),
    ("Is my data encrypted at rest?", "Is my data not encrypted at rest?"),
    ("How do I move my account from Berlin to Paris?", "How do I move my account from Paris to Berlin?"),
])
async def test_near_miss_paraphrases_are_not_hits(cache: ResponseCache, stored: str, asked: str) -> None:
    await cache.store(ask(stored), ANSWER)
    # The embedding alone would call it a hit at a loose threshold; the guard must veto it.
    assert not (await cache.lookup(ask(asked), threshold=0.8)).hit


async def test_system_prompt_model_version_and_history_partition(cache: ResponseCache) -> None:
    await cache.store(ask(PASSWORD), ANSWER)
    assert not (await cache.lookup(ask(PASSWORD, system="Answer in French."))).hit
    assert not (await cache.lookup(ask(PASSWORD, model_version="2"))).hit
    history = [Message("user", "I use the mobile app."), Message("assistant", "OK.")]
    assert not (await cache.lookup(ask(PASSWORD_PARAPHRASE, history=history))).hit


async def test_only_reusable_answers_are_stored(cache: ResponseCache) -> None:
    r = await cache.store(ask(PASSWORD, temperature=0.8), ANSWER)
    assert (r.stored, r.reason) == (False, "not reusable")
    assert not (await cache.lookup(ask(PASSWORD, temperature=0.8))).hit
    assert (await cache.store(ask(PASSWORD, temperature=0.8), ANSWER, opt_in=True)).stored
    r = await cache.store(ask("What is the price of the Pro plan today?"), ANSWER)
    assert (r.stored, r.reason) == (False, "time-sensitive")
    assert not (await cache.store(ask(PASSWORD), Answer(text="Open Sett", finish_reason=3))).stored


async def test_kb_version_bump_makes_the_next_rag_question_miss(cache: ResponseCache) -> None:
    r = sync_redis.Redis.from_url(cache.settings.redis_url)
    prefix = cache.settings.kb_key_prefix
    r.set(f"{prefix}:kb:acme:manuals:version", 3)
    question = ask("What does the warranty cover?", kb="manuals")  # version 0: the current one (3)
    stored = await cache.store(question, ANSWER)
    assert stored.stored
    assert (await cache.lookup(question)).hit
    # what the indexer does after a write: bump the counter, announce the version
    r.incr(f"{prefix}:kb:acme:manuals:version")
    r.publish(cache.settings.version_channel, '{"tenant": "acme", "knowledge_base": "manuals", "version": 4}')
    # the cache drops the entry when the announcement reaches its subscriber, in the background
    await async_wait_until(lambda: not r.exists(f"{prefix}:e:{stored.key}"), timeout=5,
                           message="the stale entry was not dropped")
    miss = await cache.lookup(question)
    assert not miss.hit
    assert not (await cache.lookup(ask("What does the warranty cover?", kb="manuals", kb_version=3))).hit
    r.close()


async def test_invalidate_by_key_tenant_and_model(cache: ResponseCache) -> None:
    a = await cache.store(ask(PASSWORD), ANSWER)
    await cache.store(ask("Where is my invoice?"), ANSWER)
    await cache.store(ask(PASSWORD, tenant="globex"), ANSWER)
    assert await cache.invalidate(key=a.key) == 1
    assert not (await cache.lookup(ask(PASSWORD))).hit
    assert not (await cache.lookup(ask(PASSWORD_PARAPHRASE))).hit  # gone from L2 too
    assert await cache.invalidate(tenant="acme") == 1
    assert (await cache.lookup(ask(PASSWORD, tenant="globex"))).hit
    assert await cache.invalidate(model="smollm2") == 1


async def test_entries_survive_a_restart(make_cache: Any) -> None:
    first = make_cache()
    await first.store(ask(PASSWORD), ANSWER)
    await first.stop()
    second = make_cache()
    await second.start()  # rebuilds L2 from Redis
    try:
        hit = await second.lookup(ask(PASSWORD_PARAPHRASE))
        assert hit.hit and hit.layer == "l2"
    finally:
        await second.stop()


async def test_memory_is_bounded(make_cache: Any) -> None:
    cache = make_cache(max_entries=3)
    for i in range(5):
        await cache.store(ask(f"Question number {i} about invoices"), ANSWER)
    assert await cache.l1.count() == 3
    assert len(cache.index) == 3
    assert not (await cache.lookup(ask("Question number 0 about invoices"))).hit
    assert (await cache.lookup(ask("Question number 4 about invoices"))).hit
    await cache.stop()


async def test_redis_down_is_a_degraded_miss_not_an_error(make_cache: Any) -> None:
    cache = make_cache(redis_url=f"redis://127.0.0.1:{dead_port()}/0")
    await cache.start()
    try:
        miss = await cache.lookup(ask(PASSWORD))
        assert (miss.hit, miss.degraded) == (False, True)
        assert (await cache.store(ask(PASSWORD), ANSWER)).reason == "store unavailable"
        assert (await cache.stats())["degraded"] >= 1
    finally:
        await cache.stop()


async def test_bad_input_is_a_clear_error(make_cache: Any) -> None:
    cache = make_cache(max_entry_bytes=1024, tenants=["acme"])
    with pytest.raises(InvalidArgument, match="at most 1024"):
        await cache.store(ask(PASSWORD), Answer(text="x" * 2000))
    with pytest.raises(InvalidArgument, match="malformed"):
        await cache.invalidate(key="not-a-key")
    with pytest.raises(PermissionDenied, match="not known"):
        await cache.lookup(ask(PASSWORD, tenant="stranger"))
    with pytest.raises(InvalidArgument, match="tenant"):
        await cache.lookup(ask(PASSWORD, tenant="bad tenant!"))
    with pytest.raises(InvalidArgument, match="say what"):
        await cache.invalidate()
    await cache.stop()


async def test_kb_versions_come_from_the_indexers_redis_when_entries_have_their_own(
        redis_url: str, redis_prefix: str, vectoriser: Any) -> None:
    """KB_REDIS_URL (the chart's external.cacheRedis): entries in one Redis, the indexer's versions read and followed
    in another (here another database of the same server)."""
    from goodput_cache.__main__ import build
    from goodput_cache.config import CacheSettings

    kb_url = redis_url.rsplit("/", 1)[0] + "/1"
    settings = CacheSettings(redis_url=redis_url, kb_redis_url=kb_url, key_prefix=redis_prefix,
                             kb_key_prefix=redis_prefix, version_channel=f"{redis_prefix}:kb-version")
    cache = build(settings, CollectorRegistry(), None, vectoriser=vectoriser).cache
    versions = sync_redis.Redis.from_url(kb_url)
    version = f"{redis_prefix}:kb:acme:manuals:version"
    versions.set(version, 3)
    await cache.start()
    try:
        question = ask("What does the warranty cover?", kb="manuals")
        stored = await cache.store(question, ANSWER)
        assert stored.stored and (await cache.lookup(question)).hit
        # stored at the version read from the indexer's Redis (3), which it says is published
        assert (await cache.lookup(ask("What does the warranty cover?", kb="manuals", kb_version=3))).hit
        entries = sync_redis.Redis.from_url(redis_url)
        assert entries.get(version) is None  # not where the entries are
        versions.incr(version)  # what the indexer does after a write, in its own Redis
        versions.publish(settings.version_channel, '{"tenant": "acme", "knowledge_base": "manuals", "version": 4}')
        await async_wait_until(lambda: not entries.exists(f"{redis_prefix}:e:{stored.key}"), timeout=5,
                               message="the stale entry was not dropped")
        assert not (await cache.lookup(question)).hit
        entries.close()
    finally:
        await cache.stop()
        versions.delete(version)
        versions.close()
