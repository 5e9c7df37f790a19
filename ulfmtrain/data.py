"""Record-oriented datasets on disk, partition plans, and recoverable in-memory shards.

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
``fsync``, ``os.replace``) so a reader never sees a half-written file.

Ranges of records are half-open ``(start, stop)`` integer tuples everywhere.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_file

__all__ = [
    "MAGIC",
    "RECORD_ALIGN",
    "FORMAT_VERSION",
    "Ranges",
    "DatasetError",
    "write_dataset",
    "write_dataset_chunks",
    "digits_to_dataset",
    "arrays_to_dataset",
    "synthetic_dataset",
    "records_for_bytes",
    "ShardedDataset",
    "initial_holdings",
    "merge_ranges",
    "ranges_len",
    "split_ranges",
    "RecoveryPlan",
    "plan_recovery",
    "check_coverage",
    "LocalShard",
]

MAGIC = b"ULFMDS01"
RECORD_ALIGN = 4096
FORMAT_VERSION = 1
SUFFIX = ".ulfmds"

Ranges = list[tuple[int, int]]
FieldSpec = tuple[str, np.dtype, tuple[int, ...]]

_PREAMBLE = struct.Struct("<8sI")  # magic + header length
_U32 = struct.Struct("<I")
# Records per block when copying or encoding in pieces: bounds temporary memory
# to roughly this many bytes regardless of dataset size.
_BLOCK_BYTES = 64 << 20
# Synthetic data is generated in fixed blocks of records, each from its own
# seeded generator, so the content does not depend on the chunk size used to
# write it.
_SYNTH_BLOCK = 1024


class DatasetError(Exception):
    """A dataset file or writer input is unusable; the message names the problem and the fix."""


# --------------------------------------------------------------------------- helpers


def _fix_hint(path: Path, meta: Mapping[str, Any] | None = None) -> str:
    """Return the command that re-creates the dataset at ``path``."""
    source = (meta or {}).get("source") if isinstance(meta, Mapping) else None
    if source == "synthetic":
        return f"`python -m ulfmtrain data synthetic {path}`"
    return f"`python -m ulfmtrain data digits {path.parent}`"


def _normalize_dtype(dtype: Any, what: str) -> np.dtype:
    """Return ``dtype`` with explicit little-endian byte order, rejecting non-plain types."""
    dt = np.dtype(dtype)
    if dt.fields is not None or dt.subdtype is not None or dt.hasobject or dt.itemsize == 0:
        raise DatasetError(
            f"{what} has unsupported dtype {dt!r}; use a plain numeric or fixed-size dtype"
        )
    if dt.byteorder not in ("<", "|"):
        dt = dt.newbyteorder("<")
    return dt


def _record_dtype(fields: list[FieldSpec]) -> np.dtype:
    """Return the packed structured dtype of one record."""
    return np.dtype([(name, dt, shape) for name, dt, shape in fields])


def _layout(header: dict[str, Any], count: int) -> tuple[bytes, int, int]:
    """Fill in the offsets of ``header`` and return (header bytes, crc_offset, data_offset)."""
    # The offsets are stored inside the header whose length they depend on, so
    # iterate to a fixed point; the digit counts only grow, so this converges.
    crc_offset = data_offset = 0
    while True:
        header["crc_offset"] = crc_offset
        header["data_offset"] = data_offset
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
        new_crc = _PREAMBLE.size + len(raw) + _U32.size
        new_data = -(-(new_crc + 4 * count) // RECORD_ALIGN) * RECORD_ALIGN
        if (new_crc, new_data) == (crc_offset, data_offset):
            return raw, crc_offset, data_offset
        crc_offset, data_offset = new_crc, new_data


def _pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    """Write all of ``buf`` at ``offset``, looping over short writes."""
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill the uint8 array ``buf`` from ``offset``; return the bytes read (short at EOF)."""
    view = memoryview(buf).cast("B")
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


def _record_crcs(raw: np.ndarray, record_size: int) -> np.ndarray:
    """Return the crc32 of every record in the flat uint8 buffer ``raw``."""
    n = len(raw) // record_size if record_size else 0
    view = memoryview(raw).cast("B")
    crc = zlib.crc32
    return np.fromiter(
        (crc(view[i * record_size : (i + 1) * record_size]) for i in range(n)),
        dtype="<u4",
        count=n,
    )


def _check_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Return ``ranges`` as a list of int tuples, rejecting reversed or negative ones."""
    out: Ranges = []
    for r in ranges:
        start, stop = (int(v) for v in r)
        if start < 0 or stop < start:
            raise ValueError(f"invalid range ({start}, {stop}): need 0 <= start <= stop")
        out.append((start, stop))
    return out


# --------------------------------------------------------------------------- writing


def write_dataset_chunks(
    path: str | os.PathLike[str],
    fields: list[tuple[str, Any, tuple[int, ...]]],
    count: int,
    chunks: Iterable[Mapping[str, np.ndarray]],
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Stream ``count`` records given as chunks of per-field arrays into a ulfmds file atomically.

    Args:
        path: Destination file; its parent directory is created if missing.
        fields: ``(name, dtype, shape)`` per field, in record order.
        count: Total number of records the chunks will provide.
        chunks: Mappings from every field name to an array of shape ``(n, *shape)``;
            values are cast to the field dtype.
        meta: JSON-serialisable free-form metadata.

    Raises:
        DatasetError: bad field specs, chunks that disagree with them, a record
            count other than ``count``, or unserialisable ``meta``.  An existing
            file at ``path`` is left untouched.
    """
    path = Path(path)
    count = int(count)
    if count < 0:
        raise DatasetError(f"cannot write dataset '{path}': negative record count {count}; pass count >= 0")
    specs: list[FieldSpec] = []
    seen: set[str] = set()
    for spec in fields:
        name, dtype, shape = spec
        if not isinstance(name, str) or not name or name in seen:
            raise DatasetError(
                f"cannot write dataset '{path}': field name {name!r} is empty, not a string or repeated; "
                "give every field a unique name"
            )
        seen.add(name)
        shape_t = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise DatasetError(f"cannot write dataset '{path}': field '{name}' has negative shape {shape_t}")
        specs.append((name, _normalize_dtype(dtype, f"field '{name}'"), shape_t))
    if not specs:
        raise DatasetError(f"cannot write dataset '{path}': no fields given; pass at least one array")
    rec_dtype = _record_dtype(specs)
    record_size = rec_dtype.itemsize
    if record_size == 0:
        raise DatasetError(f"cannot write dataset '{path}': records would be empty; give fields a non-empty shape")

    header: dict[str, Any] = {
        "format": "ulfmds",
        "version": FORMAT_VERSION,
        "count": count,
        "record_size": record_size,
        "fields": [{"name": n, "dtype": dt.str, "shape": list(s)} for n, dt, s in specs],
        "meta": dict(meta) if meta is not None else {},
    }
    try:
        raw_header, crc_offset, data_offset = _layout(header, count)
    except (TypeError, ValueError) as exc:
        raise DatasetError(
            f"cannot write dataset '{path}': meta is not JSON-serialisable ({exc}); "
            "pass plain str/number/list/dict values"
        ) from None

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fd = tmp.fileno()
        _pwrite_all(fd, _PREAMBLE.pack(MAGIC, len(raw_header)) + raw_header, 0)
        _pwrite_all(fd, _U32.pack(zlib.crc32(raw_header)), _PREAMBLE.size + len(raw_header))
        crcs = np.zeros(count, dtype="<u4")
        written = 0
        for chunk in chunks:
            if set(chunk) != seen:
                raise DatasetError(
                    f"cannot write dataset '{path}': chunk has fields {sorted(chunk)}, expected {sorted(seen)}; "
                    "give every chunk exactly the declared fields"
                )
            arrs = {name: np.asarray(chunk[name]) for name in seen}
            lengths = {len(a) if a.ndim else -1 for a in arrs.values()}
            if len(lengths) != 1 or -1 in lengths:
                raise DatasetError(
                    f"cannot write dataset '{path}': arrays have different lengths {sorted(lengths)}; "
                    "give every field the same number of records"
                )
            n = lengths.pop()
            if written + n > count:
                raise DatasetError(
                    f"cannot write dataset '{path}': chunks hold more than the declared {count} records; fix count"
                )
            # Encode in bounded blocks so a huge chunk does not double memory.
            step = max(1, _BLOCK_BYTES // record_size)
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                recs = np.empty(hi - lo, dtype=rec_dtype)
                for name, dt, shape in specs:
                    arr = arrs[name][lo:hi]
                    if arr.shape[1:] != shape:
                        raise DatasetError(
                            f"cannot write dataset '{path}': field '{name}' has record shape {arr.shape[1:]}, "
                            f"expected {shape}; reshape the array"
                        )
                    try:
                        recs[name] = arr.astype(dt, casting="same_kind", copy=False)
                    except TypeError:
                        raise DatasetError(
                            f"cannot write dataset '{path}': field '{name}' dtype {arr.dtype} cannot be stored "
                            f"as {dt}; convert the array first"
                        ) from None
                raw = recs.view(np.uint8)
                crcs[written : written + hi - lo] = _record_crcs(raw, record_size)
                _pwrite_all(fd, memoryview(raw), data_offset + written * record_size)
                written += hi - lo
        if written != count:
            raise DatasetError(
                f"cannot write dataset '{path}': chunks held {written} records, expected {count}; fix count"
            )
        _pwrite_all(fd, memoryview(crcs.view(np.uint8)), crc_offset)
        # Extends a file with no records (and any alignment gap) to its exact size.
        os.ftruncate(fd, data_offset + count * record_size)


def write_dataset(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Write per-field arrays sharing a first dimension as a ulfmds file, atomically.

    Raises:
        DatasetError: no arrays, scalar arrays, mismatched lengths or unsupported dtypes.
    """
    path = Path(path)
    if not arrays:
        raise DatasetError(f"cannot write dataset '{path}': no arrays given; pass at least one array")
    arrs = {name: np.asarray(a) for name, a in arrays.items()}
    for name, a in arrs.items():
        if a.ndim == 0:
            raise DatasetError(
                f"cannot write dataset '{path}': array '{name}' is a scalar; give it a leading record dimension"
            )
    lengths = {name: len(a) for name, a in arrs.items()}
    if len(set(lengths.values())) != 1:
        raise DatasetError(
            f"cannot write dataset '{path}': arrays have mismatched lengths {lengths}; "
            "give every array the same number of records"
        )
    count = next(iter(lengths.values()))
    fields = [(name, _normalize_dtype(a.dtype, f"array '{name}'"), a.shape[1:]) for name, a in arrs.items()]
    write_dataset_chunks(path, fields, count, [arrs], meta)


def digits_to_dataset(
    out_dir: str | os.PathLike[str], test_fraction: float = 0.2, seed: int = 0
) -> tuple[Path, Path]:
    """Convert scikit-learn's bundled digits into ``train.ulfmds`` and ``test.ulfmds`` under ``out_dir``.

    ``x`` is float32 of shape (1, 8, 8) scaled to [0, 1]; ``y`` is int64.  The
    split is a stratified shuffle with ``seed``.

    Returns:
        The train and test file paths.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # Imported here so reading datasets never pays for (or needs) scikit-learn.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data.astype(np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, shuffle=True, stratify=y
    )
    out = Path(out_dir)
    base = {"source": "sklearn.load_digits", "classes": 10, "seed": seed, "test_fraction": test_fraction}
    train, test = out / f"train{SUFFIX}", out / f"test{SUFFIX}"
    write_dataset(train, {"x": x_tr, "y": y_tr}, {**base, "split": "train"})
    write_dataset(test, {"x": x_te, "y": y_te}, {**base, "split": "test"})
    return train, test


def arrays_to_dataset(
    out_dir: str | os.PathLike[str],
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    meta: Mapping[str, Any] | None = None,
) -> tuple[Path, Path | None]:
    """Write in-memory ``x``/``y`` arrays as ``train.ulfmds`` (and ``test.ulfmds``) under ``out_dir``.

    Dtypes are stored as given.  If ``meta`` lacks ``classes`` and the labels are
    integers, ``classes`` is set to ``max(label) + 1``.

    Returns:
        The train path and the test path (None when no test arrays were given).
    """
    if (x_test is None) != (y_test is None):
        raise ValueError("give both x_test and y_test, or neither")
    info: dict[str, Any] = {"source": "arrays", **(dict(meta) if meta else {})}
    labels = [np.asarray(y_train)] + ([np.asarray(y_test)] if y_test is not None else [])
    if "classes" not in info and all(np.issubdtype(lab.dtype, np.integer) for lab in labels):
        sizes = [lab.size for lab in labels]
        if sum(sizes):
            info["classes"] = int(max(int(lab.max()) for lab in labels if lab.size)) + 1
    out = Path(out_dir)
    train = out / f"train{SUFFIX}"
    write_dataset(train, {"x": x_train, "y": y_train}, {**info, "split": "train"})
    test = None
    if x_test is not None:
        test = out / f"test{SUFFIX}"
        write_dataset(test, {"x": x_test, "y": y_test}, {**info, "split": "test"})  # type: ignore[dict-item]
    return train, test


def records_for_bytes(total_bytes: int, features: int = 1024) -> int:
    """Return how many synthetic records of ``features`` float32 values fill ``total_bytes`` (rounded up)."""
    if total_bytes < 0 or features < 1:
        raise ValueError(f"need total_bytes >= 0 and features >= 1, got {total_bytes}, {features}")
    return -(-int(total_bytes) // (4 * int(features)))


def _synthetic_means(features: int, classes: int, seed: int) -> np.ndarray:
    """Return the per-class mean vectors of the synthetic set."""
    # Scaling by 1/sqrt(features) keeps the distance between class means (about
    # 5.7 noise standard deviations) independent of the feature count, so the
    # task is learnable but not separable by any single feature.
    rng = np.random.default_rng([seed, 0])
    return (rng.standard_normal((classes, features)) * (4.0 / math.sqrt(features))).astype(np.float32)


def _synthetic_block(block: int, means: np.ndarray, seed: int, records: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (x, y) of synthetic block ``block``, truncated to ``records`` total records."""
    lo = block * _SYNTH_BLOCK
    n = min(_SYNTH_BLOCK, records - lo)
    rng = np.random.default_rng([seed, 1, block])
    classes, features = means.shape
    y = rng.integers(0, classes, size=n, dtype=np.int64)
    x = rng.standard_normal((n, features), dtype=np.float32)
    x += means[y]
    return x, y


def synthetic_dataset(
    path: str | os.PathLike[str],
    records: int,
    features: int = 1024,
    classes: int = 10,
    seed: int = 0,
    chunk_records: int = 8192,
) -> Path:
    """Write a learnable synthetic classification set (Gaussian classes) in bounded-memory chunks.

    ``x`` is float32 of shape ``(features,)`` drawn around a class-dependent mean,
    ``y`` is int64 in ``[0, classes)``.  The content depends only on ``records``,
    ``features``, ``classes`` and ``seed``, not on ``chunk_records``.

    Returns:
        The written path.
    """
    if records < 0 or features < 1 or classes < 1 or chunk_records < 1 or seed < 0:
        raise ValueError(
            "need records >= 0, features >= 1, classes >= 1, chunk_records >= 1, seed >= 0; got "
            f"{records}, {features}, {classes}, {chunk_records}, {seed}"
        )
    means = _synthetic_means(features, classes, seed)

    def chunks() -> Iterator[dict[str, np.ndarray]]:
        # Each chunk covers [lo, hi); it is assembled from the fixed-size blocks
        # overlapping it so the bytes are the same for any chunk size.
        for lo in range(0, records, chunk_records):
            hi = min(records, lo + chunk_records)
            xs, ys = [], []
            for block in range(lo // _SYNTH_BLOCK, (hi - 1) // _SYNTH_BLOCK + 1):
                bx, by = _synthetic_block(block, means, seed, records)
                a = max(lo, block * _SYNTH_BLOCK) - block * _SYNTH_BLOCK
                b = min(hi, (block + 1) * _SYNTH_BLOCK) - block * _SYNTH_BLOCK
                xs.append(bx[a:b])
                ys.append(by[a:b])
            yield {"x": np.concatenate(xs), "y": np.concatenate(ys)}

    out = Path(path)
    fields = [("x", np.dtype("<f4"), (features,)), ("y", np.dtype("<i8"), ())]
    meta = {"source": "synthetic", "classes": classes, "features": features, "seed": seed}
    write_dataset_chunks(out, fields, records, chunks(), meta)
    return out


# --------------------------------------------------------------------------- reading


class ShardedDataset:
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
                raise DatasetError(
                    f"dataset '{self.path}' is a directory, not a file; pass a .ulfmds file such as "
                    f"'{self.path / ('train' + SUFFIX)}' or create one with {_fix_hint(self.path / ('train' + SUFFIX))}"
                )
            self._open(hint)
        except BaseException:
            self.close()
            raise

    def _open(self, hint: str) -> None:
        """Parse and validate the header of the open file."""
        fd = self._fd
        size = os.fstat(fd).st_size
        pre = os.pread(fd, _PREAMBLE.size, 0)
        if len(pre) < _PREAMBLE.size or pre[:8] != MAGIC:
            raise DatasetError(
                f"dataset '{self.path}' has a bad magic number (not a ulfmds v1 file); re-create it with {hint}"
            )
        _, hlen = _PREAMBLE.unpack(pre)
        if _PREAMBLE.size + hlen + _U32.size > size:
            raise DatasetError(
                f"dataset '{self.path}' is truncated: header needs {_PREAMBLE.size + hlen + _U32.size} bytes, "
                f"found {size}; re-create it with {hint}"
            )
        blob = os.pread(fd, hlen + _U32.size, _PREAMBLE.size)
        raw, (stored,) = blob[:hlen], _U32.unpack(blob[hlen:])
        computed = zlib.crc32(raw)
        if stored != computed:
            raise DatasetError(
                f"dataset '{self.path}' has a corrupt header: checksum mismatch (stored {stored:#010x}, "
                f"computed {computed:#010x}); re-create it with {hint}"
            )
        try:
            header = json.loads(raw.decode("utf-8"))
            if header.get("format") != "ulfmds" or header.get("version") != FORMAT_VERSION:
                raise ValueError(f"format/version {header.get('format')!r}/{header.get('version')!r}")
            count = int(header["count"])
            record_size = int(header["record_size"])
            crc_offset = int(header["crc_offset"])
            data_offset = int(header["data_offset"])
            fields: list[FieldSpec] = [
                (str(f["name"]), _normalize_dtype(f["dtype"], "field"), tuple(int(s) for s in f["shape"]))
                for f in header["fields"]
            ]
            meta = header.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
            rec_dtype = _record_dtype(fields)
            if rec_dtype.itemsize != record_size or record_size <= 0 or count < 0:
                raise ValueError(f"record_size {record_size} does not match fields ({rec_dtype.itemsize})")
            if crc_offset != _PREAMBLE.size + hlen + _U32.size or data_offset < crc_offset + 4 * count:
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
            bad = np.flatnonzero(_record_crcs(raw, self.record_size) != crc_buf.view("<u4"))
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
        parts = [self.read(a, b) for a, b in _check_ranges(ranges) if b > a]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return self.read(0, 0)
        return {name: np.concatenate([p[name] for p in parts]) for name, _, _ in self.fields}

    def nbytes(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Return the bytes a read of ``ranges`` costs: records plus their checksums (when verifying)."""
        per_record = self.record_size + (4 if self.verify else 0)
        return ranges_len(_check_ranges(ranges)) * per_record

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

    def __enter__(self) -> ShardedDataset:
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
        return f"ShardedDataset('{self.path}', count={getattr(self, 'count', '?')})"


# --------------------------------------------------------------------------- partition plans


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort ranges and coalesce adjacent or overlapping ones, dropping empty ones."""
    out: Ranges = []
    for start, stop in sorted(r for r in _check_ranges(ranges) if r[1] > r[0]):
        if out and start <= out[-1][1]:
            if stop > out[-1][1]:
                out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def ranges_len(ranges: Iterable[tuple[int, int]]) -> int:
    """Return the total number of records in ``ranges`` (overlaps counted twice)."""
    return sum(stop - start for start, stop in ranges)


def split_ranges(ranges: Iterable[tuple[int, int]], parts: int) -> list[Ranges]:
    """Split the concatenation of ``ranges`` into ``parts`` contiguous, balanced pieces.

    Part ``i`` gets items ``[L*i//parts, L*(i+1)//parts)`` of the concatenation,
    where ``L`` is the total length; a part may be empty.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    rs = [r for r in _check_ranges(ranges) if r[1] > r[0]]
    total = ranges_len(rs)
    out: list[Ranges] = []
    idx, offset = 0, 0  # current range and position inside it
    for i in range(parts):
        want = total * (i + 1) // parts - total * i // parts
        piece: Ranges = []
        while want:
            start, stop = rs[idx]
            take = min(want, stop - start - offset)
            piece.append((start + offset, start + offset + take))
            want -= take
            offset += take
            if start + offset == stop:
                idx, offset = idx + 1, 0
        out.append(piece)
    return out


def initial_holdings(count: int, world_size: int) -> dict[int, Ranges]:
    """Return each rank's contiguous shard ``[r*count//W, (r+1)*count//W)`` (empty list if empty)."""
    if world_size < 1 or count < 0:
        raise ValueError(f"need world_size >= 1 and count >= 0, got {world_size}, {count}")
    out: dict[int, Ranges] = {}
    for r in range(world_size):
        a, b = r * count // world_size, (r + 1) * count // world_size
        out[r] = [(a, b)] if b > a else []
    return out


@dataclass(frozen=True)
class RecoveryPlan:
    """Who holds and who must read which records after some ranks died.

    Attributes:
        holdings: New holdings of every survivor (keys are surviving world ranks).
        reads: What each survivor must read from disk.
        lost: Merged records the dead ranks held.
        mode: ``"partial"`` (read only the share of lost records) or ``"full"``
            (re-read the whole new shard).
    """

    holdings: dict[int, Ranges]
    reads: dict[int, Ranges]
    lost: Ranges
    mode: str = "partial"
    dead: tuple[int, ...] = field(default=())

    @property
    def survivors(self) -> list[int]:
        """Return the surviving world ranks in ascending order."""
        return sorted(self.holdings)


_MODES = ("partial", "full")


def plan_recovery(
    holdings: Mapping[int, Ranges], dead: Iterable[int], mode: str = "partial"
) -> RecoveryPlan:
    """Redistribute the dead ranks' records over the survivors in ascending world-rank order.

    Raises:
        ValueError: unknown ``mode``, a dead rank not in ``holdings``, or no survivors.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown recovery mode {mode!r}; use one of {_MODES}")
    dead_set = {int(d) for d in dead}
    unknown = sorted(dead_set - set(holdings))
    if unknown:
        raise ValueError(f"dead ranks {unknown} are not in the holdings (ranks {sorted(holdings)})")
    survivors = sorted(r for r in holdings if r not in dead_set)
    if not survivors:
        raise ValueError(f"no survivors: all ranks {sorted(holdings)} are dead")
    lost = merge_ranges(r for d in dead_set for r in holdings[d])
    shares = split_ranges(lost, len(survivors))
    new_holdings: dict[int, Ranges] = {}
    reads: dict[int, Ranges] = {}
    for s, share in zip(survivors, shares):
        new_holdings[s] = merge_ranges(list(holdings[s]) + share)
        reads[s] = share if mode == "partial" else list(new_holdings[s])
    return RecoveryPlan(new_holdings, reads, lost, mode, tuple(sorted(dead_set)))


def check_coverage(holdings: Mapping[int, Ranges], count: int) -> None:
    """Raise ValueError naming the first gap or overlap unless ``holdings`` cover ``[0, count)`` exactly once."""
    pieces = sorted((a, b, rank) for rank, rs in holdings.items() for a, b in _check_ranges(rs) if b > a)
    pos, prev_rank = 0, None
    for a, b, rank in pieces:
        if a > pos:
            raise ValueError(f"records [{pos}, {a}) are held by no rank")
        if a < pos:
            raise ValueError(
                f"records [{a}, {min(b, pos)}) are held twice (ranks {prev_rank} and {rank})"
            )
        if b > count:
            raise ValueError(f"rank {rank} holds records [{max(a, count)}, {b}) past the end ({count})")
        pos, prev_rank = b, rank
    if pos < count:
        raise ValueError(f"records [{pos}, {count}) are held by no rank")


# --------------------------------------------------------------------------- local shard


class LocalShard:
    """The records one rank holds in memory, grown after a recovery without copying what it had.

    Records are kept in segments, one per load: a partial reload appends one
    segment, so its cost follows the lost records, not the whole shard.
    Index i counts through the segments in the order they were loaded
    (``order`` gives the record ranges in that order).

    Attributes:
        holdings: Merged ranges held, in ascending order.
        order: The same records as ranges, in storage (index) order.
    """

    def __init__(self, dataset: ShardedDataset, holdings: Iterable[tuple[int, int]]) -> None:
        """Load ``holdings`` (merged and sorted) from ``dataset``."""
        self.dataset = dataset
        self.holdings: Ranges = merge_ranges(holdings)
        self.order: Ranges = list(self.holdings)
        self._segments = [self._load(self.holdings)]
        self._starts = np.zeros(1, dtype=np.int64)

    def __len__(self) -> int:
        return ranges_len(self.holdings)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every held record as contiguous per-field arrays, in index order (a copy once there are segments)."""
        if len(self._segments) == 1:
            return self._segments[0]
        return {k: np.concatenate([seg[k] for seg in self._segments]) for k in self._segments[0]}

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gather the records at indices idx (a batch)."""
        if len(self._segments) == 1:
            return {k: v[idx] for k, v in self._segments[0].items()}
        seg = np.searchsorted(self._starts, idx, side="right") - 1
        out = {k: np.empty((len(idx), *v.shape[1:]), v.dtype) for k, v in self._segments[0].items()}
        for s in np.unique(seg):
            mask = seg == s
            local = idx[mask] - self._starts[s]
            for k in out:
                out[k][mask] = self._segments[s][k][local]
        return out

    def _load(self, ranges: Ranges) -> dict[str, np.ndarray]:
        """Read ``ranges`` into freshly allocated contiguous arrays in bounded pieces."""
        ds = self.dataset
        out = ds.empty(ranges_len(ranges))
        # Reading in blocks keeps the transient read buffer small even when the
        # shard is many GiB; each block is still a single positioned read.
        step = max(1, _BLOCK_BYTES // ds.record_size)
        pos = 0
        for start, stop in ranges:
            for lo in range(start, stop, step):
                hi = min(stop, lo + step)
                part = ds.read(lo, hi)
                for name in out:
                    out[name][pos : pos + hi - lo] = part[name]
                pos += hi - lo
        return out

    def apply(self, plan: RecoveryPlan, rank: int) -> tuple[int, float]:
        """Bring this shard to ``plan.holdings[rank]``, reading only what the plan's mode requires.

        Returns:
            Bytes read from the dataset and the seconds spent.

        Raises:
            ValueError: ``rank`` is not a survivor, or the plan was not made from
                this shard's holdings.
        """
        if rank not in plan.holdings:
            raise ValueError(f"rank {rank} is not a survivor in this plan (survivors {plan.survivors})")
        target = merge_ranges(plan.holdings[rank])
        reads = _check_ranges(plan.reads[rank])
        t0 = time.perf_counter()
        before = self.dataset.bytes_read
        if plan.mode == "full":
            if merge_ranges(reads) != target or ranges_len(reads) != ranges_len(target):
                raise ValueError(f"plan reads for rank {rank} do not equal its new holdings")
            # Release the old copy first so peak memory is one shard, not two.
            self._segments = []
            self._segments = [self._load(reads)]
            self._starts = np.zeros(1, dtype=np.int64)
            self.order = list(reads)
        elif plan.mode == "partial":
            if merge_ranges(self.holdings + reads) != target or ranges_len(self.holdings) + ranges_len(
                reads
            ) != ranges_len(target):
                raise ValueError(
                    f"plan for rank {rank} was not made from this shard's holdings {self.holdings}"
                )
            if reads:
                self._starts = np.append(self._starts, len(self))
                self._segments.append(self._load(reads))
                self.order = self.order + list(reads)
        else:
            raise ValueError(f"unknown recovery mode {plan.mode!r}")
        self.holdings = target
        return self.dataset.bytes_read - before, time.perf_counter() - t0

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        """Storage indices of record ids (the same records whatever the reload mode stored them in)."""
        starts = np.array([a for a, _ in self.order], dtype=np.int64)
        stops = np.array([b for _, b in self.order], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(stops - starts)[:-1]]).astype(np.int64)
        by_start = np.argsort(starts)
        ids = np.asarray(ids, dtype=np.int64)
        i = by_start[np.searchsorted(starts[by_start], ids, side="right") - 1] if len(starts) else by_start
        if len(ids) and (len(starts) == 0 or np.any(ids >= stops[i]) or np.any(ids < starts[i])):
            raise ValueError(f"records {sorted(set(ids.tolist()) - set(self.ids().tolist()))[:5]} are not in this shard")
        return offsets[i] + ids - starts[i]

    def ids(self) -> np.ndarray:
        """Every held record id, in storage order."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.order] or [np.empty(0, np.int64)])
