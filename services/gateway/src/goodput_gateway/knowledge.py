"""The knowledge path of the gateway: embeddings, search and indexing, over gRPC (``Embed``, ``Search``,
``Index``) and REST (``POST /v1/embeddings`` in OpenAI's shape, ``POST /v1/knowledge-bases/{kb}/search``,
``POST /v1/knowledge-bases/{kb}/documents``). Every call is scoped to the caller's tenant (from its API key).

A feature whose backend address is not configured (``GOODPUT_GATEWAY_EMBEDDER_ADDR``, ``..._RETRIEVER_ADDR``)
answers UNIMPLEMENTED / 501, as before.

Example:
    >>> knowledge = Knowledge(settings, channel_factory=lambda addr: make_channel(addr, provider))
    >>> hits = await knowledge.search("acme", "handbook", "refund policy", top_k=5)
"""

from __future__ import annotations

import base64
import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc
from goodput.gateway.v1 import gateway_pb2
from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc
from grpc import aio

from goodput_core.errors import InvalidArgument, Unimplemented, from_rpc_error

from goodput_gateway.config import GatewaySettings

__all__ = ["Knowledge", "install_routes"]

_FUSION = {"": retriever_pb2.FUSION_UNSPECIFIED, "rrf": retriever_pb2.FUSION_RRF,
           "weighted": retriever_pb2.FUSION_WEIGHTED}
NO_EMBEDDER = "embeddings need the embedder service, which this gateway is not configured with"
NO_RETRIEVER = "search needs the retriever service, which this gateway is not configured with"
NO_INDEXER = "indexing needs the embedder service, which this gateway is not configured with"


class Knowledge:
    def __init__(self, settings: GatewaySettings, *, channel_factory: Callable[[str], aio.Channel]) -> None:
        self.settings = settings
        self._channels: list[aio.Channel] = []
        self._embedding: embedder_pb2_grpc.EmbeddingStub | None = None
        self._indexer: embedder_pb2_grpc.IndexerStub | None = None
        self._retrieval: retriever_pb2_grpc.RetrievalStub | None = None
        if settings.embedder_addr:
            ch = channel_factory(settings.embedder_addr)
            self._channels.append(ch)
            self._embedding = embedder_pb2_grpc.EmbeddingStub(ch)
            self._indexer = embedder_pb2_grpc.IndexerStub(ch)
        if settings.retriever_addr:
            ch = channel_factory(settings.retriever_addr)
            self._channels.append(ch)
            self._retrieval = retriever_pb2_grpc.RetrievalStub(ch)

    @property
    def retrieval_enabled(self) -> bool:
        return self._retrieval is not None

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(grace=None)

    async def _call(self, fn: Callable[..., Awaitable[Any]], request: Any) -> Any:
        try:
            return await fn(request, timeout=self.settings.knowledge_timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def embed(self, texts: list[str], model: str = "") -> embedder_pb2.EmbedResponse:
        if self._embedding is None:
            raise Unimplemented(NO_EMBEDDER)
        if not texts:
            raise InvalidArgument("'input' must not be empty", param="input", code="invalid_value")
        if len(texts) > self.settings.max_embed_batch:
            raise InvalidArgument(f"{len(texts)} inputs; the limit is {self.settings.max_embed_batch}",
                                  param="input", code="invalid_value")
        return await self._call(self._embedding.Embed, embedder_pb2.EmbedRequest(texts=texts, model=model))

    async def search(self, tenant: str, kb: str, query: str, *, top_k: int = 0, fusion: str = "",
                     dense_weight: float | None = None, rerank: bool = False) -> retriever_pb2.SearchResponse:
        if self._retrieval is None:
            raise Unimplemented(NO_RETRIEVER)
        if fusion not in _FUSION:
            raise InvalidArgument("'fusion' must be 'rrf' or 'weighted'", param="fusion", code="invalid_value")
        req = retriever_pb2.SearchRequest(tenant=tenant, knowledge_base=kb, query=query, top_k=top_k,
                                          fusion=_FUSION[fusion], rerank=rerank)
        if dense_weight is not None:
            req.dense_weight = dense_weight
        return await self._call(self._retrieval.Search, req)

    async def index(self, tenant: str, kb: str, documents: list[embedder_pb2.Document],
                    delete_ids: list[str]) -> embedder_pb2.IndexDocumentsResponse:
        if self._indexer is None:
            raise Unimplemented(NO_INDEXER)
        return await self._call(self._indexer.IndexDocuments, embedder_pb2.IndexDocumentsRequest(
            tenant=tenant, knowledge_base=kb, documents=documents, delete_ids=delete_ids))


def _knowledge(service: Any) -> Knowledge:
    k = getattr(service, "knowledge", None)
    if k is None:
        raise Unimplemented(NO_RETRIEVER)
    return k


# ---- gRPC -----------------------------------------------------------------------------------------------------


async def grpc_embed(service: Any, principal: Any, request: gateway_pb2.EmbedRequest) -> gateway_pb2.EmbedResponse:
    r = await _knowledge(service).embed(list(request.texts), request.model)
    return gateway_pb2.EmbedResponse(model=r.model, prompt_tokens=r.tokens,
                                     embeddings=[gateway_pb2.Embedding(values=v.values) for v in r.vectors])


async def grpc_search(service: Any, principal: Any, request: gateway_pb2.SearchRequest) -> gateway_pb2.SearchResponse:
    r = await _knowledge(service).search(
        principal.tenant, request.knowledge_base, request.query, top_k=request.top_k, fusion=request.fusion,
        dense_weight=request.dense_weight if request.HasField("dense_weight") else None, rerank=request.rerank)
    return gateway_pb2.SearchResponse(results=[gateway_pb2.Source(chunk_id=h.chunk_id, document_id=h.document_id,
                                                                  score=h.score, text=h.text) for h in r.hits],
                                      degraded=r.degraded, notes=r.notes, kb_version=r.kb_version)


async def grpc_index(service: Any, principal: Any, request: gateway_pb2.IndexRequest) -> gateway_pb2.IndexResponse:
    docs = [embedder_pb2.Document(id=d.id, text=d.text, type=d.type, title=d.title, metadata=dict(d.metadata))
            for d in request.documents]
    r = await _knowledge(service).index(principal.tenant, request.knowledge_base, docs, list(request.delete_ids))
    return gateway_pb2.IndexResponse(chunks_embedded=r.chunks_embedded, documents_unchanged=r.documents_unchanged,
                                     documents_deleted=r.documents_deleted, kb_version=r.kb_version)


# ---- REST -----------------------------------------------------------------------------------------------------


def _opt_str(body: dict[str, Any], name: str, default: str = "") -> str:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise InvalidArgument(f"'{name}' must be a string", param=name, code="invalid_type")
    return v


def _opt_int(body: dict[str, Any], name: str) -> int:
    v = body.get(name)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgument(f"'{name}' must be a non-negative integer", param=name, code="invalid_type")
    return v


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", code="invalid_json")
    return body


def sources_json(hits: Any) -> list[dict[str, Any]]:
    return [{"chunk_id": h.chunk_id, "document_id": h.document_id, "score": round(float(h.score), 6),
             "text": h.text} for h in hits]


def install_routes(app: FastAPI, service: Any, read_json: Callable[[Request], Awaitable[Any]]) -> None:
    """Adds the knowledge routes to the gateway's REST app."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        service.authenticate(request.headers.get("authorization"))
        body = _object(await read_json(request))
        raw = body.get("input")
        if isinstance(raw, str):
            texts = [raw]
        elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
            texts = raw
        else:
            raise InvalidArgument("'input' must be a string or an array of strings (token arrays are not "
                                  "supported)", param="input", code="invalid_type")
        fmt = _opt_str(body, "encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise InvalidArgument("'encoding_format' must be 'float' or 'base64'", param="encoding_format",
                                  code="invalid_value")
        model = _opt_str(body, "model")
        r = await _knowledge(service).embed(texts, "" if model == "default" else model)
        data = []
        for i, v in enumerate(r.vectors):
            values: Any = list(v.values)
            if fmt == "base64":
                values = base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": values})
        return JSONResponse({"object": "list", "data": data, "model": r.model,
                             "usage": {"prompt_tokens": r.tokens, "total_tokens": r.tokens}})

    @app.post("/v1/knowledge-bases/{kb}/search")
    async def search(kb: str, request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        body = _object(await read_json(request))
        weight = body.get("dense_weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not math.isfinite(weight)):
            raise InvalidArgument("'dense_weight' must be a number between 0 and 1", param="dense_weight",
                                  code="invalid_type")
        rerank = body.get("rerank", False)
        if not isinstance(rerank, bool):
            raise InvalidArgument("'rerank' must be a boolean", param="rerank", code="invalid_type")
        r = await _knowledge(service).search(principal.tenant, kb, _opt_str(body, "query"),
                                             top_k=_opt_int(body, "top_k"), fusion=_opt_str(body, "fusion"),
                                             dense_weight=None if weight is None else float(weight), rerank=rerank)
        return JSONResponse({"object": "list", "data": sources_json(r.hits), "degraded": r.degraded,
                             "notes": list(r.notes), "kb_version": r.kb_version})

    @app.post("/v1/knowledge-bases/{kb}/documents")
    async def index(kb: str, request: Request) -> JSONResponse:
        principal = service.authenticate(request.headers.get("authorization"))
        body = _object(await read_json(request))
        raw_docs = body.get("documents") or []
        deletes = body.get("delete_ids") or []
        if not isinstance(raw_docs, list) or not all(isinstance(d, dict) for d in raw_docs):
            raise InvalidArgument("'documents' must be an array of objects", param="documents", code="invalid_type")
        if not isinstance(deletes, list) or not all(isinstance(d, str) for d in deletes):
            raise InvalidArgument("'delete_ids' must be an array of strings", param="delete_ids",
                                  code="invalid_type")
        docs = []
        for i, d in enumerate(raw_docs):
            meta = d.get("metadata") or {}
            if not isinstance(meta, dict):
                raise InvalidArgument(f"documents[{i}].metadata must be an object", param=f"documents[{i}].metadata",
                                      code="invalid_type")
            for name in ("id", "text", "type", "title"):
                if d.get(name) is not None and not isinstance(d.get(name), str):
                    raise InvalidArgument(f"documents[{i}].{name} must be a string", param=f"documents[{i}].{name}",
                                          code="invalid_type")
            docs.append(embedder_pb2.Document(id=d.get("id") or "", text=d.get("text") or "",
                                              type=d.get("type") or "", title=d.get("title") or "",
                                              metadata={str(k): str(v) for k, v in meta.items()}))
        r = await _knowledge(service).index(principal.tenant, kb, docs, deletes)
        return JSONResponse({"object": "knowledge_base.index_result", "knowledge_base": kb,
                             "chunks_embedded": r.chunks_embedded, "chunks_deleted": r.chunks_deleted,
                             "documents_unchanged": r.documents_unchanged, "documents_deleted": r.documents_deleted,
                             "kb_version": r.kb_version})

