"""The knowledge routes of the REST API: ``POST /v1/embeddings`` (OpenAI's shape), ``POST
/v1/knowledge-bases/{kb}/search`` and ``POST /v1/knowledge-bases/{kb}/documents``, each under the caller's quotas and
scoped to its tenant (:mod:`goodput_gateway.knowledge` does the work)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from goodput.embedder.v1 import embedder_pb2

from goodput_gateway.api.deps import Caller, JsonBody, Service
from goodput_gateway.knowledge import chars, require
from goodput_gateway.requests import estimate_tokens
from goodput_gateway.schemas import EmbeddingsRequest, IndexRequest, SearchRequest, parse

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(principal: Caller, raw: JsonBody, service: Service) -> JSONResponse:
    body = parse(EmbeddingsRequest, raw)
    model = body.model or ""
    async with service.metered(principal, what="embeddings", tokens=estimate_tokens(chars(body.input))) as adm:
        r = await require(service.knowledge).embed(body.input, "" if model == "default" else model)
        adm.used = r.tokens
    b64 = body.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if b64 else v}
            for i, v in enumerate(r.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": r.model,
                         "usage": {"prompt_tokens": r.tokens, "total_tokens": r.tokens}}, headers=adm.headers)


@router.post("/v1/knowledge-bases/{kb}/search")
async def search(kb: str, principal: Caller, raw: JsonBody, service: Service) -> JSONResponse:
    body = parse(SearchRequest, raw)
    async with service.metered(principal, what="search", tokens=estimate_tokens(len(body.query or ""))) as adm:
        r = await require(service.knowledge).search(principal.tenant, kb, body.query or "", top_k=body.top_k or 0,
                                             fusion=body.fusion or "", dense_weight=body.dense_weight,
                                             rerank=body.rerank)
    hits = [{"chunk_id": h.chunk_id, "document_id": h.document_id, "score": round(float(h.score), 6), "text": h.text}
            for h in r.hits]
    body_out: dict[str, Any] = {"object": "list", "data": hits, "degraded": r.degraded, "notes": list(r.notes),
                                "kb_version": r.kb_version}
    if r.rerank.status:  # asked for: applied, or skipped and why
        body_out["rerank"] = {"status": r.rerank.status, "reason": r.rerank.reason, "model": r.rerank.model}
    return JSONResponse(body_out, headers=adm.headers)


@router.post("/v1/knowledge-bases/{kb}/documents")
async def index(kb: str, principal: Caller, raw: JsonBody, service: Service) -> JSONResponse:
    body = parse(IndexRequest, raw)
    docs = [embedder_pb2.Document(id=d.id or "", text=d.text or "", type=d.type or "", title=d.title or "",
                                  metadata={str(k): str(v) for k, v in (d.metadata or {}).items()})
            for d in body.documents or []]
    tokens = estimate_tokens(chars(d.text for d in docs))
    async with service.metered(principal, what="index", tokens=tokens) as adm:
        r = await require(service.knowledge).index(principal.tenant, kb, docs, body.delete_ids or [])
    return JSONResponse({"object": "knowledge_base.index_result", "knowledge_base": kb,
                         "chunks_embedded": r.chunks_embedded, "chunks_deleted": r.chunks_deleted,
                         "documents_unchanged": r.documents_unchanged, "documents_deleted": r.documents_deleted,
                         "kb_version": r.kb_version}, headers=adm.headers)
