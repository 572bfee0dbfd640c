"""protobuf: the wire format CRIU's images and image streamer use, read and (varints) written."""

from __future__ import annotations

import struct

import pytest

from jupyterhub_gpusnap.checkpoint.protobuf import (
    ProtobufError,
    fields,
    read_varint,
    records,
    varint,
    varints,
)


def test_varints_round_trip():
    for n in (0, 1, 127, 128, 300, 2**32, 2**64 - 1):
        assert read_varint(varint(n) + b"tail", 0) == (n, len(varint(n)))
    assert varint(300) == b"\xac\x02"


def test_fields_of_every_wire_type_criu_writes():
    msg = (
        b"\x08\x96\x01"  # 1: varint 150
        + b"\x12\x03abc"  # 2: bytes
        + b"\x19" + struct.pack("<Q", 7)  # 3: fixed64
        + b"\x25" + struct.pack("<I", 9)  # 4: fixed32
        + b"\x08\x01"  # 1 again: the last one wins in varints()
    )  # fmt: skip
    assert fields(msg) == [(1, 150), (2, b"abc"), (3, 7), (4, 9), (1, 1)]
    assert varints(msg) == {1: 1, 3: 7, 4: 9}


@pytest.mark.parametrize(
    "msg, match",
    [(b"\x08", "truncated varint"), (b"\x12\x05ab", "5 bytes, 2 left"),
     (b"\x19\x01", "truncated"), (b"\x0b", "wire type 3")],
)  # fmt: skip
def test_damaged_messages_say_what_is_wrong(msg, match):
    with pytest.raises(ProtobufError, match=match):
        fields(msg)


def test_records_of_an_image_file():
    image = b"M1M2M3M4" + struct.pack("<I", 2) + b"\x08\x01" + struct.pack("<I", 0)
    assert records(image) == [b"\x08\x01", b""]
    with pytest.raises(ProtobufError, match="x.img: too short"):
        records(b"M1M2", "x.img")
    with pytest.raises(ProtobufError, match="truncated record"):
        records(image[:-2], "x.img")
