from goodput.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "messages", "prompt", "sampling", "priority", "tenant", "tools", "parallel_tool_calls", "continue_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    prompt: str
    sampling: _types_pb2.SamplingParams
    priority: _types_pb2.Priority
    tenant: str
    tools: str
    parallel_tool_calls: bool
    continue_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_types_pb2.Priority, str]] = ..., tenant: _Optional[str] = ..., tools: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., continue_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("started", "delta", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: Started
    delta: Delta
    finished: Finished
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_tokens", "worker_id")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    worker_id: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("text", "completion_tokens", "logprobs", "index", "prompt_logprobs", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "usage", "choice_finish_reasons", "tool_calls", "timing")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    choice_finish_reasons: _containers.RepeatedScalarFieldContainer[_types_pb2.FinishReason]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolCall]
    timing: EngineTiming
    def __init__(self, finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., choice_finish_reasons: _Optional[_Iterable[_Union[_types_pb2.FinishReason, str]]] = ..., tool_calls: _Optional[_Iterable[_Union[_types_pb2.ToolCall, _Mapping]]] = ..., timing: _Optional[_Union[EngineTiming, _Mapping]] = ...) -> None: ...

class EngineTiming(_message.Message):
    __slots__ = ("preprocess_s", "queued_s", "prefill_s", "decode_s")
    PREPROCESS_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    preprocess_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    def __init__(self, preprocess_s: _Optional[float] = ..., queued_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_cache_usage", "gpu_utilization", "max_num_seqs", "aborted_total", "finished_total", "ready", "stalled_s")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_cache_usage: float
    gpu_utilization: float
    max_num_seqs: int
    aborted_total: int
    finished_total: int
    ready: bool
    stalled_s: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., gpu_utilization: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., aborted_total: _Optional[int] = ..., finished_total: _Optional[int] = ..., ready: _Optional[bool] = ..., stalled_s: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("served_model_name", "model", "max_model_len", "max_prompt_tokens", "engine", "model_version", "max_num_batched_tokens", "tool_call_parser", "pool", "pool_classes", "aliases", "cost_per_hour", "continues")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    POOL_CLASSES_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    model: str
    max_model_len: int
    max_prompt_tokens: int
    engine: str
    model_version: str
    max_num_batched_tokens: int
    tool_call_parser: str
    pool: str
    pool_classes: _containers.RepeatedScalarFieldContainer[_types_pb2.Priority]
    aliases: _containers.RepeatedScalarFieldContainer[str]
    cost_per_hour: float
    continues: bool
    def __init__(self, served_model_name: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., engine: _Optional[str] = ..., model_version: _Optional[str] = ..., max_num_batched_tokens: _Optional[int] = ..., tool_call_parser: _Optional[str] = ..., pool: _Optional[str] = ..., pool_classes: _Optional[_Iterable[_Union[_types_pb2.Priority, str]]] = ..., aliases: _Optional[_Iterable[str]] = ..., cost_per_hour: _Optional[float] = ..., continues: _Optional[bool] = ...) -> None: ...
