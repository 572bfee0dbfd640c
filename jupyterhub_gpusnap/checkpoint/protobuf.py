"""The little of protobuf's wire format that CRIU's images and image streamer use.

A CRIU image file is two magic numbers (8 bytes), then records, each a little-endian
``u32`` length and a protobuf message (:func:`records`); a message is fields, each a
varint tag (number and wire type) and a value (:func:`fields`). Only the wire types CRIU
writes are read: varints, 64- and 32-bit fixed values, and length-delimited bytes
(strings, nested messages, packed lists).
"""

from __future__ import annotations

import struct

_LEN = struct.Struct("<I")


class ProtobufError(ValueError):
    """Bytes that are not the protobuf (or CRIU image) they should be."""


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at ``buf[i:]`` and the offset after it."""
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def varint(n: int) -> bytes:
    """``n`` (not negative) as a varint."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def fields(msg: bytes) -> list[tuple[int, int | bytes]]:
    """A message's fields in order, ``(number, value)``: an int for varints and fixed-size
    values, the bytes for length-delimited ones."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(msg):
        tag, i = read_varint(msg, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = read_varint(msg, i)
        elif wire == 2:
            n, i = read_varint(msg, i)
            if i + n > len(msg):
                raise ProtobufError(f"field {number}: {n} bytes, {len(msg) - i} left")
            value, i = msg[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if i + n > len(msg):
                raise ProtobufError(f"field {number}: truncated")
            value, i = int.from_bytes(msg[i : i + n], "little"), i + n
        else:
            raise ProtobufError(f"unexpected protobuf wire type {wire}")
        out.append((number, value))
    return out


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def varints(msg: bytes) -> dict[int, int]:
    """The varint and fixed-size fields of a message, by number (the last of each).

    A message of varint fields numbered 1-15 only (a pagemap entry: a GPU notebook's
    kernel has tens of thousands, read before a lazy restore starts CRIU) is decoded in
    one loop; any other goes through :func:`fields`."""
    out: dict[int, int] = {}
    i, n = 0, len(msg)
    while i < n:
        tag = msg[i]
        if tag & 0x87:  # not a one-byte tag of a varint field
            return {k: v for k, v in fields(msg) if isinstance(v, int)}
        i += 1
        value = shift = 0
        while True:
            if i >= n:
                raise ProtobufError("truncated varint")
            b = msg[i]
            i += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        out[tag >> 3] = value
    return out


def records(data: bytes, name: str = "image") -> list[bytes]:
    """The records of a CRIU image file's bytes (after its two magic numbers)."""
    if len(data) < 8:
        raise ProtobufError(f"{name}: too short for a CRIU image")
    out, i = [], 8
    while i < len(data):
        if i + 4 > len(data):
            raise ProtobufError(f"{name}: truncated record at byte {i}")
        (n,) = _LEN.unpack_from(data, i)
        i += 4
        if i + n > len(data):
            raise ProtobufError(f"{name}: truncated record at byte {i}")
        out.append(data[i : i + n])
        i += n
    return out
