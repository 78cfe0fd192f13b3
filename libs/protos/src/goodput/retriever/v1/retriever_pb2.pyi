from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Fusion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUSION_UNSPECIFIED: _ClassVar[Fusion]
    FUSION_RRF: _ClassVar[Fusion]
    FUSION_WEIGHTED: _ClassVar[Fusion]
    FUSION_DENSE_ONLY: _ClassVar[Fusion]
    FUSION_LEXICAL_ONLY: _ClassVar[Fusion]
FUSION_UNSPECIFIED: Fusion
FUSION_RRF: Fusion
FUSION_WEIGHTED: Fusion
FUSION_DENSE_ONLY: Fusion
FUSION_LEXICAL_ONLY: Fusion

class SearchRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base", "query", "top_k", "fusion", "dense_weight", "recall_k", "rerank", "leg_budget_s", "rerank_budget_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RECALL_K_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    LEG_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    RERANK_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    query: str
    top_k: int
    fusion: Fusion
    dense_weight: float
    recall_k: int
    rerank: bool
    leg_budget_s: float
    rerank_budget_s: float
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., query: _Optional[str] = ..., top_k: _Optional[int] = ..., fusion: _Optional[_Union[Fusion, str]] = ..., dense_weight: _Optional[float] = ..., recall_k: _Optional[int] = ..., rerank: _Optional[bool] = ..., leg_budget_s: _Optional[float] = ..., rerank_budget_s: _Optional[float] = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("chunk_id", "document_id", "score", "text", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    document_id: str
    score: float
    text: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, chunk_id: _Optional[str] = ..., document_id: _Optional[str] = ..., score: _Optional[float] = ..., text: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LegTiming(_message.Message):
    __slots__ = ("leg", "seconds", "ok")
    LEG_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    leg: str
    seconds: float
    ok: bool
    def __init__(self, leg: _Optional[str] = ..., seconds: _Optional[float] = ..., ok: _Optional[bool] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("hits", "degraded", "notes", "timings", "kb_version", "rerank")
    HITS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    degraded: bool
    notes: _containers.RepeatedScalarFieldContainer[str]
    timings: _containers.RepeatedCompositeFieldContainer[LegTiming]
    kb_version: int
    rerank: RerankInfo
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., degraded: _Optional[bool] = ..., notes: _Optional[_Iterable[str]] = ..., timings: _Optional[_Iterable[_Union[LegTiming, _Mapping]]] = ..., kb_version: _Optional[int] = ..., rerank: _Optional[_Union[RerankInfo, _Mapping]] = ...) -> None: ...

class RerankInfo(_message.Message):
    __slots__ = ("status", "reason", "model", "candidates", "seconds")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    status: str
    reason: str
    model: str
    candidates: int
    seconds: float
    def __init__(self, status: _Optional[str] = ..., reason: _Optional[str] = ..., model: _Optional[str] = ..., candidates: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("created", "kb_version")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    created: bool
    kb_version: int
    def __init__(self, created: _Optional[bool] = ..., kb_version: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("chunk_id", "document_id", "text", "vector", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    document_id: str
    text: str
    vector: _containers.RepeatedScalarFieldContainer[float]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, chunk_id: _Optional[str] = ..., document_id: _Optional[str] = ..., text: _Optional[str] = ..., vector: _Optional[_Iterable[float]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base", "upserts", "delete_chunk_ids", "delete_document_ids", "rebuild_id", "kb_version")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    UPSERTS_FIELD_NUMBER: _ClassVar[int]
    DELETE_CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    DELETE_DOCUMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_ID_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    upserts: _containers.RepeatedCompositeFieldContainer[Chunk]
    delete_chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    delete_document_ids: _containers.RepeatedScalarFieldContainer[str]
    rebuild_id: str
    kb_version: int
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., upserts: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., delete_chunk_ids: _Optional[_Iterable[str]] = ..., delete_document_ids: _Optional[_Iterable[str]] = ..., rebuild_id: _Optional[str] = ..., kb_version: _Optional[int] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("upserted",)
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    upserted: int
    def __init__(self, upserted: _Optional[int] = ...) -> None: ...

class BeginRebuildRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ...) -> None: ...

class BeginRebuildResponse(_message.Message):
    __slots__ = ("rebuild_id",)
    REBUILD_ID_FIELD_NUMBER: _ClassVar[int]
    rebuild_id: str
    def __init__(self, rebuild_id: _Optional[str] = ...) -> None: ...

class CommitRebuildRequest(_message.Message):
    __slots__ = ("tenant", "knowledge_base", "rebuild_id", "kb_version")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    REBUILD_ID_FIELD_NUMBER: _ClassVar[int]
    KB_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    knowledge_base: str
    rebuild_id: str
    kb_version: int
    def __init__(self, tenant: _Optional[str] = ..., knowledge_base: _Optional[str] = ..., rebuild_id: _Optional[str] = ..., kb_version: _Optional[int] = ...) -> None: ...

class CommitRebuildResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
