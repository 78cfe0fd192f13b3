"""A RAG answer is stored only under the knowledge-base version it was generated from: the version a lookup read
(before retrieval) goes back with the Store, and a knowledge base that moved on in between makes the Store a refusal,
never an entry under the newer version. Against the real Redis and embedding model."""

from __future__ import annotations

from typing import Any

import redis as sync_redis
from prometheus_client import CollectorRegistry

from goodput_cache.cache import Answer, ResponseCache
from goodput_cache.keys import derive

from .conftest import ask

QUESTION = "What does the warranty cover?"
PARAPHRASE = "What is covered by the warranty?"
V1_ANSWER = Answer(text="Parts and labour for two years.", completion_tokens=8)


def _bump(cache: ResponseCache, r: sync_redis.Redis, *, announce: bool = True) -> int:
    """What the indexer does after a write: bump the counter, announce the version."""
    version = int(r.incr(f"{cache.settings.kb_key_prefix}:kb:acme:manuals:version"))
    if announce:
        r.publish(cache.settings.version_channel,
                  f'{{"tenant": "acme", "knowledge_base": "manuals", "version": {version}}}')
    return version


def _stores(registry: CollectorRegistry, result: str) -> float:
    return registry.get_sample_value("goodput_cache_stores_total", {"result": result}) or 0.0


async def test_an_answer_generated_from_v1_is_not_stored_once_the_kb_is_at_v2(make_cache: Any) -> None:
    registry = CollectorRegistry()
    cache = make_cache(registry)
    await cache.start()
    r = sync_redis.Redis.from_url(cache.settings.redis_url)
    try:
        r.set(f"{cache.settings.kb_key_prefix}:kb:acme:manuals:version", 1)
        looked = await cache.lookup(ask(QUESTION, kb="manuals"))  # before retrieval: the version is read
        assert not looked.hit and looked.kb_version == 1
        assert _bump(cache, r) == 2  # the knowledge base changes while the answer is retrieved and generated
        stored = await cache.store(ask(QUESTION, kb="manuals", kb_version=looked.kb_version), V1_ANSWER)
        assert (stored.stored, stored.reason) == (False, "stale knowledge base")
        assert _stores(registry, "stale knowledge base") == 1
        for question in (QUESTION, PARAPHRASE):  # not served at v2, exactly or semantically
            miss = await cache.lookup(ask(question, kb="manuals"))
            assert not miss.hit and miss.kb_version == 2, question
        # nothing was written under either version
        for version in (1, 2):
            assert await cache.l1.get(derive(ask(QUESTION, kb="manuals", kb_version=version)).exact) is None
        assert len(cache.index) == 0
        # an answer generated at v2 is stored under v2 and served there
        assert (await cache.store(ask(QUESTION, kb="manuals", kb_version=2), V1_ANSWER)).stored
        hit = await cache.lookup(ask(PARAPHRASE, kb="manuals"))
        assert hit.hit and hit.layer == "l2" and hit.kb_version == 2
    finally:
        r.close()
        await cache.stop()


async def test_a_bump_during_the_write_takes_the_entry_back(make_cache: Any) -> None:
    """The bump lands between the version check and the write: the knowledge base's entries may have been listed for
    dropping before this one was among them, so the store takes it back itself."""
    registry = CollectorRegistry()
    cache = make_cache(registry)
    r = sync_redis.Redis.from_url(cache.settings.redis_url)
    r.set(f"{cache.settings.kb_key_prefix}:kb:acme:manuals:version", 1)
    put = cache.l1.put

    async def put_then_bump(*args: Any, **kwargs: Any) -> list[str]:
        evicted = await put(*args, **kwargs)
        _bump(cache, r, announce=False)  # no announcement reaches this cache: only its own check can catch it
        return evicted

    cache.l1.put = put_then_bump  # type: ignore[method-assign]
    try:
        stored = await cache.store(ask(QUESTION, kb="manuals", kb_version=1), V1_ANSWER)
        assert (stored.stored, stored.reason) == (False, "stale knowledge base")
        assert await cache.l1.get(derive(ask(QUESTION, kb="manuals", kb_version=1)).exact) is None
        assert len(cache.index) == 0
        assert not (await cache.lookup(ask(PARAPHRASE, kb="manuals"))).hit
    finally:
        r.close()
        await cache.stop()


async def test_a_lookup_serves_only_the_current_version(make_cache: Any) -> None:
    cache = make_cache()
    r = sync_redis.Redis.from_url(cache.settings.redis_url)
    try:
        r.set(f"{cache.settings.kb_key_prefix}:kb:acme:manuals:version", 3)
        assert (await cache.store(ask(QUESTION, kb="manuals", kb_version=3), V1_ANSWER)).stored
        assert (await cache.lookup(ask(QUESTION, kb="manuals", kb_version=3))).hit
        _bump(cache, r, announce=False)  # v4, before the announcement drops the v3 entries
        for version in (0, 3):  # neither the current version nor the old one named explicitly is served v3's answer
            for question in (QUESTION, PARAPHRASE):
                miss = await cache.lookup(ask(question, kb="manuals", kb_version=version))
                assert not miss.hit, (version, question)
        assert (await cache.lookup(ask(QUESTION, kb="manuals", kb_version=3))).reason == "stale knowledge base"
        # a version the indexer has not published is neither served nor stored
        assert (await cache.lookup(ask(QUESTION, kb="manuals", kb_version=9))).reason == \
            "unknown knowledge-base version"
        assert (await cache.store(ask(QUESTION, kb="manuals", kb_version=9), V1_ANSWER)).reason == \
            "unknown knowledge-base version"
    finally:
        r.close()
        await cache.stop()
