"""The checkpoint files: write a temporary file, fsync, rename, then move `latest` the same way; read with fallback.

The file format
===============

``ckpt-<step, 6 digits>.pt`` in the checkpoint directory::

    offset 0        8 bytes        magic b"ULFMCKPT"
    offset 8        uint32 LE      H = length of the JSON header in bytes
    offset 12       H bytes        JSON header (utf-8)
    offset 12 + H   uint32 LE      crc32 (zlib) of the H header bytes
    then            the sections named in the header, back to back

The first four rows are the framing shared with dataset files
(:mod:`ulfmtrain.core.framing`).

The header records the step, epoch, sampler position, world size, steps per
epoch, the model's tensor names/shapes/dtypes, and each section's length; its
``crc32`` field is the checksum of all section bytes.  The sections are
``replica`` (the job's named state, ``JobState.payload()``: model, optimizer state,
step and registered extra state such as the sampler position) and ``rng``
(the Python, NumPy and torch generator states), both written by torch.save
and read by torch.load(weights_only=True): a checkpoint holds data, never
code (training/serialize.py).  Version 1 pickled the ``rng`` section.

``latest`` is a small JSON file naming the newest committed checkpoint.  Both
are written as: temporary file in the same directory -> fsync -> rename ->
fsync of the directory, so a reader sees the old file or the new one, never a
part of one.  Only rank 0 writes; every rank gets the state from rank 0 on
restore.
"""
from __future__ import annotations

import json
import re
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.atomic import atomic_file
from ..core.framing import FrameError, pack_frame, unpack_frame

__all__ = [
    "MAGIC", "FORMAT", "FORMAT_VERSION", "LATEST", "Warn", "CheckpointError", "Snapshot", "Checkpoint",
    "checkpoint_name", "model_signature", "write_checkpoint", "prune", "remove_stale_temporaries",
    "read_checkpoint", "list_checkpoints", "read_pointer", "has_checkpoint", "load_latest", "check_model",
]

MAGIC = b"ULFMCKPT"
FORMAT = "ulfmtrain-checkpoint"
FORMAT_VERSION = 2
LATEST = "latest"
OWNER = "owner"     # the number of the supervise attempt that may write here (claim)
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP_PREFIX = ".tmp-"

Warn = Callable[[str], None]


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, corrupt, or from a different model."""


def stderr_warn(msg: str) -> None:
    print(f"ulfmtrain: warning: {msg}", file=sys.stderr, flush=True)


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` committed steps."""
    return f"ckpt-{step:06d}.pt"


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m[1]) if m else None


def model_signature(model: Any) -> list[list]:
    """Name, shape and dtype of every tensor in the model's state_dict."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in model.state_dict().items()]


@dataclass
class Snapshot:
    """Everything a checkpoint holds, captured at a step boundary (immutable bytes: training cannot change it)."""

    step: int
    epoch: int
    records_done: int          # records committed so far in this epoch, over all ranks
    world_size: int
    model: list[list]
    sections: dict[str, bytes]
    initial: bool = False

    def header(self) -> dict[str, Any]:
        crc = 0
        for blob in self.sections.values():
            crc = zlib.crc32(blob, crc)
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "step": self.step, "epoch": self.epoch,
            "records_done": self.records_done, "world_size": self.world_size, "model": self.model,
            "sections": [{"name": k, "bytes": len(v)} for k, v in self.sections.items()],
            "crc32": crc, "created": time.time(),
        }

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.sections.values())


# --------------------------------------------------------------------------- write


def write_checkpoint(directory: str | Path, snap: Snapshot, *,
                     fault_point: Callable[[int, str], None] | None = None) -> Path:
    """Write snap atomically as DIR/ckpt-<step>.pt, then point DIR/latest at it; return the path.

    If anything fails (or the process dies) before the rename, the previous
    checkpoint and the latest pointer are untouched; a failed write removes
    its temporary file.
    """
    directory = Path(directory)
    name = checkpoint_name(snap.step)
    head = json.dumps(snap.header(), separators=(",", ":")).encode()
    with atomic_file(directory / name, prefix=f"{_TMP_PREFIX}{name}.") as f:
        f.write(pack_frame(MAGIC, head))
        for i, blob in enumerate(snap.sections.values()):
            if i == 0 and fault_point is not None:
                # Fault injection: a SIGKILL here leaves a half-written temporary file.
                half = len(blob) // 2
                f.write(memoryview(blob)[:half])
                f.flush()
                fault_point(snap.step, "checkpoint")
                f.write(memoryview(blob)[half:])
            else:
                f.write(blob)
    _write_pointer(directory, name, snap.step)
    return directory / name


def _write_pointer(directory: Path, name: str, step: int) -> None:
    with atomic_file(directory / LATEST, "w", prefix=f"{_TMP_PREFIX}{LATEST}.") as f:
        json.dump({"file": name, "step": step}, f)


def prune(directory: str | Path, committed_step: int, keep: int) -> list[Path]:
    """Delete checkpoints older than the `keep` newest at or below committed_step; return what was deleted.

    Files newer than the committed one (left by an earlier attempt) are kept:
    they are replaced when training reaches their step again.
    """
    files = sorted(((s, p) for p in Path(directory).iterdir()
                    if (s := _step_of(p)) is not None and s <= committed_step), reverse=True)
    return _unlink_all(p for _, p in files[max(1, keep):])


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete temporary files left by a writer that died; return them."""
    return _unlink_all(Path(directory).glob(f"{_TMP_PREFIX}*"))


def _unlink_all(paths: Iterable[Path]) -> list[Path]:
    gone = []
    for p in paths:
        try:
            p.unlink()
            gone.append(p)
        except FileNotFoundError:   # another rank or attempt removed it first
            pass
    return gone


# --------------------------------------------------------------------------- read


@dataclass
class Checkpoint:
    """A checkpoint read from disk whose checksums matched."""

    path: Path
    header: dict[str, Any]
    sections: dict[str, bytes]

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.sections.values())


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint file (magic, header checksum, length, payload checksum)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' is missing") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint '{path}' cannot be read ({exc.strerror})") from None
    if not raw:
        raise CheckpointError(f"checkpoint '{path}' is truncated (empty)")
    try:
        head, start = unpack_frame(lambda offset, n: raw[offset:offset + n], len(raw), MAGIC)
    except FrameError as exc:
        what = {"magic": "is not a ulfmtrain checkpoint (bad magic)",
                "truncated": f"is truncated ({exc.found} bytes, the header alone needs {exc.needed})",
                "checksum": "is corrupt (header checksum mismatch)"}[exc.problem]
        raise CheckpointError(f"checkpoint '{path}' {what}") from None
    try:
        header = json.loads(head)
        if header.get("format") == FORMAT and header.get("version") == 1:
            raise CheckpointError(f"checkpoint '{path}' is of format 1, which pickles its random state (a load "
                                  "could run code): resume it with the ulfmtrain that wrote it, or start a fresh "
                                  "--ckpt-dir")
        if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {header.get('format')!r} version {header.get('version')!r}")
        lengths = [(s["name"], int(s["bytes"])) for s in header["sections"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable header ({exc})") from None
    end = start + sum(n for _, n in lengths)
    if len(raw) < end:
        raise CheckpointError(f"checkpoint '{path}' is truncated ({len(raw)} of {end} bytes)")
    if len(raw) > end:
        raise CheckpointError(f"checkpoint '{path}' is corrupt ({len(raw) - end} bytes of trailing data)")
    view = memoryview(raw)
    if zlib.crc32(view[start:end]) != header["crc32"]:
        raise CheckpointError(f"checkpoint '{path}' is corrupt (checksum mismatch)")
    sections, pos = {}, start
    for name, n in lengths:
        sections[name] = bytes(view[pos:pos + n])
        pos += n
    return Checkpoint(path, header, sections)


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in directory, newest first."""
    return sorted(((s, p) for p in Path(directory).iterdir() if (s := _step_of(p)) is not None), reverse=True)


def read_pointer(directory: str | Path) -> dict[str, Any] | None:
    """The latest pointer's contents, or None when there is none (or it is unreadable)."""
    try:
        d = json.loads((Path(directory) / LATEST).read_text())
        return d if isinstance(d, dict) and isinstance(d.get("file"), str) else None
    except (OSError, ValueError):
        return None


def read_owner(directory: str | Path) -> int | None:
    """The attempt that owns directory (claim), or None when no supervisor claimed it."""
    try:
        return int((Path(directory) / OWNER).read_text())
    except (OSError, ValueError):
        return None


def claim(directory: str | Path) -> int:
    """Make the next attempt the directory's only writer, and return its number (supervise, before a launch).

    A rank of an earlier attempt can outlive its mpirun (when a host is lost, the teardown takes seconds) and go
    on checkpointing while the next attempt reads the directory: its writer sees the newer number and stops.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    number = (read_owner(d) or 0) + 1
    with atomic_file(d / OWNER, "w") as f:
        f.write(str(number))
    return number


def has_checkpoint(directory: str | Path) -> bool:
    """True when directory has a latest pointer or any checkpoint file."""
    d = Path(directory)
    return d.is_dir() and (read_pointer(d) is not None or bool(list_checkpoints(d)))


def load_latest(directory: str | Path, warn: Warn = stderr_warn) -> Checkpoint:
    """Load the checkpoint `latest` names; if it is bad, warn and fall back to the newest older good one."""
    d = Path(directory)
    if not d.exists():
        raise CheckpointError(f"checkpoint directory '{d}' does not exist: check --ckpt-dir, "
                              "or start without --resume to train from scratch")
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory '{d}' is a file: pass a directory to --ckpt-dir")
    pointer = read_pointer(d)
    files = list_checkpoints(d)
    if pointer is None and not files:
        raise CheckpointError(f"no checkpoint in '{d}' (no '{LATEST}' pointer, no ckpt-*.pt files): "
                              "start without --resume to train from scratch")
    candidates: list[Path] = []
    if pointer is not None:
        head = d / Path(pointer["file"]).name
        candidates.append(head)
        # Files newer than the pointer were never committed: skip them.
        limit = _step_of(head)
        candidates += [p for s, p in files if p != head and (limit is None or s < limit)]
    else:
        warn(f"checkpoint directory '{d}' has no readable '{LATEST}' pointer; using the newest good checkpoint file")
        candidates = [p for _, p in files]
    problems: list[str] = []
    for p in candidates:
        try:
            ck = read_checkpoint(p)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            warn(f"{problems[0]}; using the previous good checkpoint '{ck.path}'"
                 + (f" ({len(problems) - 1} more bad)" if len(problems) > 1 else ""))
        return ck
    raise CheckpointError(f"no good checkpoint in '{d}': " + "; ".join(problems)
                          + ": restore the directory from a backup, or start without --resume to train from scratch")


def check_model(ck: Checkpoint, model: Any) -> None:
    """Raise CheckpointError unless the checkpoint was saved from a model with the same tensors."""
    there = [tuple(map(str, e)) for e in ck.header["model"]]
    here = [tuple(map(str, e)) for e in model_signature(model)]
    if there == here:
        return
    names_there, names_here = {e[0]: e for e in there}, {e[0]: e for e in here}
    for name, e in names_here.items():
        if name not in names_there:
            detail = f"this model has tensor {name!r}, the checkpoint does not"
            break
        if names_there[name] != e:
            t = names_there[name]
            detail = f"{name} is {t[1]} {t[2]} there, {e[1]} {e[2]} here"
            break
    else:
        extra = next(n for n in names_there if n not in names_here)
        detail = f"the checkpoint has tensor {extra!r}, this model does not"
    raise CheckpointError(f"checkpoint '{ck.path}' was saved from a different model ({detail}): "
                          "resume with the --model it was trained with, or start a fresh --ckpt-dir")

