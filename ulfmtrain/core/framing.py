"""The framing that dataset and checkpoint files share: magic, header length, JSON header, header CRC32.

Both on-disk formats start with::

    offset 0        8 bytes      magic (b"ULFMDS01", b"ULFMCKPT")
    offset 8        uint32 LE    H = length of the JSON header in bytes
    offset 12       H bytes      JSON header (utf-8)
    offset 12 + H   uint32 LE    crc32 (zlib) of the H header bytes

What follows, and what the header holds, is each format's own business.  The
header is passed as bytes: each format chooses its JSON encoding, so the bytes
on disk stay exactly what that format always wrote.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

__all__ = ["PREAMBLE", "U32", "FrameError", "frame_end", "pack_frame", "unpack_frame"]

PREAMBLE = struct.Struct("<8sI")  # magic + header length
U32 = struct.Struct("<I")

# (offset, length) -> up to length bytes from offset: a slice of a buffer, or os.pread on a file.
ReadAt = Callable[[int, int], bytes]


class FrameError(ValueError):
    """The framing is damaged; ``problem`` is ``"magic"``, ``"truncated"`` or ``"checksum"``.

    Each format turns it into its own message naming the file and the fix.

    Attributes:
        problem: What is wrong.
        needed: Bytes the framed header needs (``"truncated"``).
        found: Bytes the file has (``"truncated"``).
        stored: The crc32 on disk (``"checksum"``).
        computed: The crc32 of the header bytes (``"checksum"``).
    """

    def __init__(self, problem: str, message: str, *, needed: int = 0, found: int = 0,
                 stored: int = 0, computed: int = 0) -> None:
        super().__init__(message)
        self.problem, self.needed, self.found = problem, needed, found
        self.stored, self.computed = stored, computed


def frame_end(header_len: int) -> int:
    """Return the offset of the first byte after a framed header of ``header_len`` bytes."""
    return PREAMBLE.size + header_len + U32.size


def pack_frame(magic: bytes, header: bytes) -> bytes:
    """Return the framed ``header``: preamble, the header bytes and their crc32."""
    return PREAMBLE.pack(magic, len(header)) + header + U32.pack(zlib.crc32(header))


def unpack_frame(read_at: ReadAt, size: int, magic: bytes) -> tuple[bytes, int]:
    """Read and verify a framed header from a file of ``size`` bytes.

    Returns:
        The header bytes and the offset just past the frame.

    Raises:
        FrameError: a wrong or short magic, a header running past ``size``, or a
            header checksum mismatch (checked in that order).
    """
    pre = read_at(0, PREAMBLE.size)
    if len(pre) < PREAMBLE.size or pre[:8] != magic:
        raise FrameError("magic", f"bad magic {bytes(pre[:8])!r}, expected {magic!r}")
    _, hlen = PREAMBLE.unpack(pre)
    end = frame_end(hlen)
    if end > size:
        raise FrameError("truncated", f"truncated: the header needs {end} bytes, found {size}",
                         needed=end, found=size)
    blob = read_at(PREAMBLE.size, hlen + U32.size)
    header, (stored,) = blob[:hlen], U32.unpack(blob[hlen:])
    computed = zlib.crc32(header)
    if stored != computed:
        raise FrameError("checksum", f"header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})",
                         stored=stored, computed=computed)
    return bytes(header), end
