"""Unit tests for ulfmtrain.core.framing: the magic + header length + JSON header + CRC32 both file formats share."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from ulfmtrain.checkpoint.format import MAGIC as CKPT_MAGIC
from ulfmtrain.checkpoint.format import Snapshot, write_checkpoint
from ulfmtrain.core.framing import FrameError, frame_end, pack_frame, unpack_frame
from ulfmtrain.data.format import MAGIC as DATA_MAGIC
from ulfmtrain.data.writer import write_dataset

HEADER = json.dumps({"format": "test", "count": 3}, separators=(",", ":")).encode()


def _reader(raw: bytes):
    return lambda offset, n: raw[offset:offset + n]


def test_round_trip() -> None:
    raw = pack_frame(b"TESTMAG1", HEADER) + b"payload"
    header, end = unpack_frame(_reader(raw), len(raw), b"TESTMAG1")
    assert header == HEADER
    assert end == frame_end(len(HEADER)) == 12 + len(HEADER) + 4
    assert raw[end:] == b"payload"


def test_bytes_are_the_documented_layout() -> None:
    expected = b"TESTMAG1" + struct.pack("<I", len(HEADER)) + HEADER + struct.pack("<I", zlib.crc32(HEADER))
    assert pack_frame(b"TESTMAG1", HEADER) == expected


@pytest.mark.parametrize("raw", [b"", b"TEST", b"OTHERMAG" + b"\0" * 40])
def test_bad_magic_is_a_clear_error(raw: bytes) -> None:
    with pytest.raises(FrameError, match=r"^bad magic .*, expected b'TESTMAG1'$") as exc:
        unpack_frame(_reader(raw), len(raw), b"TESTMAG1")
    assert exc.value.problem == "magic"


def test_bad_header_checksum_is_a_clear_error() -> None:
    raw = bytearray(pack_frame(b"TESTMAG1", HEADER))
    raw[14] ^= 0x01                                       # one bit of the JSON header
    mismatch = r"^header checksum mismatch \(stored 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\)$"
    with pytest.raises(FrameError, match=mismatch) as exc:
        unpack_frame(_reader(bytes(raw)), len(raw), b"TESTMAG1")
    assert exc.value.problem == "checksum"
    assert exc.value.stored == zlib.crc32(HEADER) and exc.value.computed == zlib.crc32(bytes(raw[12:-4]))


def test_truncated_header_is_a_clear_error() -> None:
    raw = pack_frame(b"TESTMAG1", HEADER)[:-6]
    truncated = rf"^truncated: the header needs {len(raw) + 6} bytes, found {len(raw)}$"
    with pytest.raises(FrameError, match=truncated) as exc:
        unpack_frame(_reader(raw), len(raw), b"TESTMAG1")
    assert (exc.value.problem, exc.value.needed, exc.value.found) == ("truncated", len(raw) + 6, len(raw))


def test_both_formats_use_the_framing(tmp_path: Path) -> None:
    write_dataset(tmp_path / "d.ulfmds", {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})
    ckpt = write_checkpoint(tmp_path, Snapshot(step=1, epoch=0, records_done=0, world_size=1, model=[],
                                               sections={"replica": b"r"}))
    for path, magic, fmt in ((tmp_path / "d.ulfmds", DATA_MAGIC, "ulfmds"), (ckpt, CKPT_MAGIC, "ulfmtrain-checkpoint")):
        raw = path.read_bytes()
        header, _ = unpack_frame(_reader(raw), len(raw), magic)
        assert json.loads(header)["format"] == fmt
