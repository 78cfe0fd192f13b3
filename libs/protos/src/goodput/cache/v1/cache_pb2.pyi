from goodput.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheKeyParts(_message.Message):
    __slots__ = ("tenant", "model", "model_version", "messages", "prompt", "sampling", "knowledge_base", "kb_version")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    model_version: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    prompt: str
    sampling: _types_pb2.SamplingParams
    knowledge_base: str
    kb_version: int
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., knowledge_base: _Optional[str] = ..., kb_version: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("key", "allow_semantic", "threshold")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SEMANTIC_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    key: CacheKeyParts
    allow_semantic: bool
    threshold: float
    def __init__(self, key: _Optional[_Union[CacheKeyParts, _Mapping]] = ..., allow_semantic: _Optional[bool] = ..., threshold: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit", "layer", "similarity", "text", "finish_reason", "usage", "degraded", "key", "reason", "matched_query", "sources", "verdict", "verifier_probability", "kb_version")
    HIT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_QUERY_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    layer: str
    similarity: float
    text: str
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    degraded: bool
    key: str
    reason: str
    matched_query: str
    sources: _containers.RepeatedCompositeFieldContainer[CachedSource]
    verdict: str
    verifier_probability: float
    kb_version: int
    def __init__(self, hit: _Optional[bool] = ..., layer: _Optional[str] = ..., similarity: _Optional[float] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., degraded: _Optional[bool] = ..., key: _Optional[str] = ..., reason: _Optional[str] = ..., matched_query: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[CachedSource, _Mapping]]] = ..., verdict: _Optional[str] = ..., verifier_probability: _Optional[float] = ..., kb_version: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("key", "text", "finish_reason", "usage", "opt_in", "ttl_s", "sources")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    OPT_IN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    key: CacheKeyParts
    text: str
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    opt_in: bool
    ttl_s: int
    sources: _containers.RepeatedCompositeFieldContainer[CachedSource]
    def __init__(self, key: _Optional[_Union[CacheKeyParts, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., opt_in: _Optional[bool] = ..., ttl_s: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[CachedSource, _Mapping]]] = ...) -> None: ...

class CachedSource(_message.Message):
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

class StoreResponse(_message.Message):
    __slots__ = ("stored", "reason", "key", "ttl_s")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    key: str
    ttl_s: int
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ..., key: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base", "key", "model")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    key: str
    model: str
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("layer", "hits", "misses", "entries")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    layer: str
    hits: int
    misses: int
    entries: int
    def __init__(self, layer: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("layers", "tokens_saved", "gpu_seconds_saved", "degraded")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_SAVED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerStats]
    tokens_saved: int
    gpu_seconds_saved: float
    degraded: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., tokens_saved: _Optional[int] = ..., gpu_seconds_saved: _Optional[float] = ..., degraded: _Optional[int] = ...) -> None: ...
