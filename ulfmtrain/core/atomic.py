"""Atomic file replacement: a reader sees the old file or the new one, never half of one."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(directory: Path) -> None:
    """Persist a rename in directory where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", prefix: str | None = None) -> Iterator[IO]:
    """Yield a temporary file beside path; on success fsync it, rename it over path and fsync the directory.

    If the block raises (or the process dies), path keeps its old content and
    the temporary file is removed (or left with a name readers ignore).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json(path: str | Path, obj: Any, **dumps: Any) -> None:
    """Write obj as indented JSON with atomic_file (dumps: extra json.dump arguments, e.g. default)."""
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=1, **dumps)
