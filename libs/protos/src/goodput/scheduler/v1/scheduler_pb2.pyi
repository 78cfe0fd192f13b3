from goodput.common.v1 import types_pb2 as _types_pb2
from goodput.inference.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_OK: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
    OUTCOME_WORKER_FAILED: _ClassVar[Outcome]
    OUTCOME_ERROR: _ClassVar[Outcome]
    OUTCOME_ABANDONED: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_OK: Outcome
OUTCOME_CANCELLED: Outcome
OUTCOME_WORKER_FAILED: Outcome
OUTCOME_ERROR: Outcome
OUTCOME_ABANDONED: Outcome

class FirstToken(_message.Message):
    __slots__ = ("ttft_s",)
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    def __init__(self, ttft_s: _Optional[float] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("request_id", "tenant", "priority", "model", "prompt_tokens_estimate", "max_tokens", "prefix_hint", "session_id", "tenant_weight", "max_queue_wait_s", "fixed_output", "n", "resumable", "resumed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FIXED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    priority: _types_pb2.Priority
    model: str
    prompt_tokens_estimate: int
    max_tokens: int
    prefix_hint: str
    session_id: str
    tenant_weight: float
    max_queue_wait_s: float
    fixed_output: bool
    n: int
    resumable: bool
    resumed: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[_Union[_types_pb2.Priority, str]] = ..., model: _Optional[str] = ..., prompt_tokens_estimate: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prefix_hint: _Optional[str] = ..., session_id: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., max_queue_wait_s: _Optional[float] = ..., fixed_output: _Optional[bool] = ..., n: _Optional[int] = ..., resumable: _Optional[bool] = ..., resumed: _Optional[bool] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("outcome", "prompt_tokens", "completion_tokens", "ttft_s")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ...) -> None: ...

class LeaseMuxRequest(_message.Message):
    __slots__ = ("lease_id", "admit", "first_token", "release", "cancel", "attach", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    admit: Admit
    first_token: FirstToken
    release: Release
    cancel: Cancel
    attach: Attach
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, lease_id: _Optional[str] = ..., admit: _Optional[_Union[Admit, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., attach: _Optional[_Union[Attach, _Mapping]] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("admit", "worker_id", "first_token_seen")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SEEN_FIELD_NUMBER: _ClassVar[int]
    admit: Admit
    worker_id: str
    first_token_seen: bool
    def __init__(self, admit: _Optional[_Union[Admit, _Mapping]] = ..., worker_id: _Optional[str] = ..., first_token_seen: _Optional[bool] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseMuxEvent(_message.Message):
    __slots__ = ("lease_id", "queued", "granted", "released", "error", "preempted")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    queued: Queued
    granted: Granted
    released: Released
    error: LeaseError
    preempted: Preempted
    def __init__(self, lease_id: _Optional[str] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., granted: _Optional[_Union[Granted, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ..., error: _Optional[_Union[LeaseError, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaseMuxBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[LeaseMuxRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[LeaseMuxRequest, _Mapping]]] = ...) -> None: ...

class LeaseMuxEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LeaseMuxEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[LeaseMuxEvent, _Mapping]]] = ...) -> None: ...

class LeaseError(_message.Message):
    __slots__ = ("status", "message", "code", "retry_after_s", "param")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    status: str
    message: str
    code: str
    retry_after_s: float
    param: str
    def __init__(self, status: _Optional[str] = ..., message: _Optional[str] = ..., code: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., param: _Optional[str] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class Granted(_message.Message):
    __slots__ = ("worker_id", "address", "reason", "queue_wait_s", "free_slots")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    reason: str
    queue_wait_s: float
    free_slots: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., reason: _Optional[str] = ..., queue_wait_s: _Optional[float] = ..., free_slots: _Optional[int] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "address", "healthy", "load", "inflight", "model", "last_error", "consecutive_failures", "draining", "speed", "lease_cap", "pending_prefill_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    LEASE_CAP_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    healthy: bool
    load: _inference_pb2.WorkerLoad
    inflight: int
    model: _inference_pb2.ModelInfo
    last_error: str
    consecutive_failures: int
    draining: bool
    speed: SpeedEstimate
    lease_cap: int
    pending_prefill_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[_inference_pb2.WorkerLoad, _Mapping]] = ..., inflight: _Optional[int] = ..., model: _Optional[_Union[_inference_pb2.ModelInfo, _Mapping]] = ..., last_error: _Optional[str] = ..., consecutive_failures: _Optional[int] = ..., draining: _Optional[bool] = ..., speed: _Optional[_Union[SpeedEstimate, _Mapping]] = ..., lease_cap: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ...) -> None: ...

class SpeedEstimate(_message.Message):
    __slots__ = ("prefill_s_per_token", "tpot_base_s", "tpot_per_seq_s", "samples")
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TPOT_BASE_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    prefill_s_per_token: float
    tpot_base_s: float
    tpot_per_seq_s: float
    samples: int
    def __init__(self, prefill_s_per_token: _Optional[float] = ..., tpot_base_s: _Optional[float] = ..., tpot_per_seq_s: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
