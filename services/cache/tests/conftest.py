"""Fixtures of the cache's unit tests: the real ONNX embedding model (loaded once) and a real Redis (goodput_testing's
``redis_url``), each test under its own key prefix (``redis_prefix``, deleted afterwards), so tests never see each
other's entries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from goodput_cache.cache import CacheMetrics, ResponseCache
from goodput_cache.config import CacheSettings
from goodput_cache.embedding import LocalVectoriser
from goodput_cache.keys import CacheRequest, Message, Sampling


@pytest.fixture(scope="session")
def vectoriser() -> LocalVectoriser:
    return LocalVectoriser()


@pytest.fixture
def make_cache(redis_prefix: str, redis_url: str, vectoriser: LocalVectoriser) -> Any:
    prefix = redis_prefix
    made: list[ResponseCache] = []

    def make(registry: CollectorRegistry | None = None, *, embed_with: Any = None, verifier: Any = None,
             **overrides: Any) -> ResponseCache:
        options: dict[str, Any] = {"redis_url": redis_url, "key_prefix": prefix, "kb_key_prefix": prefix,
                                   "version_channel": f"{prefix}:kb-version", **overrides}
        settings = CacheSettings(**options)
        redis_client = Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s,
                                      socket_connect_timeout=settings.redis_timeout_s)
        cache = ResponseCache(settings, redis=redis_client, vectoriser=embed_with or vectoriser,
                              metrics=CacheMetrics(registry), verifier=verifier)
        made.append(cache)
        return cache

    return make


@pytest.fixture
async def cache(make_cache: Callable[..., ResponseCache]) -> AsyncIterator[ResponseCache]:
    c = make_cache()
    await c.start()
    yield c
    await c.stop()


def ask(question: str, *, tenant: str = "acme", system: str = "You are a helpful support agent.",
        temperature: float | None = 0.0, kb: str = "", kb_version: int = 0, model_version: str = "1",
        history: list[Message] | None = None) -> CacheRequest:
    messages = [Message("system", system), *(history or []), Message("user", question)]
    return CacheRequest(tenant=tenant, model="smollm2", model_version=model_version, messages=messages,
                        sampling=Sampling(max_tokens=64, temperature=temperature), knowledge_base=kb,
                        kb_version=kb_version)
