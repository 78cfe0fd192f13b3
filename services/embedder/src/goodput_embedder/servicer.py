"""Thin gRPC servicers: Embedding over the micro-batcher, Indexer over the indexing domain and the job queue."""

from __future__ import annotations

import asyncio
from typing import Any

from goodput.embedder.v1 import embedder_pb2, embedder_pb2_grpc
from grpc import aio

from goodput_core.errors import InvalidArgument, NotFound

from goodput_embedder.batcher import MicroBatcher
from goodput_embedder.config import EmbedderSettings
from goodput_embedder.indexer import Doc, Indexer, validate_name
from goodput_embedder.jobs import REINDEX_TASK, JobStore
from goodput_embedder.sources import SourceAccess

# Names an OpenAI client may send for the default model.
MODEL_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
_STATES = {"pending": embedder_pb2.JOB_STATE_PENDING, "running": embedder_pb2.JOB_STATE_RUNNING,
           "succeeded": embedder_pb2.JOB_STATE_SUCCEEDED, "failed": embedder_pb2.JOB_STATE_FAILED}


def validate_texts(texts: list[str], settings: EmbedderSettings) -> None:
    if not texts:
        raise InvalidArgument("'texts' must not be empty", param="texts", code="invalid_value")
    if len(texts) > settings.max_texts:
        raise InvalidArgument(f"{len(texts)} texts; the limit is {settings.max_texts}", param="texts",
                              code="invalid_value")
    for i, t in enumerate(texts):
        if not t.strip():
            raise InvalidArgument(f"texts[{i}] is empty", param=f"texts[{i}]", code="invalid_value")
        if len(t) > settings.max_text_chars:
            raise InvalidArgument(f"texts[{i}] has {len(t)} characters; the limit is {settings.max_text_chars}",
                                  param=f"texts[{i}]", code="invalid_value")


class EmbeddingServicer(embedder_pb2_grpc.EmbeddingServicer):
    def __init__(self, settings: EmbedderSettings, batcher: MicroBatcher) -> None:
        self.settings = settings
        self.batcher = batcher

    async def Embed(self, request: embedder_pb2.EmbedRequest, context: aio.ServicerContext
                    ) -> embedder_pb2.EmbedResponse:
        texts = list(request.texts)
        validate_texts(texts, self.settings)
        model = self.batcher.model
        if request.model and request.model not in (model.name, *MODEL_ALIASES):
            raise InvalidArgument(f"model {request.model!r} is not served; this embedder serves {model.name!r}",
                                  param="model", code="model_not_found")
        vectors = await self.batcher.embed(texts)
        tokens = await asyncio.to_thread(model.count_tokens, texts)
        return embedder_pb2.EmbedResponse(model=model.name, tokens=tokens,
                                          vectors=[embedder_pb2.Vector(values=v.tolist()) for v in vectors])

    async def DescribeModel(self, request: embedder_pb2.DescribeModelRequest, context: aio.ServicerContext
                            ) -> embedder_pb2.EmbeddingModel:
        model = self.batcher.model
        return embedder_pb2.EmbeddingModel(name=model.name, aliases=list(MODEL_ALIASES), dimensions=model.dim)


class IndexerServicer(embedder_pb2_grpc.IndexerServicer):
    def __init__(self, settings: EmbedderSettings, indexer: Indexer, jobs: JobStore, celery: Any, *,
                 sources: SourceAccess | None = None) -> None:
        self.settings = settings
        self.indexer = indexer
        self.jobs = jobs
        self.celery = celery
        self.sources = sources or SourceAccess.from_settings(settings)

    async def IndexDocuments(self, request: embedder_pb2.IndexDocumentsRequest, context: aio.ServicerContext
                             ) -> embedder_pb2.IndexDocumentsResponse:
        docs = [Doc(id=d.id, text=d.text, type=d.type, title=d.title, metadata=dict(d.metadata))
                for d in request.documents]
        r = await asyncio.to_thread(self.indexer.index_documents, request.tenant, request.knowledge_base, docs,
                                    list(request.delete_ids), max_documents=self.settings.max_documents)
        return embedder_pb2.IndexDocumentsResponse(
            chunks_embedded=r.chunks_embedded, chunks_deleted=r.chunks_deleted,
            documents_unchanged=r.documents_unchanged, documents_deleted=r.documents_deleted,
            kb_version=r.kb_version)

    async def Reindex(self, request: embedder_pb2.ReindexRequest, context: aio.ServicerContext
                      ) -> embedder_pb2.ReindexResponse:
        validate_name(request.tenant, "tenant")
        validate_name(request.knowledge_base, "knowledge_base")
        if not request.source_uri.strip():
            raise InvalidArgument("'source_uri' must name a file, folder or JSONL readable by the indexing "
                                  "workers", param="source_uri", code="invalid_value")
        # Refused here, as a status code, before a job exists: outside the source roots, a special or pseudo file,
        # over the size bound. The job checks again when it reads.
        await asyncio.to_thread(self.sources.check, request.source_uri)
        job_id = await asyncio.to_thread(self.jobs.create, request.tenant, request.knowledge_base,
                                         request.source_uri, request.full_rebuild)
        await asyncio.to_thread(self.celery.send_task, REINDEX_TASK, args=[
            job_id, request.tenant, request.knowledge_base, request.source_uri, request.full_rebuild])
        return embedder_pb2.ReindexResponse(job_id=job_id)

    async def JobStatus(self, request: embedder_pb2.JobStatusRequest, context: aio.ServicerContext
                        ) -> embedder_pb2.Job:
        if not request.job_id:
            raise InvalidArgument("'job_id' must not be empty", param="job_id")
        info = await asyncio.to_thread(self.jobs.get, request.job_id)
        if info is None:
            raise NotFound(f"no job {request.job_id!r} (unknown or expired)")
        return embedder_pb2.Job(job_id=info.job_id, state=_STATES.get(info.state, embedder_pb2.JOB_STATE_UNSPECIFIED),
                                documents_done=info.documents_done, documents_total=info.documents_total,
                                chunks_embedded=info.chunks_embedded, kb_version=info.kb_version, error=info.error)
