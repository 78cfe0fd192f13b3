"""Micro-batching: concurrent Embed calls share one model call (continuous batching).

One model call runs at a time (a second concurrent call on the same cores would only slow both down), in a worker
thread so the event loop keeps accepting requests while it computes. When a call ends, everything that queued
meanwhile, up to ``max_batch`` texts, goes in the next call at once: under load, batches grow with the arrival
rate by themselves, and nobody waits longer than the call in front of it. An idle model takes a lone request at
once, unless ``window_ms`` is set: then the first request may wait that long (counted from its arrival) for
company, which trades its latency for fewer, fuller calls at low load. A full batch always goes at once.

Why no fixed window by default: a window is paid by every request on an idle service, and the interactive caller
(the cache's L2 lookup, a RAG query) is exactly the one that cannot afford it.

Example::

    batcher = MicroBatcher(model, window_ms=0, max_batch=64)
    vectors = await batcher.embed(["a", "b"])       # shares a model call with concurrent callers
    await batcher.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from goodput_embedder.models import Embedder

__all__ = ["BatcherMetrics", "MicroBatcher"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class BatcherMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.batch_size = Histogram("goodput_embedder_batch_size", "Texts per model call.", buckets=BATCH_BUCKETS,
                                    registry=registry)
        self.model_seconds = Histogram("goodput_embedder_model_seconds", "Duration of one model call.",
                                       registry=registry)
        self.queue_seconds = Histogram("goodput_embedder_queue_seconds", "Wait before a text's model call.",
                                       registry=registry)


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future[np.ndarray]
    arrived: float = field(default_factory=time.monotonic)


class MicroBatcher:
    def __init__(self, model: Embedder, *, window_ms: float, max_batch: int,
                 metrics: BatcherMetrics | None = None) -> None:
        self.model = model
        self.window_s = window_ms / 1000.0
        self.max_batch = max_batch
        self.metrics = metrics
        self.model_calls = 0
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def embed(self, texts: list[str]) -> np.ndarray:
        """Vectors for ``texts`` (any number: more than ``max_batch`` are split across model calls)."""
        if not texts:
            return np.zeros((0, self.model.dim), dtype=np.float32)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        loop = asyncio.get_running_loop()
        pending = [_Pending(texts[i:i + self.max_batch], loop.create_future())
                   for i in range(0, len(texts), self.max_batch)]
        for p in pending:
            self._queue.put_nowait(p)
        results = await asyncio.gather(*(p.future for p in pending))
        return np.concatenate(results, axis=0) if len(results) > 1 else results[0]

    async def _run(self) -> None:
        carry: _Pending | None = None
        while True:
            first = carry or await self._queue.get()
            carry = None
            batch = [first]
            size = len(first.texts)
            deadline = first.arrived + self.window_s  # a request that waited behind a call does not wait again
            while size < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    item = self._queue.get_nowait() if remaining <= 0 else \
                        await asyncio.wait_for(self._queue.get(), remaining)
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
                if size + len(item.texts) > self.max_batch:
                    carry = item  # opens the next batch
                    break
                batch.append(item)
                size += len(item.texts)
            await self._call(batch)

    async def _call(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]  # callers that gave up are skipped
        if not live:
            return
        texts = [t for p in live for t in p.texts]
        started = time.monotonic()
        try:
            vectors = await asyncio.to_thread(self.model.embed, texts)
        except Exception as err:  # noqa: BLE001 - handed to every caller of this batch
            for p in live:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        self.model_calls += 1
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(texts))
            self.metrics.model_seconds.observe(time.monotonic() - started)
            for p in live:
                self.metrics.queue_seconds.observe(started - p.arrived)
        offset = 0
        for p in live:
            n = len(p.texts)
            if not p.future.done():
                p.future.set_result(vectors[offset:offset + n])
            offset += n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
