"""The Embedding API: micro-batching over the real ONNX model, and its input checks."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_testing import async_wait_until

from goodput_embedder.__main__ import build
from goodput_embedder.batcher import MicroBatcher
from goodput_embedder.config import EmbedderSettings


async def test_concurrent_callers_share_model_calls(counting) -> None:
    batcher = MicroBatcher(counting, window_ms=20, max_batch=64)
    texts = [f"sentence number {i} about retrieval" for i in range(40)]
    try:
        results = await asyncio.gather(*(batcher.embed([t]) for t in texts))
    finally:
        await batcher.close()
    assert counting.calls <= 3  # 40 callers, a handful of model calls
    direct = counting.model.embed(texts)
    np.testing.assert_allclose(np.vstack(results), direct, atol=1e-5)
    assert np.allclose(np.linalg.norm(direct, axis=1), 1.0, atol=1e-4)


async def test_requests_arriving_during_a_model_call_share_the_next_one_without_a_window(counting) -> None:
    counting.gate = threading.Event()  # holds the first model call until the others have queued
    batcher = MicroBatcher(counting, window_ms=0, max_batch=64)
    try:
        first = asyncio.ensure_future(batcher.embed(["how do I reset my password?"]))
        # the idle model took the lone request at once
        assert await asyncio.to_thread(counting.called.wait, 30)
        later = [asyncio.ensure_future(batcher.embed([f"question number {i}"])) for i in range(10)]
        # all ten queued behind the running call (the batcher's queue; its tasks enqueue on their first step)
        await async_wait_until(lambda: batcher._queue.qsize() == 10, timeout=30, interval=0)
        counting.gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, *later), 30)
    finally:
        await batcher.close()
    assert counting.batches == [1, 10]  # the ten that queued behind the call went together, in the next one
    assert all(r.shape == (1, 384) for r in results)


async def test_a_full_batch_goes_at_once_and_large_requests_are_split(counting) -> None:
    batcher = MicroBatcher(counting, window_ms=5000, max_batch=8)  # the window would never close by itself
    try:
        out = await asyncio.wait_for(batcher.embed([f"t{i}" for i in range(20)]), 30)
    finally:
        await batcher.close()
    assert out.shape == (20, 384) and counting.calls == 3


@pytest.fixture
async def embedder(model, redis_url):  # type: ignore[no-untyped-def]
    settings = EmbedderSettings(grpc_port=0, http_port=0, redis_url=redis_url, drain_grace_s=0,
                                retriever_addr="127.0.0.1:1", max_texts=4, max_text_chars=100)
    runner, _ = build(settings, CollectorRegistry(), None, model=model)
    await runner.start()
    channel = aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}")
    yield embedder_pb2_grpc.EmbeddingStub(channel), embedder_pb2_grpc.IndexerStub(channel)
    await channel.close()
    await runner.stop()


async def test_embed_over_grpc(embedder) -> None:  # type: ignore[no-untyped-def]
    stub, _ = embedder
    r = await stub.Embed(embedder_pb2.EmbedRequest(texts=["hello world", "goodbye"]))
    assert len(r.vectors) == 2 and len(r.vectors[0].values) == 384 and r.tokens > 0
    assert r.model == "all-MiniLM-L6-v2-onnx-int8"


async def test_describe_model_names_what_embed_answers_with(embedder) -> None:  # type: ignore[no-untyped-def]
    stub, _ = embedder
    m = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
    assert m.name == "all-MiniLM-L6-v2-onnx-int8" and m.dimensions == 384 and "all-MiniLM-L6-v2" in m.aliases


@pytest.mark.parametrize("texts, model_name", [([], ""), (["ok", " "], ""), (["a"] * 5, ""), (["x" * 101], ""),
                                          (["ok"], "text-embedding-3-large")])
async def test_bad_embed_requests_are_invalid_argument(embedder, texts, model_name) -> None:  # type: ignore[no-untyped-def]
    stub, _ = embedder
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Embed(embedder_pb2.EmbedRequest(texts=texts, model=model_name))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_job_status_of_an_unknown_job_is_not_found(embedder) -> None:  # type: ignore[no-untyped-def]
    _, indexer = embedder
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await indexer.JobStatus(embedder_pb2.JobStatusRequest(job_id="job-nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await indexer.Reindex(embedder_pb2.ReindexRequest(tenant="acme", knowledge_base="bad name!",
                                                          source_uri="/x"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
