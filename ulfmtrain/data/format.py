"""The ``.ulfmds`` file: its layout, and :class:`DatasetFile`, which validates and reads one.

The ``ulfmds`` format
=====================

One file holds one split (e.g. ``train.ulfmds``) as ``N`` fixed-size records, so
any range of records can be fetched with a single positioned read (``os.pread``)
and each rank can load exactly the records it is responsible for::

    offset 0            8 bytes           magic b"ULFMDS01"
    offset 8            uint32 LE         H = length of the JSON header in bytes
    offset 12           H bytes           JSON header (utf-8)
    offset 12 + H       uint32 LE         crc32 (zlib) of the H header bytes
    crc_offset          N x uint32 LE     crc32 of each record's bytes
    data_offset         N x record_size   the records

``crc_offset`` is ``12 + H + 4``; ``data_offset`` is the first multiple of
:data:`RECORD_ALIGN` (4096) at or after the end of the checksum table.  The file
ends exactly at ``data_offset + N * record_size``; anything shorter is truncated.
The first four rows are the framing shared with checkpoint files
(:mod:`ulfmtrain.core.framing`).

The JSON header is an object with the keys:

``format``       always ``"ulfmds"``
``version``      always ``1``
``count``        ``N``, the number of records
``record_size``  ``R``, bytes per record (the sum of the field sizes)
``fields``       list of ``{"name": str, "dtype": str, "shape": [int, ...]}``, e.g.
                 ``[{"name": "x", "dtype": "<f4", "shape": [1, 8, 8]},
                 {"name": "y", "dtype": "<i8", "shape": []}]``; dtypes are numpy
                 type strings with explicit little-endian byte order
``crc_offset``   byte offset of the per-record checksum table
``data_offset``  byte offset of the first record
``meta``         free-form object, e.g. ``{"source": "sklearn.load_digits", "classes": 10}``

A record is the concatenation of its fields' bytes, in field order, with no
padding.  Files are written atomically (temporary file in the same directory,
``fsync``, ``os.replace``) so a reader never sees a half-written file
(:mod:`.writer`).

Ranges of records are half-open ``(start, stop)`` integer tuples everywhere.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..core.framing import FrameError, frame_end, unpack_frame
from .plan import checked_ranges, ranges_len

__all__ = [
    "MAGIC",
    "RECORD_ALIGN",
    "FORMAT_VERSION",
    "SUFFIX",
    "DatasetError",
    "DatasetFile",
    "split_path",
    "dataset_paths",
]

MAGIC = b"ULFMDS01"
RECORD_ALIGN = 4096
FORMAT_VERSION = 1
SUFFIX = ".ulfmds"

FieldSpec = tuple[str, np.dtype, tuple[int, ...]]

# Records per block when copying or encoding in pieces: bounds temporary memory
# to roughly this many bytes regardless of dataset size.
BLOCK_BYTES = 64 << 20


class DatasetError(Exception):
    """A dataset file or writer input is unusable; the message names the problem and the fix."""


# --------------------------------------------------------------------------- names and helpers


def _fix_hint(path: Path, meta: Mapping[str, Any] | None = None) -> str:
    """Return the command that re-creates the dataset at ``path``."""
    source = (meta or {}).get("source") if isinstance(meta, Mapping) else None
    if source == "synthetic":
        return f"`python -m ulfmtrain data synthetic {path}`"
    return f"`python -m ulfmtrain data digits {path.parent}`"


def split_path(directory: str | os.PathLike[str], split: str) -> Path:
    """Return the file of ``split`` (``"train"``, ``"test"``) in a dataset directory."""
    return Path(directory) / f"{split}{SUFFIX}"


def dataset_paths(directory: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """Return the train file of a dataset directory and its test file (None when there is none).

    Raises:
        DatasetError: the directory has no train file; the message names the command that creates it.
    """
    d = Path(directory)
    train, test = split_path(d, "train"), split_path(d, "test")
    if not train.exists():
        raise DatasetError(f"dataset directory '{d}' has no {train.name}: create it with {_fix_hint(train)}")
    return train, test if test.exists() else None


def normalize_dtype(dtype: Any, what: str) -> np.dtype:
    """Return ``dtype`` with explicit little-endian byte order, rejecting non-plain types."""
    dt = np.dtype(dtype)
    if dt.fields is not None or dt.subdtype is not None or dt.hasobject or dt.itemsize == 0:
        raise DatasetError(
            f"{what} has unsupported dtype {dt!r}; use a plain numeric or fixed-size dtype"
        )
    if dt.byteorder not in ("<", "|"):
        dt = dt.newbyteorder("<")
    return dt


def record_dtype(fields: list[FieldSpec]) -> np.dtype:
    """Return the packed structured dtype of one record."""
    return np.dtype([(name, dt, shape) for name, dt, shape in fields])


def layout(header: dict[str, Any], count: int) -> tuple[bytes, int, int]:
    """Fill in the offsets of ``header`` and return (header bytes, crc_offset, data_offset)."""
    # The offsets are stored inside the header whose length they depend on, so
    # iterate to a fixed point; the digit counts only grow, so this converges.
    crc_offset = data_offset = 0
    while True:
        header["crc_offset"] = crc_offset
        header["data_offset"] = data_offset
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
        new_crc = frame_end(len(raw))
        new_data = -(-(new_crc + 4 * count) // RECORD_ALIGN) * RECORD_ALIGN
        if (new_crc, new_data) == (crc_offset, data_offset):
            return raw, crc_offset, data_offset
        crc_offset, data_offset = new_crc, new_data


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill the uint8 array ``buf`` from ``offset``; return the bytes read (short at EOF)."""
    view = buf.data.cast("B")
    done = 0
    while done < len(view):
        # Normally one call; the loop only handles the kernel's per-call cap
        # (about 2 GiB on Linux) and interrupted reads.
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, len(view) - done, offset + done)
            n = len(chunk)
            view[done : done + n] = chunk
        if n == 0:
            break
        done += n
    return done


def record_crcs(raw: np.ndarray, record_size: int) -> np.ndarray:
    """Return the crc32 of every record in the flat uint8 buffer ``raw``."""
    n = len(raw) // record_size if record_size else 0
    view = raw.data.cast("B")
    crc = zlib.crc32
    return np.fromiter(
        (crc(view[i * record_size : (i + 1) * record_size]) for i in range(n)),
        dtype="<u4",
        count=n,
    )


# --------------------------------------------------------------------------- reading


class DatasetFile:
    """Open a ulfmds file and read ranges of records with os.pread.

    Attributes:
        path: The file path.
        count: Number of records.
        record_size: Bytes per record.
        fields: ``(name, dtype, shape)`` per field, in record order.
        meta: The header's free-form metadata.
        header: The whole JSON header.
        bytes_read: Running total of record and checksum bytes read by :meth:`read`.
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        """Open ``path`` and validate magic, header checksum, header JSON and file size."""
        self.path = Path(path)
        self.verify = verify
        self.bytes_read = 0
        self._fd = -1
        hint = _fix_hint(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise DatasetError(f"dataset '{self.path}' is missing; create it with {hint}") from None
        except OSError as exc:
            raise DatasetError(
                f"dataset '{self.path}' cannot be opened ({exc.strerror}); "
                f"fix its permissions or re-create it with {hint}"
            ) from None
        self._fd = fd
        try:
            # Opening a directory read-only succeeds on Linux, so check the type.
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                train = split_path(self.path, "train")
                raise DatasetError(
                    f"dataset '{self.path}' is a directory, not a file; pass a .ulfmds file such as "
                    f"'{train}' or create one with {_fix_hint(train)}"
                )
            self._open(hint)
        except BaseException:
            self.close()
            raise

    def _open(self, hint: str) -> None:
        """Parse and validate the header of the open file."""
        fd = self._fd
        size = os.fstat(fd).st_size
        try:
            raw, hend = unpack_frame(lambda offset, n: os.pread(fd, n, offset), size, MAGIC)
        except FrameError as exc:
            if exc.problem == "magic":
                raise DatasetError(
                    f"dataset '{self.path}' has a bad magic number (not a ulfmds v1 file); re-create it with {hint}"
                ) from None
            if exc.problem == "truncated":
                raise DatasetError(
                    f"dataset '{self.path}' is truncated: header needs {exc.needed} bytes, "
                    f"found {exc.found}; re-create it with {hint}"
                ) from None
            raise DatasetError(
                f"dataset '{self.path}' has a corrupt header: checksum mismatch (stored {exc.stored:#010x}, "
                f"computed {exc.computed:#010x}); re-create it with {hint}"
            ) from None
        try:
            header = json.loads(raw.decode("utf-8"))
            if header.get("format") != "ulfmds" or header.get("version") != FORMAT_VERSION:
                raise ValueError(f"format/version {header.get('format')!r}/{header.get('version')!r}")
            count = int(header["count"])
            record_size = int(header["record_size"])
            crc_offset = int(header["crc_offset"])
            data_offset = int(header["data_offset"])
            fields: list[FieldSpec] = [
                (str(f["name"]), normalize_dtype(f["dtype"], "field"), tuple(int(s) for s in f["shape"]))
                for f in header["fields"]
            ]
            meta = header.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
            rec_dtype = record_dtype(fields)
            if rec_dtype.itemsize != record_size or record_size <= 0 or count < 0:
                raise ValueError(f"record_size {record_size} does not match fields ({rec_dtype.itemsize})")
            if crc_offset != hend or data_offset < crc_offset + 4 * count:
                raise ValueError("inconsistent crc_offset/data_offset")
        except (ValueError, KeyError, TypeError, AttributeError, DatasetError) as exc:
            # json.JSONDecodeError and UnicodeDecodeError are ValueErrors.
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DatasetError(
                f"dataset '{self.path}' has a corrupt header ({reason}); re-create it with {hint}"
            ) from None
        hint = _fix_hint(self.path, meta)
        expected = data_offset + count * record_size
        if size < expected:
            raise DatasetError(
                f"dataset '{self.path}' is truncated: expected {expected} bytes, found {size}; "
                f"re-create it with {hint}"
            )
        if size > expected:
            raise DatasetError(
                f"dataset '{self.path}' is corrupt: expected {expected} bytes, found {size} (trailing data); "
                f"re-create it with {hint}"
            )
        self.header: dict[str, Any] = header
        self.count = count
        self.record_size = record_size
        self.fields = fields
        self.meta: dict[str, Any] = meta
        self._dtype = rec_dtype
        self._crc_offset = crc_offset
        self._data_offset = data_offset
        self._hint = hint

    def read(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Read records ``[start, stop)`` with one positioned read (plus one for their checksums).

        The returned arrays are views into one freshly read, writable buffer (the
        per-field views are strided when there is more than one field).

        Raises:
            ValueError: the range is outside ``[0, count]``.
            DatasetError: the file is short or a record fails its checksum.
        """
        self._require_open()
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.count:
            raise ValueError(f"range ({start}, {stop}) is outside [0, {self.count}] of '{self.path}'")
        n = stop - start
        raw = np.empty(n * self.record_size, dtype=np.uint8)
        got = _pread_into(self._fd, raw, self._data_offset + start * self.record_size) if n else 0
        self.bytes_read += got
        if got != raw.size:
            raise DatasetError(
                f"dataset '{self.path}' is truncated: records {start}..{stop - 1} end past the end of the file; "
                f"re-create it with {self._hint}"
            )
        if self.verify and n:
            crc_buf = np.empty(4 * n, dtype=np.uint8)
            got = _pread_into(self._fd, crc_buf, self._crc_offset + 4 * start)
            self.bytes_read += got
            if got != crc_buf.size:  # pragma: no cover - size was validated at open
                raise DatasetError(f"dataset '{self.path}' is truncated; re-create it with {self._hint}")
            bad = np.flatnonzero(record_crcs(raw, self.record_size) != crc_buf.view("<u4"))
            if bad.size:
                first = start + int(bad[0])
                more = f" (and {bad.size - 1} more in {start}..{stop - 1})" if bad.size > 1 else ""
                raise DatasetError(
                    f"dataset '{self.path}' is corrupt: record {first} checksum mismatch{more}; "
                    f"re-create it with {self._hint}"
                )
        recs = np.frombuffer(raw, dtype=self._dtype, count=n)
        return {name: recs[name] for name, _, _ in self.fields}

    def read_ranges(self, ranges: Iterable[tuple[int, int]]) -> dict[str, np.ndarray]:
        """Read each range in order and return the records concatenated per field."""
        parts = [self.read(a, b) for a, b in checked_ranges(ranges) if b > a]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return self.read(0, 0)
        return {name: np.concatenate([p[name] for p in parts]) for name, _, _ in self.fields}

    def nbytes(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Return the bytes a read of ``ranges`` costs: records plus their checksums (when verifying)."""
        per_record = self.record_size + (4 if self.verify else 0)
        return ranges_len(checked_ranges(ranges)) * per_record

    def empty(self, n: int = 0) -> dict[str, np.ndarray]:
        """Return contiguous uninitialised per-field arrays for ``n`` records."""
        return {name: np.empty((n, *shape), dtype=dt) for name, dt, shape in self.fields}

    def drop_cache(self) -> bool:
        """Ask the kernel to drop this file's cached pages; return False if unsupported."""
        self._require_open()
        fadvise = getattr(os, "posix_fadvise", None)
        advice = getattr(os, "POSIX_FADV_DONTNEED", None)
        if fadvise is None or advice is None:
            return False
        try:
            fadvise(self._fd, 0, 0, advice)
        except OSError:
            return False
        return True

    def _require_open(self) -> None:
        """Raise if the file was closed."""
        if self._fd < 0:
            raise ValueError(f"dataset '{self.path}' is closed")

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> DatasetFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"DatasetFile('{self.path}', count={getattr(self, 'count', '?')})"

