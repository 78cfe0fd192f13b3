"""Retriever settings (env prefix GOODPUT_RETRIEVER_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from goodput_core.settings import ServiceSettings, service_config


class RetrieverSettings(ServiceSettings):
    model_config = service_config("GOODPUT_RETRIEVER_")

    grpc_port: int = 50054
    http_port: int = 9104
    embedder_addr: str = Field("127.0.0.1:50053", description="Embedder gRPC address (query embeddings).")
    data_dir: str = Field("retriever-data", description="Where the embedded stores keep their files (relative to "
                                                        "the working directory).")
    # --- dense leg ---
    qdrant_url: str = Field("", description="Qdrant server URL; empty = qdrant-client local mode in-process.")
    qdrant_api_key: str = Field("", description="Qdrant API key (from a secretKeyRef).")
    qdrant_path: str = Field("", description="Local mode: `:memory:`, or a folder (empty = <data_dir>/qdrant).")
    # --- lexical leg ---
    lexical_backend: Literal["tantivy", "elasticsearch"] = Field(
        "tantivy", description="BM25 engine: embedded tantivy, or an Elasticsearch cluster.")
    elasticsearch_url: str = Field("", description="Elasticsearch URL (lexical_backend=elasticsearch).")
    elasticsearch_api_key: str = Field("", description="Elasticsearch API key (from a secretKeyRef).")
    tantivy_path: str = Field("", description="tantivy: `:memory:`, or a folder (empty = <data_dir>/tantivy).")
    # --- search ---
    rrf_k: float = Field(60.0, gt=0, description="Reciprocal rank fusion constant k: score = sum 1/(k + rank).")
    default_dense_weight: float = Field(0.5, ge=0, le=1, description="Weighted fusion: dense weight when the "
                                                                    "request gives none.")
    default_fusion: Literal["rrf", "weighted"] = Field("rrf", description="Fusion when the request gives none.")
    default_top_k: int = Field(5, ge=1, description="Results returned when the request gives no top_k.")
    max_top_k: int = Field(50, ge=1, description="Largest top_k accepted.")
    default_recall_k: int = Field(20, ge=1, description="Candidates taken from each leg before fusion.")
    max_recall_k: int = Field(200, ge=1, description="Largest recall_k accepted.")
    leg_timeout_s: float = Field(2.0, gt=0, description="A leg slower than this is dropped (degraded result).")
    max_query_chars: int = Field(4096, ge=1, description="Longest query accepted.")
    reranker: Literal["none"] = Field("none", description="Cross-encoder reranker (none ships offline: requests "
                                                          "asking for rerank get a note that it was skipped).")
    rerank_top_n: int = Field(5, ge=1, description="Results kept after a rerank.")
    max_write_chunks: int = Field(4096, ge=1, description="Most chunks in one IndexStore.Write call.")
