"""A fast PNG writer for lane masks: 8-bit grayscale, rows above the lanes encoded once and cached.

A 1280x720 mask is ~40 % empty rows above the horizon and the rest mostly zeros too; encoding it
dominated preprocessing. The empty top rows compress to the same bytes for every image of a given
width, so their deflate output is cached (ended with a sync flush, which byte-aligns the stream) and
only the band holding lanes is compressed per image. The result is an ordinary PNG.
"""

from __future__ import annotations

import struct
import zlib
from functools import lru_cache

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ADLER_MOD = 65521


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


@lru_cache(maxsize=4096)
def _zero_rows_deflate(width: int, rows: int) -> bytes:
    """Raw deflate of ``rows`` empty scanlines (filter byte + zeros), not final, byte-aligned."""
    if rows == 0:
        return b""
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    return compressor.compress(bytes(rows * (width + 1))) + compressor.flush(zlib.Z_SYNC_FLUSH)


def encode_gray_png(band: np.ndarray, top: int, height: int) -> bytes:
    """PNG bytes of a ``height``-row uint8 image that is zero above row ``top`` and ``band`` from there on."""
    if band.dtype != np.uint8 or band.ndim != 2:
        raise ValueError("band must be a 2-D uint8 array")
    scanlines = np.zeros((band.shape[0], band.shape[1] + 1), dtype=np.uint8)
    scanlines[:, 1:] = band
    return encode_gray_png_scanlines(scanlines, top, height)


def encode_gray_png_scanlines(scanlines: np.ndarray, top: int, height: int) -> bytes:
    """Like :func:`encode_gray_png` for a band whose column 0 is left free (zero) for the filter bytes.

    Lets the rasterizer draw straight into PNG scanlines: the mask is never copied.
    """
    if scanlines.dtype != np.uint8 or scanlines.ndim != 2 or not scanlines.flags.c_contiguous:
        raise ValueError("scanlines must be a C-contiguous 2-D uint8 array")
    rows, width = scanlines.shape[0], scanlines.shape[1] - 1
    if top < 0 or top + rows != height:
        raise ValueError(f"band of {rows} rows from row {top} does not end at row {height}")
    if rows and scanlines[:, 0].any():
        raise ValueError("column 0 of the scanlines must be zero (PNG filter type 'none')")
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    deflated = _zero_rows_deflate(width, top) + compressor.compress(scanlines) + compressor.flush(zlib.Z_FINISH)
    # Adler-32 over the zero prefix has a closed form: a stays 1, b grows by 1 per byte.
    prefix_checksum = ((top * (width + 1)) % _ADLER_MOD) << 16 | 1
    adler = zlib.adler32(scanlines, prefix_checksum)
    stream = b"\x78\x01" + deflated + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")
