"""The Cache gRPC API: converts messages to the domain types of :mod:`goodput_cache.cache` and back."""

from __future__ import annotations

from goodput.cache.v1 import cache_pb2, cache_pb2_grpc
from goodput.common.v1 import types_pb2
from grpc import aio

from goodput_core.sampling import sampling_from_proto

from goodput_cache.cache import Answer, ResponseCache
from goodput_cache.keys import CacheRequest, Message

__all__ = ["CacheServicer", "to_request"]


def to_request(parts: cache_pb2.CacheKeyParts) -> CacheRequest:
    sampling = sampling_from_proto(parts.sampling)
    return CacheRequest(tenant=parts.tenant, model=parts.model, model_version=parts.model_version,
                        messages=[Message(m.role, m.content, m.name) for m in parts.messages], prompt=parts.prompt,
                        sampling=sampling, knowledge_base=parts.knowledge_base, kb_version=parts.kb_version)


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def Lookup(self, request: cache_pb2.LookupRequest,
                     context: aio.ServicerContext) -> cache_pb2.LookupResponse:
        r = await self.cache.lookup(to_request(request.key), allow_semantic=request.allow_semantic,
                                    threshold=request.threshold)
        resp = cache_pb2.LookupResponse(hit=r.hit, layer=r.layer, similarity=r.similarity, degraded=r.degraded,
                                        key=r.key, reason=r.reason, matched_query=r.matched_query,
                                        verdict=r.verdict, verifier_probability=r.verifier_probability,
                                        kb_version=r.kb_version)
        if r.answer is not None:
            a = r.answer
            resp.text = a.text
            resp.finish_reason = a.finish_reason  # type: ignore[assignment]
            resp.usage.CopyFrom(types_pb2.Usage(prompt_tokens=a.prompt_tokens, completion_tokens=a.completion_tokens,
                                                total_tokens=a.prompt_tokens + a.completion_tokens))
            resp.sources.extend(cache_pb2.CachedSource(**s) for s in a.sources)
        return resp

    async def Store(self, request: cache_pb2.StoreRequest, context: aio.ServicerContext) -> cache_pb2.StoreResponse:
        answer = Answer(text=request.text, finish_reason=int(request.finish_reason),
                        prompt_tokens=request.usage.prompt_tokens, completion_tokens=request.usage.completion_tokens,
                        sources=[{"chunk_id": s.chunk_id, "document_id": s.document_id, "score": s.score,
                                  "text": s.text} for s in request.sources])
        r = await self.cache.store(to_request(request.key), answer, opt_in=request.opt_in, ttl_s=request.ttl_s)
        return cache_pb2.StoreResponse(stored=r.stored, reason=r.reason, key=r.key, ttl_s=r.ttl_s)

    async def Invalidate(self, request: cache_pb2.InvalidateRequest,
                         context: aio.ServicerContext) -> cache_pb2.InvalidateResponse:
        removed = await self.cache.invalidate(tenant=request.tenant, knowledge_base=request.knowledge_base,
                                              key=request.key, model=request.model)
        return cache_pb2.InvalidateResponse(removed=removed)

    async def Stats(self, request: cache_pb2.StatsRequest, context: aio.ServicerContext) -> cache_pb2.StatsResponse:
        s = await self.cache.stats(request.tenant)
        layers = [cache_pb2.LayerStats(**layer) for layer in s["layers"]]  # type: ignore[attr-defined]
        return cache_pb2.StatsResponse(layers=layers, tokens_saved=int(s["tokens_saved"]),  # type: ignore[call-overload]
                                       gpu_seconds_saved=float(s["gpu_seconds_saved"]),  # type: ignore[arg-type]
                                       degraded=int(s["degraded"]))  # type: ignore[call-overload]
