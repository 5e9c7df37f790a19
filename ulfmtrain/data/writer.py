"""Write ``.ulfmds`` files atomically, in bounded memory (the layout is specified in :mod:`.format`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..core.atomic import atomic_file
from ..core.framing import pack_frame
from .format import (
    BLOCK_BYTES,
    FORMAT_VERSION,
    MAGIC,
    DatasetError,
    FieldSpec,
    layout,
    normalize_dtype,
    record_crcs,
    record_dtype,
)

__all__ = ["write_dataset_chunks", "write_dataset"]


def _pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    """Write all of ``buf`` at ``offset``, looping over short writes."""
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


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
        specs.append((name, normalize_dtype(dtype, f"field '{name}'"), shape_t))
    if not specs:
        raise DatasetError(f"cannot write dataset '{path}': no fields given; pass at least one array")
    rec_dtype = record_dtype(specs)
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
        raw_header, crc_offset, data_offset = layout(header, count)
    except (TypeError, ValueError) as exc:
        raise DatasetError(
            f"cannot write dataset '{path}': meta is not JSON-serialisable ({exc}); "
            "pass plain str/number/list/dict values"
        ) from None

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fd = tmp.fileno()
        _pwrite_all(fd, pack_frame(MAGIC, raw_header), 0)
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
            step = max(1, BLOCK_BYTES // record_size)
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
                crcs[written : written + hi - lo] = record_crcs(raw, record_size)
                _pwrite_all(fd, raw.data, data_offset + written * record_size)
                written += hi - lo
        if written != count:
            raise DatasetError(
                f"cannot write dataset '{path}': chunks held {written} records, expected {count}; fix count"
            )
        _pwrite_all(fd, crcs.view(np.uint8).data, crc_offset)
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
    fields = [(name, normalize_dtype(a.dtype, f"array '{name}'"), a.shape[1:]) for name, a in arrs.items()]
    write_dataset_chunks(path, fields, count, [arrs], meta)
