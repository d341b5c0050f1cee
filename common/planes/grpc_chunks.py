"""The grpc plane: chunks on `UpdateWeights`. The trainer's side (`GrpcSender`): each message serialized once
(`iter_update_requests`) and fanned out to every server (`Fanout`); the server's side: a parser that copies no
chunk bytes (`parse_update_request`) and the assembler that stages them (`WeightAssembler`).

Each process recycles its message buffers (`common.allocator.keep_freed_memory`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from google.protobuf.message import DecodeError
from grpc import aio

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.planes.base import Settings, Staged, Target, TransferResults, Update, gather
from rewardmesh.common.planes.layout import byte_view
from rewardmesh.common.planes.manifest import (
    TORCH_DTYPES,
    Entry,
    Specs,
    WeightsError,
    check_manifest,
    check_weight,
    manifest,
)
from rewardmesh.common.protowire import LEN, VARINT, fields, int64, read_varint, varint
from rewardmesh.common.streams import DRAIN_S, drain
from rewardmesh.common.tensors import dtype_name
from rewardmesh.v1 import rollout_pb2


def iter_update_requests(
    state: Mapping[str, torch.Tensor],
    version: int = 0,
    chunk_bytes: int = 16 << 20,
    *,
    specs: Sequence[rollout_pb2.WeightSpec] | None = None,
    delta_base: int = 0,
) -> Iterator[bytes]:
    """Serialized UpdateWeightsRequest messages, each tensor split into chunks of at most chunk_bytes.

    specs: the manifest (default: `manifest(state)`); a delta-encoded tensor's bytes are its delta (`state` then
    holds the delta's uint8 bytes under the tensor's name), its chunks still carry the tensor's dtype and shape.
    Encoded by hand so each chunk's bytes are copied once, from the tensor straight into the message
    (protobuf would copy a slice into `bytes`, then again into the serialized message).
    """
    first = True
    specs = manifest(state) if specs is None else specs
    listing = rollout_pb2.UpdateWeightsRequest(manifest=specs).SerializeToString()
    for spec in specs:
        raw = memoryview(byte_view(state[spec.name].cpu()).numpy())  # type: ignore[arg-type]
        for offset in range(0, max(len(raw), 1), chunk_bytes):
            head = rollout_pb2.TensorChunk(name=spec.name, dtype=spec.dtype, shape=list(spec.shape),
                                           offset=offset).SerializeToString()  # fmt: skip
            data = raw[offset : offset + chunk_bytes]
            inner: list[bytes | memoryview] = [head, b"\x2a", varint(len(data)), data]  # field 5 (data)
            size = sum(len(p) for p in inner)
            parts = [b"\x0a", varint(size), *inner]  # field 1 (chunk), length-delimited
            if first:  # fields 2 (policy_version), 3 (manifest) and 4 (delta_base_version), on the first message
                parts += [b"\x10" + varint(version) if version else b"", listing]
                parts += [b"\x20" + varint(delta_base) if delta_base else b""]
            first = False
            yield b"".join(parts)


@dataclass
class ChunkView:
    """A TensorChunk whose `data` is a slice of the received message (no copy): what `parse_update_request`
    gives the assembler in place of the protobuf message, whose `data` getter copies the bytes on every read."""

    name: str = ""
    dtype: int = 0
    shape: list[int] = field(default_factory=list)
    offset: int = 0
    data: memoryview = field(default_factory=lambda: memoryview(b""))


@dataclass
class UpdateView:
    """One UpdateWeightsRequest, parsed by `parse_update_request`."""

    chunk: ChunkView | rollout_pb2.TensorChunk
    policy_version: int = 0
    manifest: Sequence[rollout_pb2.WeightSpec] = ()
    delta_base_version: int = 0


class _Unusual(Exception):
    """A valid encoding the fast parser leaves to protobuf (unknown fields, a repeated message field ...)."""


def _parse_chunk(buf: memoryview) -> ChunkView:
    chunk = ChunkView()
    for f in fields(buf):
        key = f.number, f.wire
        if key == (1, LEN):
            chunk.name = bytes(buf[f.start : f.end]).decode("utf-8")
        elif key == (2, VARINT):
            chunk.dtype = int64(f.value)
        elif key == (3, LEN):  # packed
            pos = f.start
            while pos < f.end:
                dim, pos = read_varint(buf, pos)
                chunk.shape.append(int64(dim))
        elif key == (3, VARINT):
            chunk.shape.append(int64(f.value))
        elif key == (4, VARINT):
            chunk.offset = int64(f.value)
        elif key == (5, LEN):
            chunk.data = buf[f.start : f.end]
        else:
            raise _Unusual(f"field {f.number}")
    return chunk


def parse_update_request(raw: bytes) -> UpdateView:
    """The UpdateWeights request deserializer: a chunk's bytes stay where gRPC put them (a memoryview), so the
    assembler copies them once, straight into the tensor. Anything unusual is left to protobuf."""
    buf = memoryview(raw)
    try:
        chunk: ChunkView | None = None
        version = base = 0
        listing: list[rollout_pb2.WeightSpec] = []
        for f in fields(buf):
            key = f.number, f.wire
            if key == (1, LEN) and chunk is None:
                chunk = _parse_chunk(buf[f.start : f.end])
            elif key == (2, VARINT):
                version = int64(f.value)
            elif key == (3, LEN):
                listing.append(rollout_pb2.WeightSpec.FromString(bytes(buf[f.start : f.end])))
            elif key == (4, VARINT):
                base = int64(f.value)
            else:
                raise _Unusual(f"field {f.number}")
        return UpdateView(chunk=chunk or ChunkView(), policy_version=version, manifest=listing, delta_base_version=base)
    except (_Unusual, DecodeError, UnicodeDecodeError):
        msg = rollout_pb2.UpdateWeightsRequest.FromString(raw)  # protobuf's verdict (DecodeError on garbage)
        return UpdateView(chunk=msg.chunk, policy_version=msg.policy_version, manifest=list(msg.manifest),
                          delta_base_version=msg.delta_base_version)  # fmt: skip


class WeightAssembler:
    """Collects UpdateWeights chunks into one preallocated tensor each (fresh, writable and nobody else's, so a
    backend may adopt them); `finish()` checks every byte arrived.

    `add` raises WeightsError naming the tensor (unknown name, wrong shape or dtype, bytes out of range).
    """

    def __init__(self, specs: Specs, buffer: Callable[[int], torch.Tensor] | None = None) -> None:
        self.specs = specs
        # where a tensor's bytes go: a flat uint8 tensor of exactly that many bytes that nothing else uses (a
        # receiver hands out the buffers its model left); default: a new one
        self.buffer = buffer or (lambda n: torch.empty(n, dtype=torch.uint8))
        self.expected: list[Entry] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, np.ndarray] = {}
        self._pieces: dict[str, list[tuple[int, int]]] = {}
        self._encoded: dict[str, int] = {}  # name -> bytes of a delta-encoded tensor
        self._kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # each tensor's, from its first chunk
        self.num_bytes = 0

    def expect(self, listing: Sequence[rollout_pb2.WeightSpec]) -> None:
        """The stream's manifest: checked now; `finish` then requires every tensor in it, whole."""
        self.expected = check_manifest(listing, self.specs)
        self.specs = {e.name: (e.shape, e.dtype) for e in self.expected}  # chunks must match the manifest
        self._encoded = {e.name: e.wire for e in self.expected if e.encoding}

    def add(self, chunk: rollout_pb2.TensorChunk | ChunkView) -> None:
        """Copy one chunk's bytes into its tensor (allocated at its first chunk): the one copy on this side."""
        name = chunk.name
        buf = self._bytes.get(name)
        shape = tuple(chunk.shape)
        if buf is None:
            dtype = TORCH_DTYPES.get(chunk.dtype)
            if dtype is None and name in self.specs:
                raise WeightsError(
                    f"tensor {name!r}: dtype {dtype_name(chunk.dtype)} is not one of BFLOAT16, FLOAT16, FLOAT32"
                )
            check_weight(name, shape, dtype, self.specs)
            assert dtype is not None
            self._kinds[name] = (dtype, shape)
            wire = self._encoded.get(name)
            if wire is not None:  # a delta's bytes, decoded once the stream is whole
                tensor = self.tensors[name] = self.buffer(wire)
            else:
                tensor = self.tensors[name] = self.buffer(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
            buf = self._bytes[name] = byte_view(tensor).numpy()
            self._pieces[name] = []
        elif (TORCH_DTYPES.get(chunk.dtype), shape) != self._kinds[name]:
            raise WeightsError(f"tensor {name!r}: dtype or shape changed between its chunks")
        data = chunk.data  # a protobuf message copies the bytes on every read of `data`: read it once
        end = chunk.offset + len(data)
        if chunk.offset < 0 or end > len(buf):
            raise WeightsError(f"tensor {name!r}: chunk bytes {chunk.offset}..{end} outside its {len(buf)}")
        buf[chunk.offset : end] = np.frombuffer(data, np.uint8)
        self._pieces[name].append((chunk.offset, end))
        self.num_bytes += len(data)

    def finish(self) -> dict[str, torch.Tensor]:
        if not self.tensors:
            raise WeightsError("UpdateWeights: the stream carried no chunks")
        missing = [e.name for e in self.expected or () if e.name not in self.tensors]
        if missing:
            raise WeightsError(f"tensor {missing[0]!r}: in the manifest but no bytes arrived ({len(missing)} missing)")
        for name, pieces in self._pieces.items():
            covered, size = 0, len(self._bytes[name])
            for start, end in sorted(pieces):
                if start < covered:
                    raise WeightsError(f"tensor {name!r}: chunks overlap at byte {start}")
                if start > covered:
                    raise WeightsError(f"tensor {name!r}: bytes {covered}..{start} missing")
                covered = end
            if covered != size:
                raise WeightsError(f"tensor {name!r}: got {covered} of {size} bytes")
        return self.tensors

    def staged(self) -> Staged:
        """The whole update (`finish`), in fresh tensors of ours that a backend may adopt."""
        tensors = self.finish()
        return Staged(tensors, owned=[byte_view(t) for t in tensors.values()])


# ---------------------------------------------------------------------------------------------- the server


Message = UpdateView | rollout_pb2.UpdateWeightsRequest  # what the server reads: parsed by hand, or by protobuf


async def receive_chunks(
    requests: AsyncIterator[Message], begin: Callable[[Message], WeightAssembler]
) -> WeightAssembler:
    """The server's side of one UpdateWeights stream: every chunk into the assembler `begin` makes from the first
    message (which must carry the manifest), each checked as it arrives; a refused stream is read on (`drain`),
    so its client hears why. The assembler's `staged()` then checks that every byte arrived."""
    assembler: WeightAssembler | None = None
    try:
        async for msg in requests:
            if assembler is None:
                if not msg.manifest:
                    raise InvalidInput("manifest: required on the first UpdateWeights message")
                assembler = begin(msg)
            assembler.add(msg.chunk)
    except Exception:
        await drain(requests, DRAIN_S)
        raise
    if assembler is None:
        raise InvalidInput("UpdateWeights: the stream carried no messages")
    return assembler


# --------------------------------------------------------------------------------------------- the trainer

_UPDATE_WEIGHTS = "/rewardmesh.v1.RolloutService/UpdateWeights"


class Fanout:
    """One stream of messages to several consumers, each at its own pace, but never more than `window` messages
    ahead of the slowest one still reading: the trainer holds `window` messages (16 MiB each by default), not
    the whole serialized model while one server lags (14 GB for a 7B model). A consumer that stops (its call
    failed, or timed out) leaves, and the others go on."""

    def __init__(self, source: Iterator[bytes], consumers: Sequence[str], window: int = 4) -> None:
        self._source = source
        self._queues = {c: asyncio.Queue[bytes | None](maxsize=window) for c in consumers}
        self._producer: asyncio.Task[None] | None = None
        self._error: Exception | None = None

    async def _produce(self) -> None:
        try:
            for message in itertools.chain(self._source, [None]):  # None: the end
                for c, q in list(self._queues.items()):
                    if c in self._queues:  # it may have left while this waited on another's queue
                        await q.put(message)
                if not self._queues:
                    return
        except Exception as exc:  # building a message failed: every consumer hears it, none waits on
            self._error = exc
            for q in self._queues.values():
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)

    async def messages(self, consumer: str) -> AsyncIterator[bytes]:
        if self._producer is None:
            self._producer = asyncio.get_running_loop().create_task(self._produce())
        q = self._queues[consumer]
        while (message := await q.get()) is not None:
            yield message
        if self._error is not None:
            raise self._error

    def leave(self, consumer: str) -> None:
        q = self._queues.pop(consumer, None)
        while q is not None and not q.empty():  # a put waiting on its full queue goes through
            q.get_nowait()
        if not self._queues and self._producer is not None:
            self._producer.cancel()


class GrpcSender:
    """The trainer's side: each message built once and sent to every server, at the pace of the slowest one within
    the fan-out's window."""

    def __init__(self, settings: Settings, chunk_bytes: int) -> None:
        self.settings, self.chunk_bytes = settings, chunk_bytes

    async def send(
        self, targets: Sequence[Target], update: Update, version: int, infos: Sequence[rollout_pb2.GetInfoResponse]
    ) -> TransferResults:
        messages = iter_update_requests(
            update.wire, version, self.chunk_bytes, specs=update.specs, delta_base=update.base
        )
        fanout = Fanout(messages, [a for a, _ in targets])
        return await gather(targets, lambda a, ch: self._grpc(ch, fanout, a))

    async def _grpc(self, channel: aio.Channel, fanout: Fanout, address: str) -> rollout_pb2.TransferWeightsResponse:
        call = channel.stream_unary(_UPDATE_WEIGHTS, request_serializer=None,
                                    response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString)  # fmt: skip
        try:
            r = await call(fanout.messages(address), timeout=self.settings.timeout_s)
        finally:
            fanout.leave(address)  # a failed server holds the others back no longer
        return rollout_pb2.TransferWeightsResponse(policy_version=r.policy_version, num_tensors=r.num_tensors,
                                                   num_bytes=r.num_bytes, apply_seconds=r.apply_seconds)  # fmt: skip

    def close(self) -> None:
        pass
