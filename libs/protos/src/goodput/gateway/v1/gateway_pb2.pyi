from goodput.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("model", "messages", "prompt", "sampling", "priority", "knowledge_base", "no_cache", "session_id", "tools", "tool_choice", "parallel_tool_calls", "prompt_cache_key", "safety_identifier")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    SAFETY_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    prompt: str
    sampling: _types_pb2.SamplingParams
    priority: _types_pb2.Priority
    knowledge_base: str
    no_cache: bool
    session_id: str
    tools: _containers.RepeatedCompositeFieldContainer[Function]
    tool_choice: str
    parallel_tool_calls: bool
    prompt_cache_key: str
    safety_identifier: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_types_pb2.Priority, str]] = ..., knowledge_base: _Optional[str] = ..., no_cache: _Optional[bool] = ..., session_id: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Function, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., prompt_cache_key: _Optional[str] = ..., safety_identifier: _Optional[str] = ...) -> None: ...

class Function(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "model", "text", "finish_reason", "usage", "cache", "sources", "logprobs", "tool_calls", "degraded")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    cache: CacheInfo
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolCall]
    degraded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_types_pb2.ToolCall, _Mapping]]] = ..., degraded: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("start", "delta", "end", "logprobs", "seq")
    START_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    start: StreamStart
    delta: str
    end: StreamEnd
    logprobs: TokenLogprobs
    seq: int
    def __init__(self, start: _Optional[_Union[StreamStart, _Mapping]] = ..., delta: _Optional[str] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...

class ResumeStreamRequest(_message.Message):
    __slots__ = ("resume_token", "from_seq")
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    resume_token: str
    from_seq: int
    def __init__(self, resume_token: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class StreamStart(_message.Message):
    __slots__ = ("request_id", "model", "cache", "sources", "degraded", "resume_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    cache: CacheInfo
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    degraded: _containers.RepeatedScalarFieldContainer[str]
    resume_token: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., degraded: _Optional[_Iterable[str]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("finish_reason", "usage", "tool_calls")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolCall]
    def __init__(self, finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[_types_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("hit", "layer", "similarity", "verdict", "verifier_probability")
    HIT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    layer: str
    similarity: float
    verdict: str
    verifier_probability: float
    def __init__(self, hit: _Optional[bool] = ..., layer: _Optional[str] = ..., similarity: _Optional[float] = ..., verdict: _Optional[str] = ..., verifier_probability: _Optional[float] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("chunk_id", "document_id", "score", "text")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    document_id: str
    score: float
    text: str
    def __init__(self, chunk_id: _Optional[str] = ..., document_id: _Optional[str] = ..., score: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "max_model_len", "workers")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    workers: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., workers: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("texts", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "embeddings", "prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("knowledge_base", "query", "top_k", "fusion", "dense_weight", "rerank")
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    knowledge_base: str
    query: str
    top_k: int
    fusion: str
    dense_weight: float
    rerank: bool
    def __init__(self, knowledge_base: _Optional[str] = ..., query: _Optional[str] = ..., top_k: _Optional[int] = ..., fusion: _Optional[str] = ..., dense_weight: _Optional[float] = ..., rerank: _Optional[bool] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results", "degraded", "notes", "kb_version", "rerank_status", "rerank_reason")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    RERANK_STATUS_FIELD_NUMBER: _ClassVar[int]
    RERANK_REASON_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Source]
    degraded: bool
    notes: _containers.RepeatedScalarFieldContainer[str]
    kb_version: int
    rerank_status: str
    rerank_reason: str
    def __init__(self, results: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., degraded: _Optional[bool] = ..., notes: _Optional[_Iterable[str]] = ..., kb_version: _Optional[int] = ..., rerank_status: _Optional[str] = ..., rerank_reason: _Optional[str] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "text", "type", "title", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    type: str
    title: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., type: _Optional[str] = ..., title: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class IndexRequest(_message.Message):
    __slots__ = ("knowledge_base", "documents", "delete_ids")
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    DELETE_IDS_FIELD_NUMBER: _ClassVar[int]
    knowledge_base: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    delete_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, knowledge_base: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ..., delete_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class IndexResponse(_message.Message):
    __slots__ = ("chunks_embedded", "documents_unchanged", "documents_deleted", "kb_version")
    CHUNKS_EMBEDDED_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    chunks_embedded: int
    documents_unchanged: int
    documents_deleted: int
    kb_version: int
    def __init__(self, chunks_embedded: _Optional[int] = ..., documents_unchanged: _Optional[int] = ..., documents_deleted: _Optional[int] = ..., kb_version: _Optional[int] = ...) -> None: ...
