import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from rewardmesh.v1 import common_pb2 as _common_pb2
from rewardmesh.v1 import reward_pb2 as _reward_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GRPC: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_DIST: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_CUDA_IPC: _ClassVar[WeightTransport]

class WeightEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_ENCODING_UNSPECIFIED: _ClassVar[WeightEncoding]
    WEIGHT_ENCODING_SPARSE: _ClassVar[WeightEncoding]
    WEIGHT_ENCODING_XOR: _ClassVar[WeightEncoding]
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_GRPC: WeightTransport
WEIGHT_TRANSPORT_DIST: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_CUDA_IPC: WeightTransport
WEIGHT_ENCODING_UNSPECIFIED: WeightEncoding
WEIGHT_ENCODING_SPARSE: WeightEncoding
WEIGHT_ENCODING_XOR: WeightEncoding

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("group_id", "token_ids", "chat", "sample_ids", "data_source", "ground_truth", "extra_info")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    token_ids: _common_pb2.Tensor
    chat: ChatPrompt
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    data_source: str
    ground_truth: str
    extra_info: _struct_pb2.Struct
    def __init__(self, group_id: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sample_ids: _Optional[_Iterable[str]] = ..., data_source: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "logprobs", "ignore_eos", "min_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: bool
    ignore_eos: bool
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class AgentLoopConfig(_message.Message):
    __slots__ = ("max_turns", "max_response_tokens", "tools")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    max_response_tokens: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_turns: _Optional[int] = ..., max_response_tokens: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "n", "sampling", "reward", "agent", "reward_timeout", "max_samples_per_message", "step_time_left")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    REWARD_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_LEFT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    sampling: SamplingParams
    reward: str
    agent: AgentLoopConfig
    reward_timeout: _duration_pb2.Duration
    max_samples_per_message: int
    step_time_left: _duration_pb2.Duration
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reward: _Optional[str] = ..., agent: _Optional[_Union[AgentLoopConfig, _Mapping]] = ..., reward_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_samples_per_message: _Optional[int] = ..., step_time_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample", "result", "trace_context", "items")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    result: _reward_pb2.RewardResult
    trace_context: _containers.ScalarMap[str, str]
    items: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ..., result: _Optional[_Union[_reward_pb2.RewardResult, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., items: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("chunk", "policy_version", "manifest", "delta_base_version")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    chunk: TensorChunk
    policy_version: int
    manifest: _containers.RepeatedCompositeFieldContainer[WeightSpec]
    delta_base_version: int
    def __init__(self, chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., policy_version: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[WeightSpec, _Mapping]]] = ..., delta_base_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "num_tensors", "num_bytes", "apply_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    num_bytes: int
    apply_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., apply_seconds: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutLoad(_message.Message):
    __slots__ = ("running_samples", "pending_rewards", "active_requests")
    RUNNING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PENDING_REWARDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    running_samples: int
    pending_rewards: int
    active_requests: int
    def __init__(self, running_samples: _Optional[int] = ..., pending_rewards: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "backend", "policy_version", "load", "max_model_len", "tools", "reward_targets", "weight_transports", "host_id", "instance_id", "dist_chain", "dist_layout", "dist_host_share", "cuda_device_uuid", "weight_delta")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    REWARD_TARGETS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DIST_CHAIN_FIELD_NUMBER: _ClassVar[int]
    DIST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DIST_HOST_SHARE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DELTA_FIELD_NUMBER: _ClassVar[int]
    model: str
    backend: str
    policy_version: int
    load: RolloutLoad
    max_model_len: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    reward_targets: _containers.RepeatedScalarFieldContainer[str]
    weight_transports: _containers.RepeatedScalarFieldContainer[WeightTransport]
    host_id: str
    instance_id: str
    dist_chain: bool
    dist_layout: int
    dist_host_share: bool
    cuda_device_uuid: str
    weight_delta: bool
    def __init__(self, model: _Optional[str] = ..., backend: _Optional[str] = ..., policy_version: _Optional[int] = ..., load: _Optional[_Union[RolloutLoad, _Mapping]] = ..., max_model_len: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ..., reward_targets: _Optional[_Iterable[str]] = ..., weight_transports: _Optional[_Iterable[_Union[WeightTransport, str]]] = ..., host_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., dist_chain: _Optional[bool] = ..., dist_layout: _Optional[int] = ..., dist_host_share: _Optional[bool] = ..., cuda_device_uuid: _Optional[str] = ..., weight_delta: _Optional[bool] = ...) -> None: ...

class WeightSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "digest", "encoding", "encoded_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    digest: int
    encoding: WeightEncoding
    encoded_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., digest: _Optional[int] = ..., encoding: _Optional[_Union[WeightEncoding, str]] = ..., encoded_bytes: _Optional[int] = ...) -> None: ...

class DistRendezvous(_message.Message):
    __slots__ = ("host", "port", "group", "rank", "world_size", "backend", "bucket_bytes", "chain", "layout", "share_with_next", "share_from_prev")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHARE_WITH_NEXT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FROM_PREV_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    group: str
    rank: int
    world_size: int
    backend: str
    bucket_bytes: int
    chain: bool
    layout: int
    share_with_next: bool
    share_from_prev: bool
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., group: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., chain: _Optional[bool] = ..., layout: _Optional[int] = ..., share_with_next: _Optional[bool] = ..., share_from_prev: _Optional[bool] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("storage_handle", "storage_size_bytes", "storage_offset_bytes", "stride", "offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., stride: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class CudaIpcSource(_message.Message):
    __slots__ = ("device_uuid", "handles")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handles: _containers.RepeatedCompositeFieldContainer[CudaIpcHandle]
    def __init__(self, device_uuid: _Optional[str] = ..., handles: _Optional[_Iterable[_Union[CudaIpcHandle, _Mapping]]] = ...) -> None: ...

class ShmSource(_message.Message):
    __slots__ = ("path", "offsets")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    path: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferWeightsRequest(_message.Message):
    __slots__ = ("tensors", "policy_version", "total_bytes", "dist", "shm", "cuda_ipc", "validate_only", "timeout", "delta_base_version")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIST_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[WeightSpec]
    policy_version: int
    total_bytes: int
    dist: DistRendezvous
    shm: ShmSource
    cuda_ipc: CudaIpcSource
    validate_only: bool
    timeout: _duration_pb2.Duration
    delta_base_version: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[WeightSpec, _Mapping]]] = ..., policy_version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., dist: _Optional[_Union[DistRendezvous, _Mapping]] = ..., shm: _Optional[_Union[ShmSource, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcSource, _Mapping]] = ..., validate_only: _Optional[bool] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., delta_base_version: _Optional[int] = ...) -> None: ...

class TransferWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "num_tensors", "num_bytes", "seconds", "apply_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    apply_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ...) -> None: ...
