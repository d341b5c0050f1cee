"""Named tensors <-> UpdateWeights chunks: the trainer splits a state dict, the rollout server reassembles it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from client.tensors import dtype_name, tensor_to_torch, torch_to_tensor
from rewardmesh.v1 import common_pb2, rollout_pb2

WEIGHT_DTYPES = {common_pb2.DTYPE_BFLOAT16, common_pb2.DTYPE_FLOAT16, common_pb2.DTYPE_FLOAT32}
_ITEMSIZE = {common_pb2.DTYPE_BFLOAT16: 2, common_pb2.DTYPE_FLOAT16: 2, common_pb2.DTYPE_FLOAT32: 4}


def iter_chunks(state: Mapping[str, torch.Tensor], chunk_bytes: int = 4 << 20) -> Iterator[rollout_pb2.TensorChunk]:
    """Split every tensor into chunks of at most chunk_bytes (messages stay under gRPC's size limit)."""
    for name, value in state.items():
        whole = torch_to_tensor(value)
        data = whole.raw_data
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield rollout_pb2.TensorChunk(
                name=name,
                dtype=whole.dtype,
                shape=whole.shape,
                offset=offset,
                data=data[offset : offset + chunk_bytes],
            )


@dataclass
class _Partial:
    dtype: int
    shape: tuple[int, ...]
    buffer: bytearray
    pieces: list[tuple[int, int]] = field(default_factory=list)


class WeightAssembler:
    """Collects chunks; `finish()` returns complete tensors or raises ValueError naming the tensor and problem."""

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.specs = specs
        self.partial: dict[str, _Partial] = {}
        self.num_bytes = 0

    def add(self, chunk: rollout_pb2.TensorChunk) -> None:
        name = chunk.name
        if name not in self.specs:
            raise ValueError(f"chunk.name: unknown tensor '{name}' (the model has no such parameter)")
        if chunk.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"chunk.dtype of '{name}': {dtype_name(chunk.dtype)}, expected BFLOAT16, FLOAT16 or FLOAT32"
            )
        shape = tuple(chunk.shape)
        expected = tuple(self.specs[name][0])
        if shape != expected:
            raise ValueError(f"chunk.shape of '{name}': {list(shape)}, but the model's is {list(expected)}")
        part = self.partial.get(name)
        if part is None:
            size = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[chunk.dtype]
            part = self.partial[name] = _Partial(chunk.dtype, shape, bytearray(size))
        elif part.dtype != chunk.dtype:
            raise ValueError(f"chunk.dtype of '{name}' changed between chunks ({dtype_name(part.dtype)} then "
                             f"{dtype_name(chunk.dtype)})")  # fmt: skip
        end = chunk.offset + len(chunk.data)
        if chunk.offset < 0 or end > len(part.buffer):
            raise ValueError(f"chunk.offset of '{name}': bytes {chunk.offset}..{end} outside its {len(part.buffer)}")
        part.buffer[chunk.offset : end] = chunk.data
        part.pieces.append((chunk.offset, end))
        self.num_bytes += len(chunk.data)

    def finish(self) -> dict[str, torch.Tensor]:
        if not self.partial:
            raise ValueError("UpdateWeights: the stream carried no chunks")
        out = {}
        for name, part in self.partial.items():
            covered = 0
            for start, end in sorted(part.pieces):
                if start < covered:
                    raise ValueError(f"chunk.offset of '{name}': chunks overlap at byte {start}")
                if start > covered:
                    raise ValueError(f"tensor '{name}': bytes {covered}..{start} missing")
                covered = end
            if covered != len(part.buffer):
                raise ValueError(f"tensor '{name}': got {covered} of {len(part.buffer)} bytes")
            wire = common_pb2.Tensor(dtype=part.dtype, shape=part.shape, raw_data=bytes(part.buffer))  # type: ignore[arg-type]
            out[name] = tensor_to_torch(wire, name)
        return out
