"""The cache with its vectors from the Embedding service over gRPC (``GOODPUT_CACHE_EMBEDDER_ADDR``): the real
embedder service in-process on a free port, sharing the tests' model; and the same cache when that service is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_testing import dead_port

from goodput_cache.embedding import LocalVectoriser, RemoteVectoriser
from goodput_embedder.__main__ import build as build_embedder
from goodput_embedder.config import EmbedderSettings

from .conftest import ask
from .test_cache import ANSWER, PASSWORD, PASSWORD_PARAPHRASE


@pytest.fixture
async def remote(vectoriser: LocalVectoriser, redis_url: str) -> AsyncIterator[RemoteVectoriser]:
    settings = EmbedderSettings(grpc_port=0, http_port=0, redis_url=redis_url, drain_grace_s=0,
                                retriever_addr="127.0.0.1:1")
    runner, _ = build_embedder(settings, CollectorRegistry(), None, model=vectoriser.model)
    await runner.start()
    channel = aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}")
    yield RemoteVectoriser(channel, timeout_s=10.0)
    await channel.close()
    await runner.stop()


async def test_vectors_from_the_service_find_entries_stored_in_process(make_cache: Any, remote: RemoteVectoriser,
                                                                         vectoriser: LocalVectoriser) -> None:
    local = make_cache()
    assert (await local.store(ask(PASSWORD), ANSWER)).stored
    served = make_cache(embed_with=remote)
    await served.start()  # reloads the L2 index from Redis: the vectors the in-process model stored
    try:
        hit = await served.lookup(ask(PASSWORD_PARAPHRASE))
        assert hit.hit and hit.layer == "l2" and hit.matched_query == PASSWORD
    finally:
        await served.stop()
    np.testing.assert_allclose((await remote.embed([PASSWORD]))[0], vectoriser.embed_sync([PASSWORD])[0], atol=1e-5)


async def test_embedding_service_down_serves_uncached_and_stores_for_l1(make_cache: Any) -> None:
    channel = aio.insecure_channel(f"127.0.0.1:{dead_port()}")
    registry = CollectorRegistry()
    cache = make_cache(registry, embed_with=RemoteVectoriser(channel, timeout_s=0.5))
    try:
        miss = await cache.lookup(ask(PASSWORD))
        assert (miss.hit, miss.degraded) == (False, True)  # an answer, not an error: generated uncached
        assert (await cache.store(ask(PASSWORD), ANSWER)).stored  # kept for exact repeats
        assert (await cache.lookup(ask(PASSWORD))).layer == "l1"
        assert registry.get_sample_value("goodput_cache_degraded_total", {"store": "embedder"}) == 2
    finally:
        await channel.close()
