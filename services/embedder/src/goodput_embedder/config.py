"""Embedder settings (env prefix GOODPUT_EMBEDDER_). The Celery indexing workers read the same settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from goodput_contracts import DEFAULT_CHANNEL, DEFAULT_KEY_PREFIX
from goodput_core.settings import ServiceSettings, service_config


class EmbedderSettings(ServiceSettings):
    model_config = service_config("GOODPUT_EMBEDDER_")

    grpc_port: int = 50053
    http_port: int = 9103
    worker_http_port: int = Field(9106, ge=0, le=65535, description="/metrics of a Celery indexing worker (0 = none).")
    # --- model and micro-batching ---
    model: Literal["minilm-onnx-int8", "minilm-torch"] = Field(
        "minilm-onnx-int8", description="Embedding backend: the int8 ONNX all-MiniLM-L6-v2 (onnxruntime, no torch) "
                                        "or the same model as torch weights (CPU or GPU).")
    model_path: str = Field("", description="Model file (ONNX) or folder (torch); empty = the packaged one.")
    device: str = Field("cpu", description="Torch device for minilm-torch (`cpu`, `cuda`, `cuda:1`).")
    intra_op_threads: int = Field(0, ge=0, description="onnxruntime/torch threads per model call (0 = library "
                                                       "default).")
    intra_op_spin: bool = Field(False, description="ONNX model: idle onnxruntime threads busy-wait for the next "
                                "call instead of sleeping. Spinning cut a lone short text's time by ~15% on an idle "
                                "machine, but the spinning threads keep the cores from everything beside them: "
                                "through this service the cache's lookup p99 was ~4 ms higher on 2 cores.")
    max_seq_tokens: int = Field(256, ge=8, le=512, description="Texts are truncated to this many word pieces "
                                                               "(the model was trained with 256).")
    batch_window_ms: float = Field(0.0, ge=0, le=100, description="How long a request reaching an idle model may "
                                   "wait for others to join its call (0 = none). Requests that arrive during a "
                                   "model call always share the next one.")
    max_batch: int = Field(64, ge=1, le=4096, description="Most texts the batcher hands to the model at once.")
    max_batch_tokens: int = Field(1024, ge=16, description="The model cuts what it is handed into runs of "
                                  "similar-length texts of at most this many padded tokens (1024 suits a CPU; a "
                                  "GPU wants far more, e.g. 32768).")
    max_texts: int = Field(256, ge=1, description="Most texts in one Embed request.")
    max_text_chars: int = Field(32_768, ge=1, description="Longest text accepted by Embed.")
    # --- indexing ---
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis: Celery broker and results, job "
                                                                   "progress, content hashes, KB versions.")
    index_queue: str = Field("goodput-index", description="Celery queue of the reindex jobs.")
    key_prefix: str = Field(DEFAULT_KEY_PREFIX, description="Prefix of every Redis key this service writes.")
    version_channel: str = Field(DEFAULT_CHANNEL, description="Redis pub/sub channel on which every "
                                                                   "finished write publishes the KB's new version.")
    retriever_addr: str = Field("127.0.0.1:50054", description="Retriever gRPC address: the owner of the "
                                                               "stores, written through its IndexStore API.")
    write_timeout_s: float = Field(60.0, gt=0, description="Timeout of one write to the retriever.")
    max_documents: int = Field(256, ge=1, description="Most documents in one synchronous IndexDocuments call.")
    max_document_bytes: int = Field(2 << 20, ge=1, description="Largest document (UTF-8 bytes).")
    max_request_bytes: int = Field(16 << 20, ge=1, description="Largest IndexDocuments request (sum of texts).")
    prose_chunk_tokens: int = Field(256, ge=16, description="Prose: words per chunk window.")
    prose_overlap: float = Field(0.125, ge=0, le=0.5, description="Prose: overlap between windows (share).")
    markdown_max_tokens: int = Field(512, ge=16, description="Markdown: a section longer than this is split "
                                                             "like prose.")
    code_max_tokens: int = Field(512, ge=16, description="Code: a function/class longer than this is split.")
    faq_max_tokens: int = Field(512, ge=16, description="FAQ: an entry longer than this is split.")
    write_batch: int = Field(128, ge=1, description="Chunks per write to the retriever during a job.")
    job_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="How long job status is kept in Redis.")
    # --- what Reindex may read ---
    source_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Folders whose files a Reindex job may read, comma-separated absolute "
        "paths; a source must resolve (symlinks followed) inside one. Empty = Reindex reads no local path "
        "(documents arrive through IndexDocuments).")
    source_max_file_bytes: int = Field(64 << 20, ge=1, description="Largest file a Reindex job reads (a gzipped "
                                                                   "JSONL file: its decompressed text).")

    @field_validator("source_roots", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [r.strip() for r in value.split(",") if r.strip()]
        return value

    @field_validator("source_roots")
    @classmethod
    def _absolute(cls, roots: list[str]) -> list[str]:
        for r in roots:
            if not r.startswith("/"):
                raise ValueError(f"source root {r!r} is not an absolute path")
        return roots
