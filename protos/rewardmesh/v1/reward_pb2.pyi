import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from rewardmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_SOURCE_KIND_UNSPECIFIED: _ClassVar[RewardSourceKind]
    REWARD_SOURCE_KIND_RULE: _ClassVar[RewardSourceKind]
    REWARD_SOURCE_KIND_FUNCTION: _ClassVar[RewardSourceKind]
    REWARD_SOURCE_KIND_MODEL: _ClassVar[RewardSourceKind]
    REWARD_SOURCE_KIND_JUDGE: _ClassVar[RewardSourceKind]
    REWARD_SOURCE_KIND_CODE: _ClassVar[RewardSourceKind]
REWARD_SOURCE_KIND_UNSPECIFIED: RewardSourceKind
REWARD_SOURCE_KIND_RULE: RewardSourceKind
REWARD_SOURCE_KIND_FUNCTION: RewardSourceKind
REWARD_SOURCE_KIND_MODEL: RewardSourceKind
REWARD_SOURCE_KIND_JUDGE: RewardSourceKind
REWARD_SOURCE_KIND_CODE: RewardSourceKind

class ScoreRequest(_message.Message):
    __slots__ = ("sample", "reward", "timeout", "trace_context", "items", "cancel_sample_ids", "max_results_per_message", "keep_traces", "items_untraced", "step_time_left")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class KeepTracesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULTS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEEP_TRACES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_UNTRACED_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_LEFT_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    reward: str
    timeout: _duration_pb2.Duration
    trace_context: _containers.ScalarMap[str, str]
    items: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    cancel_sample_ids: _containers.RepeatedScalarFieldContainer[str]
    max_results_per_message: int
    keep_traces: _containers.ScalarMap[str, str]
    items_untraced: bool
    step_time_left: _duration_pb2.Duration
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ..., reward: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., items: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ..., cancel_sample_ids: _Optional[_Iterable[str]] = ..., max_results_per_message: _Optional[int] = ..., keep_traces: _Optional[_Mapping[str, str]] = ..., items_untraced: _Optional[bool] = ..., step_time_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("result", "results")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    result: RewardResult
    results: _containers.RepeatedCompositeFieldContainer[RewardResult]
    def __init__(self, result: _Optional[_Union[RewardResult, _Mapping]] = ..., results: _Optional[_Iterable[_Union[RewardResult, _Mapping]]] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("reward", "samples", "timeout", "step_time_left")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_LEFT_FIELD_NUMBER: _ClassVar[int]
    reward: str
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    timeout: _duration_pb2.Duration
    step_time_left: _duration_pb2.Duration
    def __init__(self, reward: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., step_time_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RewardResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RewardResult, _Mapping]]] = ...) -> None: ...

class RewardTiming(_message.Message):
    __slots__ = ("queue", "compute", "total")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    queue: float
    compute: float
    total: float
    def __init__(self, queue: _Optional[float] = ..., compute: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...

class RewardResult(_message.Message):
    __slots__ = ("sample_id", "score", "extras", "timing", "batch_size", "error", "reward")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    score: float
    extras: _containers.ScalarMap[str, float]
    timing: RewardTiming
    batch_size: int
    error: _common_pb2.Status
    reward: str
    def __init__(self, sample_id: _Optional[str] = ..., score: _Optional[float] = ..., extras: _Optional[_Mapping[str, float]] = ..., timing: _Optional[_Union[RewardTiming, _Mapping]] = ..., batch_size: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., reward: _Optional[str] = ...) -> None: ...

class ListRewardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRewardsResponse(_message.Message):
    __slots__ = ("pipelines",)
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    pipelines: _containers.RepeatedCompositeFieldContainer[RewardPipeline]
    def __init__(self, pipelines: _Optional[_Iterable[_Union[RewardPipeline, _Mapping]]] = ...) -> None: ...

class RewardSource(_message.Message):
    __slots__ = ("name", "kind", "weight", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RewardSourceKind
    weight: float
    target: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RewardSourceKind, str]] = ..., weight: _Optional[float] = ..., target: _Optional[str] = ...) -> None: ...

class BatchingConfig(_message.Message):
    __slots__ = ("max_batch_size", "max_batch_tokens", "max_queue_delay_ms", "max_queue_size", "max_concurrent_batches")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_batch_tokens: int
    max_queue_delay_ms: float
    max_queue_size: int
    max_concurrent_batches: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_queue_delay_ms: _Optional[float] = ..., max_queue_size: _Optional[int] = ..., max_concurrent_batches: _Optional[int] = ...) -> None: ...

class RewardPipeline(_message.Message):
    __slots__ = ("name", "sources", "batching", "description", "extra_keys")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    name: str
    sources: _containers.RepeatedCompositeFieldContainer[RewardSource]
    batching: BatchingConfig
    description: str
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[RewardSource, _Mapping]]] = ..., batching: _Optional[_Union[BatchingConfig, _Mapping]] = ..., description: _Optional[str] = ..., extra_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepTracesRequest(_message.Message):
    __slots__ = ("sample_ids", "traceparents")
    class TraceparentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    traceparents: _containers.ScalarMap[str, str]
    def __init__(self, sample_ids: _Optional[_Iterable[str]] = ..., traceparents: _Optional[_Mapping[str, str]] = ...) -> None: ...

class KeepTracesResponse(_message.Message):
    __slots__ = ("kept_samples", "exported_spans")
    KEPT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_SPANS_FIELD_NUMBER: _ClassVar[int]
    kept_samples: int
    exported_spans: int
    def __init__(self, kept_samples: _Optional[int] = ..., exported_spans: _Optional[int] = ...) -> None: ...
