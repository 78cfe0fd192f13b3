"""Thin gRPC servicers: Retrieval (Search) and the internal IndexStore, over :class:`Retriever`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc
from grpc import aio

from goodput_core.clients import EmbeddingClient

from goodput_retriever.search import Retriever, SearchQuery, chunk_from

_FUSION = {retriever_pb2.FUSION_UNSPECIFIED: "", retriever_pb2.FUSION_RRF: "rrf",
           retriever_pb2.FUSION_WEIGHTED: "weighted", retriever_pb2.FUSION_DENSE_ONLY: "dense",
           retriever_pb2.FUSION_LEXICAL_ONLY: "lexical"}


class GrpcQueryEmbedder:
    """Query embeddings from the embedder service (its micro-batcher shares model calls across searches)."""

    def __init__(self, channel: aio.Channel, *, timeout_s: float) -> None:
        self._client = EmbeddingClient(channel, timeout_s=timeout_s)

    async def embed_query(self, text: str) -> Sequence[float]:
        return await self._client.embed_one(text)


def _deadline(context: aio.ServicerContext) -> float | None:
    """The call's deadline on the monotonic clock (each leg gets the time left), less a margin for the reply."""
    left = context.time_remaining()
    return time.monotonic() + max(left - 0.005, 0.0) if left is not None else None


class RetrievalServicer(retriever_pb2_grpc.RetrievalServicer):
    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    async def Search(self, request: retriever_pb2.SearchRequest, context: aio.ServicerContext
                     ) -> retriever_pb2.SearchResponse:
        r = await self.retriever.search(SearchQuery(
            tenant=request.tenant, kb=request.knowledge_base, query=request.query, top_k=request.top_k,
            fusion=_FUSION.get(request.fusion, "?"), recall_k=request.recall_k, rerank=request.rerank,
            dense_weight=request.dense_weight if request.HasField("dense_weight") else None,
            leg_budget_s=max(request.leg_budget_s, 0.0), rerank_budget_s=max(request.rerank_budget_s, 0.0),
            deadline=_deadline(context)))
        return retriever_pb2.SearchResponse(
            hits=[retriever_pb2.Hit(chunk_id=h.chunk_id, document_id=h.document_id, score=h.score, text=h.text,
                                    metadata=h.metadata) for h in r.hits],
            degraded=r.degraded, notes=r.notes, kb_version=r.kb_version,
            timings=[retriever_pb2.LegTiming(leg=t.leg, seconds=t.seconds, ok=t.ok) for t in r.timings],
            rerank=retriever_pb2.RerankInfo(status=r.rerank.status, reason=r.rerank.reason, model=r.rerank.model,
                                            candidates=r.rerank.candidates, seconds=r.rerank.seconds))


class IndexStoreServicer(retriever_pb2_grpc.IndexStoreServicer):
    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    async def Open(self, request: retriever_pb2.OpenRequest, context: aio.ServicerContext
                   ) -> retriever_pb2.OpenResponse:
        created, version = await self.retriever.open(request.tenant, request.knowledge_base)
        return retriever_pb2.OpenResponse(created=created, kb_version=version)

    async def Write(self, request: retriever_pb2.WriteRequest, context: aio.ServicerContext
                    ) -> retriever_pb2.WriteResponse:
        n = await self.retriever.write(
            request.tenant, request.knowledge_base, upserts=[chunk_from(c) for c in request.upserts],
            delete_chunk_ids=list(request.delete_chunk_ids), delete_document_ids=list(request.delete_document_ids),
            generation=request.rebuild_id, kb_version=request.kb_version)
        return retriever_pb2.WriteResponse(upserted=n)

    async def BeginRebuild(self, request: retriever_pb2.BeginRebuildRequest, context: aio.ServicerContext
                           ) -> retriever_pb2.BeginRebuildResponse:
        return retriever_pb2.BeginRebuildResponse(
            rebuild_id=await self.retriever.begin_rebuild(request.tenant, request.knowledge_base))

    async def CommitRebuild(self, request: retriever_pb2.CommitRebuildRequest, context: aio.ServicerContext
                            ) -> retriever_pb2.CommitRebuildResponse:
        await self.retriever.commit_rebuild(request.tenant, request.knowledge_base, request.rebuild_id,
                                            request.kb_version)
        return retriever_pb2.CommitRebuildResponse()
