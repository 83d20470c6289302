"""Cheap image checks from the encoded bytes: size from the header, completeness from the end marker.

Preprocessing must know each image's size and refuse missing or broken images, but decoding every
1280x720 JPEG only to learn its size would dominate the cost. Reading the header and the end marker
catches empty, truncated and non-image files at a fraction of the price.
"""

from __future__ import annotations

import struct

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"IEND\xaeB`\x82"
# JPEG start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])


class UnreadableImage(ValueError):
    """Bytes that are not a complete JPEG or PNG image."""


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a complete JPEG or PNG image; raises :class:`UnreadableImage` otherwise."""
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    if data.startswith(PNG_SIGNATURE):
        return _png_size(data)
    raise UnreadableImage("not a JPEG or PNG file" if data else "empty file")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    if not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise UnreadableImage("JPEG is truncated (no end-of-image marker)")
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise UnreadableImage(f"JPEG marker expected at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF_MARKERS:
            if pos + 9 > len(data):
                break
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            if width == 0 or height == 0:
                raise UnreadableImage("JPEG frame has zero size")
            return width, height
        if marker == 0xDA:  # start of scan before any frame header
            break
        pos += 2 + length
    raise UnreadableImage("JPEG has no frame header")


def _png_size(data: bytes) -> tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise UnreadableImage("PNG has no IHDR header")
    if not data.endswith(PNG_IEND):
        raise UnreadableImage("PNG is truncated (no IEND chunk)")
    width, height = struct.unpack(">II", data[16:24])
    if width == 0 or height == 0:
        raise UnreadableImage("PNG has zero size")
    return width, height
