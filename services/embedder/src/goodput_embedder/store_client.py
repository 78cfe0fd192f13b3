"""The indexer's handle on the stores: the retriever's internal ``IndexStore`` gRPC API (blocking client, used
from the indexing thread and from Celery workers). gRPC failures become domain errors (``from_rpc_error``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc

from goodput_core.clients import CHANNEL_OPTIONS
from goodput_core.errors import from_rpc_error
from goodput_core.tls import ClientCertificates

from goodput_embedder.indexer import ChunkRecord

__all__ = ["GrpcStoreWriter"]


class GrpcStoreWriter:
    def __init__(self, address: str, *, timeout_s: float = 60.0,
                 credentials: ClientCertificates | None = None) -> None:
        # Mutual TLS with the embedder's (or its Celery worker's) certificate, a new channel once its files were
        # renewed (the previous one is left to the calls in flight on it); plaintext only when it is None.
        self.address, self._certificates, self._generation = address, credentials, -1
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if credentials is None else None
        self._stub = retriever_pb2_grpc.IndexStoreStub(self._channel) if self._channel is not None else None
        self.timeout_s = timeout_s

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def _stub_now(self) -> retriever_pb2_grpc.IndexStoreStub:
        if self._certificates is not None:
            generation, credentials = self._certificates.current()
            if generation != self._generation:
                self._channel = grpc.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
                self._stub, self._generation = retriever_pb2_grpc.IndexStoreStub(self._channel), generation
        assert self._stub is not None
        return self._stub

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub_now(), method)(request, timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def open(self, tenant: str, kb: str) -> tuple[bool, int]:
        r = self._call("Open", retriever_pb2.OpenRequest(tenant=tenant, knowledge_base=kb))
        return r.created, r.kb_version

    def write(self, tenant: str, kb: str, *, upserts: Sequence[tuple[ChunkRecord, np.ndarray]],
              delete_chunk_ids: Sequence[str] = (), delete_document_ids: Sequence[str] = (),
              rebuild_id: str = "", kb_version: int = 0) -> None:
        chunks = [retriever_pb2.Chunk(chunk_id=c.chunk_id, document_id=c.document_id, text=c.text,
                                      vector=v.tolist(), metadata=c.metadata) for c, v in upserts]
        self._call("Write", retriever_pb2.WriteRequest(
            tenant=tenant, knowledge_base=kb, upserts=chunks, delete_chunk_ids=list(delete_chunk_ids),
            delete_document_ids=list(delete_document_ids), rebuild_id=rebuild_id, kb_version=kb_version))

    def begin_rebuild(self, tenant: str, kb: str) -> str:
        r = self._call("BeginRebuild", retriever_pb2.BeginRebuildRequest(tenant=tenant, knowledge_base=kb))
        return str(r.rebuild_id)

    def commit_rebuild(self, tenant: str, kb: str, rebuild_id: str, kb_version: int) -> None:
        self._call("CommitRebuild", retriever_pb2.CommitRebuildRequest(
            tenant=tenant, knowledge_base=kb, rebuild_id=rebuild_id, kb_version=kb_version))
