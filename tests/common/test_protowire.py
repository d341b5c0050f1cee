"""The hand-written wire format reads what protobuf writes, and refuses what protobuf refuses."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from rewardmesh.common.protowire import I32, I64, LEN, VARINT, fields, int64, read_varint, varint
from rewardmesh.v1 import rollout_pb2


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, (1 << 63) - 1, -1, -(1 << 63)])
def test_varints_round_trip_as_protobuf_writes_them(n: int) -> None:
    encoded = varint(n)
    if n:  # (protobuf writes no zero field)
        assert b"\x20" + encoded == rollout_pb2.TensorChunk(offset=n).SerializeToString()  # field 4, int64
    value, end = read_varint(encoded, 0)
    assert int64(value) == n and end == len(encoded)


def test_fields_of_every_wire_type_bound_their_values() -> None:
    raw = b"".join([
        b"\x08" + varint(150),  # 1: varint
        b"\x11" + bytes(range(8)),  # 2: 64-bit
        b"\x1a\x03abc",  # 3: length-delimited
        b"\x25" + bytes(4),  # 4: 32-bit
    ])  # fmt: skip
    got = list(fields(raw))
    assert [(f.number, f.wire) for f in got] == [(1, VARINT), (2, I64), (3, LEN), (4, I32)]
    assert got[0].value == 150 and raw[got[2].start : got[2].end] == b"abc"
    assert b"".join(raw[f.begin : f.end] for f in got) == raw  # every byte belongs to one field, in order


@pytest.mark.parametrize("raw", [b"\x08", b"\x08\xff", b"\x1a\x05ab", b"\x11\x00", b"\x0b", b"\x08" + b"\xff" * 10])
def test_malformed_bytes_raise_protobufs_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        list(fields(raw))
