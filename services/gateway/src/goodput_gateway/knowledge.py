"""The knowledge path of the gateway: embeddings, search and indexing, which its gRPC API (``Embed``, ``Search``,
``Index``, :mod:`goodput_gateway.servicer`) and REST API (:mod:`goodput_gateway.api.knowledge`) call. Every call is
scoped to the caller's tenant (from its API key).

A feature whose backend address is not configured (``GOODPUT_GATEWAY_EMBEDDER_ADDR``, ``..._RETRIEVER_ADDR``)
answers UNIMPLEMENTED / 501.

Example (with the embedder and retriever up, inside a coroutine)::

    knowledge = Knowledge(settings, channel_factory=lambda addr: make_channel(addr, provider))
    hits = await knowledge.search("acme", "handbook", "refund policy", top_k=5)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc
from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc
from grpc import aio

from goodput_core.breaker import CircuitBreaker
from goodput_core.clients import EmbeddingClient, Embeddings
from goodput_core.errors import GoodputError, InvalidArgument, Unimplemented, from_rpc_error

from goodput_gateway.config import GatewaySettings
from goodput_gateway.requests import check_length

__all__ = ["Knowledge", "chars", "require"]

_FUSION = {"": retriever_pb2.FUSION_UNSPECIFIED, "rrf": retriever_pb2.FUSION_RRF,
           "weighted": retriever_pb2.FUSION_WEIGHTED}
log = logging.getLogger("goodput.gateway.knowledge")

NO_EMBEDDER = "embeddings need the embedder service, which this gateway is not configured with"
NO_RETRIEVER = "search needs the retriever service, which this gateway is not configured with"
NO_INDEXER = "indexing needs the embedder service, which this gateway is not configured with"


class Knowledge:
    def __init__(self, settings: GatewaySettings, *, channel_factory: Callable[[str], aio.Channel],
                 breakers: dict[str, CircuitBreaker] | None = None) -> None:
        self.settings = settings
        breakers = breakers or {}
        # open: the hop is refused at once (503 with the breaker's retry-after), not waited out
        self.retriever_breaker = breakers.get("retriever") or CircuitBreaker("retriever")
        self.embedder_breaker = breakers.get("embedder") or CircuitBreaker("embedder")
        self._channels: list[aio.Channel] = []
        self._embedding: EmbeddingClient | None = None
        self._indexer: embedder_pb2_grpc.IndexerStub | None = None
        self._retrieval: retriever_pb2_grpc.RetrievalStub | None = None
        self._embedding_model: tuple[str, int] | None = None
        if settings.embedder_addr:
            ch = channel_factory(settings.embedder_addr)
            self._channels.append(ch)
            self._embedding = EmbeddingClient(ch, timeout_s=settings.knowledge_timeout_s)
            self._indexer = embedder_pb2_grpc.IndexerStub(ch)
        if settings.retriever_addr:
            ch = channel_factory(settings.retriever_addr)
            self._channels.append(ch)
            self._retrieval = retriever_pb2_grpc.RetrievalStub(ch)

    @property
    def retrieval_enabled(self) -> bool:
        return self._retrieval is not None

    async def embedding_model(self) -> tuple[str, int] | None:
        """The embedder's model (name, dimensions), asked once and kept; None without an embedder or while it does
        not answer (asked again next time)."""
        if self._embedding is None:
            return None
        if self._embedding_model is None:
            try:
                self._embedding_model = await self._embedding.describe()
            except GoodputError as err:
                log.warning("the embedder did not describe its model", extra={"error": err.message})
                return None
        return self._embedding_model

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(grace=None)

    async def _call(self, fn: Callable[..., Awaitable[Any]], request: Any, *, breaker: CircuitBreaker,
                    timeout_s: float | None = None) -> Any:
        try:
            async with breaker.guard():
                return await fn(request, timeout=min(timeout_s or self.settings.knowledge_timeout_s,
                                                     self.settings.knowledge_timeout_s))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    # Input bounds come first, whether or not the backend is configured: the same input gets the same answer on
    # every deployment and on both APIs.

    async def embed(self, texts: list[str], model: str = "") -> Embeddings:
        if not texts:
            raise InvalidArgument("'input' must not be empty", param="input", code="invalid_value")
        if len(texts) > self.settings.limits.embed_batch:
            raise InvalidArgument(f"{len(texts)} inputs; the limit is {self.settings.limits.embed_batch}",
                                  param="input", code="invalid_value")
        for i, text in enumerate(texts):
            check_length(text, self.settings.limits.embed_input_chars, param=f"input[{i}]")
        check_length(model, self.settings.limits.name_chars, param="model")
        if self._embedding is None:
            raise Unimplemented(NO_EMBEDDER)
        async with self.embedder_breaker.guard():
            return await self._embedding.embed(texts, model=model)

    async def search(self, tenant: str, kb: str, query: str, *, top_k: int = 0, fusion: str = "",
                     dense_weight: float | None = None, rerank: bool = False, timeout_s: float | None = None,
                     leg_budget_s: float = 0.0, rerank_budget_s: float = 0.0) -> retriever_pb2.SearchResponse:
        """``timeout_s``: the caller's stage budget (capped by knowledge_timeout_s); the leg and rerank budgets go to
        the retriever, which runs each leg under min(its budget, the time left)."""
        check_length(kb, self.settings.limits.name_chars, param="knowledge_base")
        check_length(query, self.settings.limits.query_chars, param="query")
        if self._retrieval is None:
            raise Unimplemented(NO_RETRIEVER)
        if fusion not in _FUSION:
            raise InvalidArgument("'fusion' must be 'rrf' or 'weighted'", param="fusion", code="invalid_value")
        req = retriever_pb2.SearchRequest(tenant=tenant, knowledge_base=kb, query=query, top_k=top_k,
                                          fusion=_FUSION[fusion], rerank=rerank, leg_budget_s=leg_budget_s,
                                          rerank_budget_s=rerank_budget_s)
        if dense_weight is not None:
            req.dense_weight = dense_weight
        return await self._call(self._retrieval.Search, req, breaker=self.retriever_breaker, timeout_s=timeout_s)

    async def index(self, tenant: str, kb: str, documents: list[embedder_pb2.Document],
                    delete_ids: list[str]) -> embedder_pb2.IndexDocumentsResponse:
        check_length(kb, self.settings.limits.name_chars, param="knowledge_base")
        if self._indexer is None:
            raise Unimplemented(NO_INDEXER)
        request = embedder_pb2.IndexDocumentsRequest(tenant=tenant, knowledge_base=kb, documents=documents,
                                                     delete_ids=delete_ids)
        return await self._call(self._indexer.IndexDocuments, request, breaker=self.embedder_breaker)


def require(knowledge: Knowledge | None) -> Knowledge:
    """The knowledge path, or UNIMPLEMENTED / 501 on a gateway configured without it."""
    if knowledge is None:
        raise Unimplemented(NO_RETRIEVER)
    return knowledge


def chars(texts: Any) -> int:
    return sum(len(t) for t in texts)
