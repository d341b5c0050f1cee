"""The manifest of a weight update and the one validator every data plane checks it with.

Every plane (gRPC chunks, a torch.distributed broadcast, shared memory, CUDA IPC) checks the same thing with the
same function, `check_weight`, before anything is applied: a known name, the model's shape, a float dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.tensors import dtype_name
from rewardmesh.v1 import common_pb2, rollout_pb2

# name -> (shape, dtype) of every tensor a rollout server's model accepts
Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

TORCH_DTYPES: dict[int, torch.dtype] = {
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_FLOAT32: torch.float32,
}
WIRE_DTYPES: dict[torch.dtype, common_pb2.DType] = {v: k for k, v in TORCH_DTYPES.items()}  # type: ignore[misc]
WEIGHT_DTYPES = set(TORCH_DTYPES)


class WeightsError(InvalidInput):
    """Unknown tensor name, or shape/dtype mismatch, or missing bytes: nothing was applied."""


def check_weight(name: str, shape: Sequence[int], dtype: torch.dtype | None, specs: Specs) -> None:
    """The one weight validator: raise WeightsError naming the tensor and the problem."""
    spec = specs.get(name)
    if spec is None:
        raise WeightsError(f"unknown tensor {name!r}: the model has no such parameter or buffer")
    if dtype not in WIRE_DTYPES:
        raise WeightsError(f"tensor {name!r}: dtype {dtype} is not one of bfloat16, float16, float32")
    if tuple(shape) != tuple(spec[0]):
        raise WeightsError(f"tensor {name!r}: shape {tuple(shape)} does not match the model's {tuple(spec[0])}")


def validate_weights(tensors: Mapping[str, torch.Tensor], specs: Specs) -> None:
    """Check every tensor before any is applied."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        check_weight(name, tensor.shape, tensor.dtype, specs)


def manifest(state: Mapping[str, torch.Tensor]) -> list[rollout_pb2.WeightSpec]:
    """Names, wire dtypes and shapes, in the state dict's order (the order every data plane carries them)."""
    out = []
    for name, t in state.items():
        if t.dtype not in WIRE_DTYPES:
            raise WeightsError(f"tensor {name!r}: dtype {t.dtype} is not one of bfloat16, float16, float32")
        out.append(rollout_pb2.WeightSpec(name=name, dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape)))
    return out


@dataclass(frozen=True)
class Entry:
    """One tensor of a checked manifest. `encoding` (a WeightEncoding): its bytes are a delta of `wire` bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    digest: int | None = None
    encoding: int = 0
    encoded_bytes: int = 0

    @property
    def wire(self) -> int:
        """Bytes this tensor takes on the data plane."""
        return self.encoded_bytes if self.encoding else self.nbytes


def check_manifest(specs_in: Sequence[rollout_pb2.WeightSpec], specs: Specs, total_bytes: int = 0) -> list[Entry]:
    """Validate a manifest against the model; WeightsError names the first bad tensor."""
    if not specs_in:
        raise WeightsError("tensors: the manifest is empty")
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, s in enumerate(specs_in):
        if s.name in seen:
            raise WeightsError(f"tensors[{i}]: tensor {s.name!r} appears twice")
        seen.add(s.name)
        if any(d < 0 for d in s.shape):
            raise WeightsError(f"tensor {s.name!r}: negative dimension in shape {list(s.shape)}")
        dtype = TORCH_DTYPES.get(s.dtype)
        if dtype is None:
            raise WeightsError(
                f"tensor {s.name!r}: dtype {dtype_name(s.dtype)} is not one of BFLOAT16, FLOAT16, FLOAT32"
            )
        check_weight(s.name, s.shape, dtype, specs)
        shape = tuple(int(d) for d in s.shape)
        entry = Entry(s.name, shape, dtype, math.prod(shape) * dtype.itemsize,
                      s.digest if s.HasField("digest") else None, int(s.encoding), int(s.encoded_bytes))  # fmt: skip
        if entry.encoding:
            check_encoding(entry)
        entries.append(entry)
    total = sum(e.wire for e in entries)
    if total_bytes > 0 and total_bytes != total:
        raise WeightsError(f"total_bytes: {total_bytes}, but the manifest's tensors add up to {total}")
    return entries


def check_encoding(e: Entry) -> None:
    """A delta entry's size must be one its encoding can have (WeightsError naming the tensor otherwise)."""
    n, size = e.nbytes // e.dtype.itemsize, e.dtype.itemsize
    if e.encoding == rollout_pb2.WEIGHT_ENCODING_SPARSE:
        per = 4 + size
        ok = e.encoded_bytes % per == 0 and e.encoded_bytes // per <= n
    elif e.encoding == rollout_pb2.WEIGHT_ENCODING_XOR:
        rest = e.encoded_bytes - (n + 7) // 8
        ok = rest >= 0 and rest % size == 0 and rest // size <= n
    else:
        raise WeightsError(f"tensor {e.name!r}: encoding {e.encoding} is not SPARSE or XOR")
    if not ok:
        raise WeightsError(f"tensor {e.name!r}: encoded_bytes {e.encoded_bytes} is not a size its encoding can have")
