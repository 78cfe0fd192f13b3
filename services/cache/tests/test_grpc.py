"""The Cache gRPC API in-process: a round trip, and domain errors mapped to status codes."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from goodput.cache.v1 import cache_pb2, cache_pb2_grpc
from goodput.common.v1 import types_pb2
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_cache.__main__ import build
from goodput_cache.config import CacheSettings


async def test_grpc_round_trip_and_errors(redis_url: str, redis_prefix: str, vectoriser: Any) -> None:
    prefix = redis_prefix
    settings = CacheSettings(grpc_port=0, http_port=0, redis_url=redis_url, key_prefix=prefix,
                             kb_key_prefix=prefix, version_channel=f"{prefix}:kb-version", max_entry_bytes=1024)
    runner, cache = build(settings, CollectorRegistry(), None, vectoriser=vectoriser)
    await runner.start()
    await cache.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as ch:
            stub = cache_pb2_grpc.CacheStub(ch)
            key = cache_pb2.CacheKeyParts(
                tenant="acme", model="smollm2", model_version="1",
                messages=[types_pb2.ChatMessage(role="user", content="How do I reset my password?")],
                sampling=types_pb2.SamplingParams(max_tokens=32, temperature=0.0))
            source = cache_pb2.CachedSource(chunk_id="faq#3", document_id="faq", score=0.5, text="Security tab")
            stored = await stub.Store(cache_pb2.StoreRequest(
                key=key, text="Settings > Security.", finish_reason=types_pb2.FINISH_REASON_STOP,
                usage=types_pb2.Usage(completion_tokens=5), sources=[source]))
            assert stored.stored
            hit = await stub.Lookup(cache_pb2.LookupRequest(key=key, allow_semantic=True))
            assert (hit.hit, hit.layer, hit.text) == (True, "l1", "Settings > Security.")
            assert hit.usage.completion_tokens == 5
            assert list(hit.sources) == [source], "a RAG hit carries the sources the live answer had"
            stats = await stub.Stats(cache_pb2.StatsRequest(tenant="acme"))
            assert stats.tokens_saved == 5 and stats.layers[0].hits == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Store(cache_pb2.StoreRequest(key=key, text="x" * 5000))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Invalidate(cache_pb2.InvalidateRequest(key="../../etc"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(cache_pb2.LookupRequest(key=cache_pb2.CacheKeyParts(model="m")))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in err.value.details()
    finally:
        await runner.stop()
