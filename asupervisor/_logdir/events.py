"""The records of a TensorBoard events file, read without TensorFlow.

An events file is a TFRecord file: each record is its length (8 bytes, little-endian),
that length's masked CRC-32C, the record, the record's masked CRC-32C. ``inspect
--no-verify`` reads them here, in Python, so that it needs no TensorFlow for a local
logdir: the frame of every record is checked (a truncated or garbled record ends the
file's reading as damage), the records' own checksums are not (TensorFlow's reader,
used when ``inspect`` verifies, checks those too).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

_MASK_DELTA = 0xA282EAD8


def _table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), in Python: for the 8 bytes of a length, never a record."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated and offset, so that a CRC of CRCs is not trivial."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def records(file: BinaryIO) -> Iterator[bytes]:
    """The records of an events file, in order. Raises ``ValueError`` at a record cut
    short or whose length's checksum is wrong (what came before it was yielded)."""
    while True:
        header = file.read(12)
        if not header:
            return
        if len(header) < 12:
            raise ValueError("a record's header is cut short")
        (length,) = struct.unpack("<Q", header[:8])
        (crc,) = struct.unpack("<I", header[8:])
        if masked_crc32c(header[:8]) != crc:
            raise ValueError("a record's length is corrupted")
        data = file.read(length)
        if len(data) < length or len(file.read(4)) < 4:
            raise ValueError("a record is cut short")
        yield data
