from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TURNS: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_MAX_TURNS: FinishReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "raw_data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw_data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., raw_data: _Optional[bytes] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SampleTiming(_message.Message):
    __slots__ = ("generate_sequences", "tool_calls", "reward", "reward_queue", "reward_compute", "num_preempted", "num_turns", "prompt_length", "response_length")
    GENERATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    generate_sequences: float
    tool_calls: float
    reward: float
    reward_queue: float
    reward_compute: float
    num_preempted: int
    num_turns: int
    prompt_length: int
    response_length: int
    def __init__(self, generate_sequences: _Optional[float] = ..., tool_calls: _Optional[float] = ..., reward: _Optional[float] = ..., reward_queue: _Optional[float] = ..., reward_compute: _Optional[float] = ..., num_preempted: _Optional[int] = ..., num_turns: _Optional[int] = ..., prompt_length: _Optional[int] = ..., response_length: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "group_id", "prompt_ids", "response_ids", "response_mask", "prompt_text", "response_text", "data_source", "ground_truth", "extra_info", "policy_version", "finish_reason", "timing", "response_logprobs", "response_policy_versions")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    group_id: str
    prompt_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    prompt_text: str
    response_text: str
    data_source: str
    ground_truth: str
    extra_info: _struct_pb2.Struct
    policy_version: int
    finish_reason: FinishReason
    timing: SampleTiming
    response_logprobs: Tensor
    response_policy_versions: Tensor
    def __init__(self, sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_text: _Optional[str] = ..., response_text: _Optional[str] = ..., data_source: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timing: _Optional[_Union[SampleTiming, _Mapping]] = ..., response_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., response_policy_versions: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
