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
    # --- rerank (a cross-encoder over the fused top candidates) ---
    reranker: Literal["auto", "cross-encoder", "none"] = Field(
        "auto", description="`auto`: the cross-encoder in `reranker_model` when that folder exists, else none "
                            "(searches asking for rerank get the fused order and a note); `cross-encoder`: required "
                            "(start fails without it); `none`: off.")
    reranker_model: str = Field("", description="A Hugging Face sequence-classification folder: what `goodput train "
                                                "reranker` writes, or a bge / ms-marco reranker.")
    reranker_backend: Literal["auto", "onnx", "torch"] = Field(
        "auto", description="`auto`: the folder's int8 ONNX export on CPU, torch otherwise (GPU).")
    reranker_device: str = Field("cpu", description="torch device of the reranker (`cpu`, `cuda`, `cuda:1`).")
    reranker_threads: int = Field(0, ge=0, description="CPU threads of one rerank; 0 = onnxruntime's default.")
    reranker_max_length: int = Field(0, ge=0, le=8192, description="Tokens of one (query, passage) pair; 0 = the "
                                                                    "model card's (else 256).")
    rerank_candidates: int = Field(20, ge=1, le=200, description="Fused candidates the cross-encoder reads "
                                                                 "(hybrid top-K).")
    rerank_top_n: int = Field(5, ge=1, description="Results kept after a rerank (top-N; at most the request's top_k).")
    rerank_blend: float = Field(-1.0, ge=-1, le=1, description="Share of the cross-encoder's ranking in the final "
                                "order (reciprocal-rank fusion with the fused order; 1 = the model alone); -1 = the "
                                "weight in the model card (chosen on validation queries), else 1.")
    max_write_chunks: int = Field(4096, ge=1, description="Most chunks in one IndexStore.Write call.")
