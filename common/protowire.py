"""The protobuf wire format by hand, for the two places the generated code will not do: reading a weight chunk
without copying its bytes (the grpc plane), and splitting a message that does not parse into its samples (the
reward server). Varints and one message level's fields; malformed bytes raise protobuf's own DecodeError."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from google.protobuf.message import DecodeError

VARINT, I64, LEN, I32 = 0, 1, 2, 5  # wire types
_FIXED = {I64: 8, I32: 4}


def varint(n: int) -> bytes:
    """`n` as a varint; a negative int64 as protobuf writes it, ten bytes of two's complement."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def int64(v: int) -> int:
    """A varint's value read as protobuf's int64."""
    return v - (1 << 64) if v >= 1 << 63 else v


class Field(NamedTuple):
    """One field of a message: `begin` is where its key starts, `start`..`end` its value (a length-delimited
    field's payload); `value` is a varint field's value (0 for the other wire types)."""

    number: int
    wire: int
    begin: int
    start: int
    end: int
    value: int = 0


def fields(buf: bytes | memoryview) -> Iterator[Field]:
    """The fields of one message level, in wire order (nested messages are not entered)."""
    pos, end = 0, len(buf)
    while pos < end:
        begin = pos
        key, pos = read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            start = pos
            value, pos = read_varint(buf, pos)
            yield Field(number, wire, begin, start, pos, value)
            continue
        if wire == LEN:
            size, start = read_varint(buf, pos)
            pos = start + size
        elif wire in _FIXED:
            start, pos = pos, pos + _FIXED[wire]
        else:
            raise DecodeError(f"unsupported wire type {wire}")
        if pos > end:
            raise DecodeError("truncated field")
        yield Field(number, wire, begin, start, pos)
