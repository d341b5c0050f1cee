"""The one place where protobuf Tensors become numpy arrays and back.

Tensors travel as raw little-endian bytes with a dtype and a shape (KServe v2's raw contents), so
a 4k-token response is 16 KiB of int32 rather than 4k varints. bfloat16 has no numpy dtype: it
travels as its 16-bit pattern and numpy sees it as uint16.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from rewardmesh.common.errors import InvalidInput
from rewardmesh.v1 import common_pb2

_NUMPY: dict[int, np.dtype] = {
    common_pb2.DTYPE_INT32: np.dtype("<i4"),
    common_pb2.DTYPE_INT64: np.dtype("<i8"),
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    common_pb2.DTYPE_UINT8: np.dtype("u1"),
}
_INT32 = common_pb2.DTYPE_INT32
_I4 = _NUMPY[_INT32]  # a dtype object: np.frombuffer parses a dtype string on every call
_LITTLE = sys.byteorder == "little"  # array("i") is native int32; the wire is little-endian
_FROM_NUMPY: dict[str, common_pb2.DType] = {
    "int32": common_pb2.DTYPE_INT32,
    "int64": common_pb2.DTYPE_INT64,
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "uint8": common_pb2.DTYPE_UINT8,
}


def dtype_name(dtype: int) -> str:
    try:
        return common_pb2.DType.Name(dtype).removeprefix("DTYPE_")
    except ValueError:
        return f"unknown({dtype})"


def tensor_to_numpy(
    t: common_pb2.Tensor, field: str, *, dtype: int | None = None, ndim: int | None = None
) -> np.ndarray:
    """Decode and validate; InvalidInput names the field and the problem (the server maps it to INVALID_ARGUMENT)."""
    if t.dtype not in _NUMPY:
        raise InvalidInput(f"{field}.dtype: {dtype_name(t.dtype)} is not a supported tensor dtype")
    if dtype is not None and t.dtype != dtype:
        raise InvalidInput(f"{field}.dtype must be {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    shape = tuple(t.shape)
    if ndim is not None and len(shape) != ndim:
        raise InvalidInput(f"{field}.shape must have {ndim} dimension(s), got {list(shape)}")
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{field}.shape has a negative dimension: {list(shape)}")
    np_dtype = _NUMPY[t.dtype]
    expected = math.prod(shape) * np_dtype.itemsize
    if len(t.raw_data) != expected:
        raise InvalidInput(
            f"{field}.raw_data has {len(t.raw_data)} bytes, but shape {list(shape)} of "
            f"{dtype_name(t.dtype)} needs {expected}"
        )
    return np.frombuffer(t.raw_data, dtype=np_dtype).reshape(shape)


def numpy_to_tensor(arr: np.ndarray, *, bfloat16: bool = False) -> common_pb2.Tensor:
    """Encode; pass bfloat16=True for a uint16 array holding bf16 bit patterns."""
    code: common_pb2.DType
    if bfloat16:
        code = common_pb2.DTYPE_BFLOAT16
        arr = arr.astype("<u2", copy=False)
    else:
        try:
            code = _FROM_NUMPY[arr.dtype.name]
        except KeyError:
            raise ValueError(f"no wire dtype for numpy dtype {arr.dtype}") from None
        arr = arr.astype(_NUMPY[code], copy=False)
    return common_pb2.Tensor(dtype=code, shape=list(arr.shape), raw_data=np.ascontiguousarray(arr).tobytes())


def ids_tensor(ids: Sequence[int] | np.ndarray) -> common_pb2.Tensor:
    """Token ids as a 1-D int32 tensor (a list is packed in C, no numpy round trip)."""
    if isinstance(ids, list) and _LITTLE:
        return common_pb2.Tensor(dtype=_INT32, shape=(len(ids),), raw_data=array.array("i", ids).tobytes())
    return numpy_to_tensor(np.asarray(ids, dtype=np.int32).reshape(-1))


def ids_from(t: common_pb2.Tensor, field: str) -> np.ndarray:
    """A 1-D int32 id tensor of values >= 0; an unset tensor is empty (text-only samples are fine)."""
    ids = ids_checked(t, field)
    return np.frombuffer(ids, dtype=_I4) if ids.__class__ is bytes else ids  # type: ignore[return-value]


def ids_checked(t: common_pb2.Tensor, field: str) -> bytes | np.ndarray:
    """What ids_from checks, without making the array in the common case: the tensor's little-endian int32
    bytes (for reward_engine.types.WireInput, which makes the array only if a source reads it), else the array."""
    raw = t.raw_data
    shape = t.shape  # each attribute access builds a wrapper: read it once (this runs twice per scored sample)
    if t.dtype == _INT32 and len(shape) == 1 and shape[0] * 4 == len(raw):  # the common case, checked cheaply
        # A negative little-endian int32 has the top bit of its last byte set: every 4th byte must be ASCII
        # (< 0x80), a C-level check ~15x cheaper than max() over the bytes.
        if not raw[3::4].isascii():
            arr = np.frombuffer(raw, dtype=_I4)
            bad = int(np.argmax(arr < 0))
            raise InvalidInput(f"{field}[{bad}] is {int(arr[bad])}: token ids and mask values must be >= 0")
        return raw
    if not raw and not t.shape and t.dtype == common_pb2.DTYPE_UNSPECIFIED:
        return _EMPTY_IDS
    arr = tensor_to_numpy(t, field, dtype=common_pb2.DTYPE_INT32, ndim=1)  # raises InvalidInput naming the problem
    return arr


_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_EMPTY_IDS.flags.writeable = False


def duration_seconds(duration: Any) -> float:
    """A google.protobuf.Duration as float seconds; never raises (ToTimedelta overflows past ~2.7e12 days,
    which a client can send). Negative stays negative: a deadline already passed."""
    return float(duration.seconds) + duration.nanos * 1e-9
