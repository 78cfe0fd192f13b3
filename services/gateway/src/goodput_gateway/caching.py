"""The gateway's side of the response cache: look up before scheduling, replay a hit as a stream, store after a
stream completes (off the response path).

A hit is replayed by :func:`replay` with the same events as a live answer (TextDelta pieces, then StreamEnd with the
usage the original answer had), so REST (SSE or JSON) and gRPC shape it exactly like a live one; no worker and no
lease are involved. A miss is stored by :meth:`GatewayCache.storing`, a wrapper around the live token stream that
sends the answer to the cache once the stream has finished. Every response says what the cache did
(:class:`CacheStatus`): REST in the ``X-Goodput-Cache`` header and a ``goodput_cache`` object in the body (first
chunk of a stream), gRPC in the ``x-goodput-cache`` metadata and ``CacheInfo`` of a hit.

Only greedy requests (temperature 0) are looked up and stored: any other answer is a sample, not the answer.
Per request, ``Cache-Control: no-cache`` skips the lookup (the fresh answer is still stored, unless it is a RAG one)
and ``no-store`` skips both lookup and store. A RAG answer is stored under the knowledge-base version its lookup was
answered at (``LookupResponse.kb_version``, read before retrieval): if the knowledge base moves on while the answer
is retrieved and generated, the cache refuses it rather than file it under the newer version. Without a version from
a lookup (``no-cache``, a failed lookup, a knowledge base never indexed) a RAG answer is not stored. Fail-open: a
cache that is slow (``cache_timeout_s``), down or erroring never fails a request; it is served uncached and counted
in ``goodput_gateway_cache_total{result="error"}``.

Example (inside the service, with a cache server on ``channel``)::

    cache = GatewayCache(settings, stub=cache_pb2_grpc.CacheStub(channel), registry=registry)
    status, hit = await cache.lookup(principal, request, model, cache_control="")
    events = replay(hit) if hit else cache.storing(stream.events(), status, sources)

A hit replays as word pieces, then the original usage; its status is what the ``X-Goodput-Cache`` header says:

    >>> import asyncio
    >>> hit = cache_pb2.LookupResponse(hit=True, text="Goodput is useful throughput.",
    ...                                finish_reason=types_pb2.FINISH_REASON_STOP,
    ...                                usage=types_pb2.Usage(prompt_tokens=5, completion_tokens=4))
    >>> async def events() -> list[TextDelta | StreamEnd]:
    ...     return [event async for event in replay(hit)]
    >>> for event in asyncio.run(events()):
    ...     print(event.text if isinstance(event, TextDelta) else (event.finish_reason, event.completion_tokens))
    Goodput
     is
     useful
     throughput.
    ('stop', 4)
    >>> CacheStatus("hit", layer="l2", similarity=0.9731).header()
    'hit; layer=l2; similarity=0.973'
    >>> verified = CacheStatus("hit", layer="l2", similarity=0.88, verdict="same", verifier_probability=0.9712)
    >>> verified.header(), verified.as_dict()["verifier"]
    ('hit; layer=l2; similarity=0.880; verified=0.971', {'verdict': 'same', 'probability': 0.9712})
    >>> CacheStatus("miss", reason="verifier: not the same question", verdict="different").as_dict()["verifier"]
    {'verdict': 'different', 'probability': 0.0}
    >>> CacheStatus("bypass", reason="no-store").header()
    'bypass; reason=no-store'
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from goodput.cache.v1 import cache_pb2, cache_pb2_grpc
from goodput.common.v1 import types_pb2
from prometheus_client import CollectorRegistry, Counter

from goodput_core.breaker import CircuitBreaker
from goodput_core.errors import Unavailable
from goodput_core.sampling import sampling_to_proto

from goodput_gateway.auth import Principal
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import FINISH_PB, StreamEnd, TextDelta, finish_reason
from goodput_gateway.rag import Source
from goodput_gateway.requests import GenerationRequest
from goodput_gateway.tools import auto

__all__ = ["CACHE_HEADER", "CacheStatus", "GatewayCache", "replay", "sources_of"]

log = logging.getLogger("goodput.gateway.cache")
CACHE_HEADER = "X-Goodput-Cache"
# Replay granularity: a word with its leading whitespace, about what a worker's delta carries.
_PIECE = re.compile(r"\s*\S+|\s+$")


@dataclass
class CacheStatus:
    """What the cache did for one request."""

    status: str = "miss"           # hit, miss, bypass (no-cache / no-store / off), error (served uncached)
    layer: str = ""                # l1 or l2 on a hit
    similarity: float = 0.0
    reason: str = ""
    store: bool = True
    verdict: str = ""  # the cache's verifier: "same" on a verified hit, "different"/"skipped" on a miss it caused
    verifier_probability: float = 0.0
    key: cache_pb2.CacheKeyParts | None = field(default=None, repr=False)

    def header(self) -> str:
        """``hit; layer=l2; similarity=0.973`` or ``miss`` (the value of X-Goodput-Cache)."""
        if self.status == "hit":
            verified = f"; verified={self.verifier_probability:.3f}" if self.verdict == "same" else ""
            return f"hit; layer={self.layer}; similarity={self.similarity:.3f}{verified}"
        return self.status + (f"; reason={self.reason}" if self.reason else "")

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata saying the same (``x-goodput-cache``)."""
        return ((CACHE_HEADER.lower(), self.header()),)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "hit": self.status == "hit"}
        if self.status == "hit":
            out.update(layer=self.layer, similarity=round(self.similarity, 4))
        if self.reason:
            out["reason"] = self.reason
        if self.verdict:
            out["verifier"] = {"verdict": self.verdict, "probability": round(self.verifier_probability, 4)}
        return out


def _directives(cache_control: str) -> set[str]:
    return {d.strip().split("=", 1)[0].lower() for d in cache_control.split(",") if d.strip()}


async def replay(answer: cache_pb2.LookupResponse) -> AsyncIterator[TextDelta | StreamEnd]:
    """A cached answer as the events of a live one (its tokens counted out in proportion to its text)."""
    total, done = max(len(answer.text), 1), 0
    for piece in _PIECE.findall(answer.text):
        done += len(piece)
        yield TextDelta(piece, prompt_tokens=answer.usage.prompt_tokens,
                        completion_tokens=round(answer.usage.completion_tokens * done / total))
    yield StreamEnd(finish_reason=finish_reason(answer.finish_reason),
                    prompt_tokens=answer.usage.prompt_tokens, completion_tokens=answer.usage.completion_tokens)


def sources_of(answer: cache_pb2.LookupResponse) -> list[Source]:
    """The RAG sources a cached answer was grounded on."""
    return [Source(chunk_id=s.chunk_id, document_id=s.document_id, score=s.score, text=s.text) for s in answer.sources]


class GatewayCache:
    def __init__(self, settings: GatewaySettings, *, stub: cache_pb2_grpc.CacheStub,
                 registry: CollectorRegistry | None, breaker: CircuitBreaker | None = None) -> None:
        self.settings = settings
        self.stub = stub
        self.breaker = breaker or CircuitBreaker("cache")  # open: the cache is skipped at once (fail-open)
        self.results = Counter("goodput_gateway_cache_total", "Cache outcome per request (hit_l1, hit_l2, miss, "
                               "bypass, error = served uncached because the cache failed).", ["result"],
                               registry=registry)
        self.stores = Counter("goodput_gateway_cache_stores_total", "Store calls after a completed stream by "
                              "result (stored, the cache's reason not to, error).", ["result"], registry=registry)
        self._background: set[asyncio.Task[None]] = set()

    def key_parts(self, principal: Principal, request: GenerationRequest, model: ModelEntry) -> cache_pb2.CacheKeyParts:
        return cache_pb2.CacheKeyParts(
            tenant=principal.tenant, model=model.id, model_version=model.model_version,
            messages=[types_pb2.ChatMessage(role=m.role, content=m.content, name=m.name) for m in request.messages],
            prompt=request.prompt, sampling=sampling_to_proto(request.sampling),
            knowledge_base=request.knowledge_base)

    async def lookup(self, principal: Principal, request: GenerationRequest, model: ModelEntry, *,
                     cache_control: str, timeout_s: float | None = None,
                     semantic: bool = True) -> tuple[CacheStatus, cache_pb2.LookupResponse | None]:
        """``semantic=False``: exact repeats only (the ladder's exact_cache_only step)."""
        """What the cache did, and the cached answer on a hit. Never raises for the cache's own failures."""
        directives = _directives(cache_control)
        key = self.key_parts(principal, request, model)
        if "no-store" in directives:
            self.results.labels("bypass").inc()
            return CacheStatus("bypass", reason="no-store", store=False), None
        if "no-cache" in directives:
            self.results.labels("bypass").inc()
            return CacheStatus("bypass", reason="no-cache", key=key, store=not key.knowledge_base), None
        if request.sampling.temperature != 0 or request.sampling.logprobs is not None or request.sampling.n > 1 \
                or auto(request):
            # Only greedy answers are stored, so nothing could be found: no lookup, no store. Nor are answers with
            # log probabilities (a stored answer keeps its text, not its tokens' probabilities), nor answers whose
            # tools the model chose to call (a stored answer keeps its text, not the calls its parser read).
            self.results.labels("bypass").inc()
            return CacheStatus("bypass", reason="not reusable", store=False), None
        try:
            async with self.breaker.guard():
                resp = await self.stub.Lookup(
                    cache_pb2.LookupRequest(key=key, allow_semantic=self.settings.cache_semantic and semantic),
                    timeout=timeout_s or self.settings.cache_timeout_s)
        except Unavailable:  # its breaker is open: not even tried
            self.results.labels("error").inc()
            return CacheStatus("error", reason="cache breaker open", key=key, store=not key.knowledge_base), None
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            self.results.labels("error").inc()
            code = err.code().name if isinstance(err, grpc.aio.AioRpcError) else type(err).__name__
            log.warning("cache lookup failed, serving uncached", extra={"code": code})
            return CacheStatus("error", reason="cache unavailable", key=key, store=not key.knowledge_base), None
        if not resp.hit:
            self.results.labels("error" if resp.degraded else "miss").inc()
            # RAG: the answer is stored under the version this lookup read, before retrieval (none: not stored)
            key.kb_version = resp.kb_version
            return CacheStatus("error" if resp.degraded else "miss", reason=resp.reason, key=key, verdict=resp.verdict,
                               verifier_probability=resp.verifier_probability,
                               store=not key.knowledge_base or resp.kb_version > 0), None
        self.results.labels(f"hit_{resp.layer}").inc()
        return CacheStatus("hit", layer=resp.layer, similarity=resp.similarity, store=False, verdict=resp.verdict,
                           verifier_probability=resp.verifier_probability), resp

    async def storing(self, events: AsyncIterator[TextDelta | StreamEnd], status: CacheStatus,
                      sources: list[Source]) -> AsyncIterator[TextDelta | StreamEnd]:
        """``events`` unchanged; once they end with a finished answer, it is stored in the background (a stream
        that fails or is abandoned stores nothing)."""
        if not status.store or status.key is None:
            async for event in events:
                yield event
            return
        parts: list[str] = []
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif event.finish_reason in ("stop", "length"):  # an aborted answer is not stored
                self._store_later(status.key, "".join(parts), event, sources)
            yield event

    def _store_later(self, key: cache_pb2.CacheKeyParts, text: str, end: StreamEnd, sources: list[Source]) -> None:
        store = cache_pb2.StoreRequest(
            key=key, text=text, finish_reason=FINISH_PB[end.finish_reason],
            usage=types_pb2.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                                  total_tokens=end.prompt_tokens + end.completion_tokens),
            sources=[cache_pb2.CachedSource(chunk_id=s.chunk_id, document_id=s.document_id, score=s.score,
                                            text=s.text) for s in sources])
        task = asyncio.get_running_loop().create_task(self._store(store))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _store(self, store: cache_pb2.StoreRequest) -> None:
        try:
            async with self.breaker.guard():
                resp = await self.stub.Store(store, timeout=5.0)
        except (grpc.RpcError, asyncio.TimeoutError, Unavailable):
            self.stores.labels("error").inc()
            return
        self.stores.labels("stored" if resp.stored else (resp.reason or "not stored")).inc()

    async def settle(self) -> None:
        """Waits (up to 5 s) for the stores sent off the response path."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
