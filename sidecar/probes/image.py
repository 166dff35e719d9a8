"""A small image made fresh for every canary to an encoder.

An encoder serves an image it has seen before from its cache (vLLM's encoder cache, keyed by the
image's hash): a repeated image would be answered without running the vision tower and so prove
nothing. The pixels here come from the canary's own request id, which is new for every canary,
so every canary's image is new, and one logged request id is enough to rebuild its image.

The PNG is written with the standard library (zlib and a CRC per chunk): 8-bit RGB, no
interlace, one filter byte per row, as every image loader reads it.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib

#: Pixels per side: as large as SGLang's own health-check image (32 x 32), small on the wire
#: (about 3 KB), and resized by every processor to its model's size.
SIDE = 32
_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _pixels(seed: str, count: int) -> bytes:
    """``count`` bytes drawn from ``seed``: SHA-256 in counter mode."""
    out = bytearray()
    block = 0
    while len(out) < count:
        out += hashlib.sha256(f"{seed}/{block}".encode()).digest()
        block += 1
    return bytes(out[:count])


def fresh_png(seed: str, side: int = SIDE) -> bytes:
    """A ``side`` x ``side`` RGB PNG whose pixels depend on ``seed`` alone."""
    row = side * 3
    pixels = _pixels(seed, row * side)
    raw = b"".join(b"\x00" + pixels[y * row : (y + 1) * row] for y in range(side))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        _SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )


def data_url(png: bytes) -> str:
    """The image as a ``data:`` URL, as OpenAI-style APIs take an inline image."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
