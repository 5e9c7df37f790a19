"""Checkpoints that never corrupt: write a temporary file, fsync, rename, then move `latest` the same way.

The file format
===============

``ckpt-<step, 6 digits>.pt`` in the checkpoint directory::

    offset 0        8 bytes        magic b"ULFMCKPT"
    offset 8        uint32 LE      H = length of the JSON header in bytes
    offset 12       H bytes        JSON header (utf-8)
    offset 12 + H   uint32 LE      crc32 (zlib) of the H header bytes
    then            the sections named in the header, back to back

The header records the step, epoch, sampler position, world size, steps per
epoch, the model's tensor names/shapes/dtypes, and each section's length; its
``crc32`` field is the checksum of all section bytes.  The sections are
``replica`` (``DistributedOptimizer.get_state()``: model, optimizer state,
step and registered extra state such as the sampler position) and ``rng``
(the Python, NumPy and torch generator states, pickled).

``latest`` is a small JSON file naming the newest committed checkpoint.  Both
are written as: temporary file in the same directory -> fsync -> rename ->
fsync of the directory, so a reader sees the old file or the new one, never a
part of one.  Only rank 0 writes; every rank gets the state from rank 0 on
restore.
"""
from __future__ import annotations

import json
import pickle
import queue
import random
import re
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import faults
from .atomic import atomic_file

MAGIC = b"ULFMCKPT"
FORMAT = "ulfmtrain-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
STRATEGIES = ("blocking", "overlapped")
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP_PREFIX = ".tmp-"
_PREAMBLE = struct.Struct("<8sI")
_U32 = struct.Struct("<I")

Warn = Callable[[str], None]


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, corrupt, or from a different model."""


def _stderr_warn(msg: str) -> None:
    print(f"ulfmtrain: warning: {msg}", file=sys.stderr, flush=True)


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` committed steps."""
    return f"ckpt-{step:06d}.pt"


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m[1]) if m else None


# --------------------------------------------------------------------------- state capture


def model_signature(model: Any) -> list[list]:
    """Name, shape and dtype of every tensor in the model's state_dict."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in model.state_dict().items()]


def rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch (CPU) generator states of this process."""
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states taken by rng_state()."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


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


def capture(trainer: Any) -> Snapshot:
    """Snapshot the trainer's replicated state (reusing DistributedOptimizer.get_state()) and this process's RNGs."""
    return Snapshot(
        step=trainer.opt.step_count, epoch=trainer.sampler.epoch,
        records_done=int(sum(trainer.sampler.cursors.values())), world_size=trainer.comm.size,
        model=model_signature(trainer.model),
        sections={"replica": trainer.opt.get_state(), "rng": pickle.dumps(rng_state(), protocol=5)})


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
        f.write(_PREAMBLE.pack(MAGIC, len(head)) + head + _U32.pack(zlib.crc32(head)))
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
    if len(raw) < _PREAMBLE.size or raw[:8] != MAGIC:
        what = "is truncated (empty)" if not raw else "is not a ulfmtrain checkpoint (bad magic)"
        raise CheckpointError(f"checkpoint '{path}' {what}")
    (hlen,) = _U32.unpack_from(raw, 8)
    start = _PREAMBLE.size + hlen + _U32.size
    if len(raw) < start:
        raise CheckpointError(f"checkpoint '{path}' is truncated ({len(raw)} bytes, the header alone needs {start})")
    head = raw[_PREAMBLE.size:_PREAMBLE.size + hlen]
    (hcrc,) = _U32.unpack_from(raw, _PREAMBLE.size + hlen)
    if zlib.crc32(head) != hcrc:
        raise CheckpointError(f"checkpoint '{path}' is corrupt (header checksum mismatch)")
    try:
        header = json.loads(head)
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


def has_checkpoint(directory: str | Path) -> bool:
    """True when directory has a latest pointer or any checkpoint file."""
    d = Path(directory)
    return d.is_dir() and (read_pointer(d) is not None or bool(list_checkpoints(d)))


def load_latest(directory: str | Path, warn: Warn = _stderr_warn) -> Checkpoint:
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


# --------------------------------------------------------------------------- background writer


@dataclass
class WriteResult:
    """The outcome of one checkpoint write."""

    step: int
    path: str | None
    write_ms: float
    nbytes: int
    t_done: float
    error: str | None = None
    pruned: list[str] = field(default_factory=list)


class OverlappedWriter:
    """Persist snapshots on a background thread with at most `max_inflight` not yet durable.

    submit() blocks only when that many writes are already in flight: that
    wait is the whole stall training sees beyond the snapshot itself.
    """

    def __init__(self, write: Callable[[Snapshot], WriteResult], max_inflight: int = 2) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self._write = write
        self._slots = threading.Semaphore(max_inflight)
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._done: list[WriteResult] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ulfmtrain-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> float:
        """Queue snap; return the milliseconds spent waiting for a free slot."""
        t0 = time.perf_counter()
        self._slots.acquire()
        self._queue.put(snap)
        return (time.perf_counter() - t0) * 1e3

    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            if snap is None:
                return
            try:
                res = self._write(snap)
            finally:
                self._slots.release()
            with self._lock:
                self._done.append(res)

    def finished(self) -> list[WriteResult]:
        """Results of the writes completed since the last call."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def close(self) -> list[WriteResult]:
        """Wait for every queued write; return the results not yet collected."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        return self.finished()


# --------------------------------------------------------------------------- the trainer's checkpointer


class Checkpointer:
    """Save at step boundaries (every K steps and/or every epoch) and restore on resume.

    Args:
        directory: where checkpoints and the latest pointer live (shared by
            the ranks' restarts; only rank 0 writes).
        every: checkpoint after every `every` committed steps (0: never).
        epoch: checkpoint at the end of every epoch.
        strategy: "blocking" (every rank waits while rank 0 writes) or
            "overlapped" (rank 0 snapshots, a background thread writes).
        max_inflight: overlapped writes not yet durable before training waits.
        keep: checkpoints kept on disk (at least 2, so a good one survives a bad write).
        resume: restore the latest good checkpoint at the start of fit().
    """

    def __init__(self, directory: str | Path, *, every: int = 0, epoch: bool = False,
                 strategy: str = "blocking", max_inflight: int = 2, keep: int = 3,
                 resume: bool = False, warn: Warn = _stderr_warn) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown checkpoint strategy {strategy!r}: use blocking or overlapped")
        if every < 0:
            raise ValueError(f"--ckpt-every must be 0 (off) or a positive number of steps, got {every}")
        if keep < 2:
            raise ValueError(f"--ckpt-keep must be at least 2 (the previous good checkpoint is kept), got {keep}")
        self.directory = Path(directory)
        self.every, self.epoch, self.strategy = every, epoch, strategy
        self.max_inflight, self.keep, self.resume = max_inflight, keep, resume
        self._warn_out = warn
        self._trainer: Any = None
        self._writer: OverlappedWriter | None = None
        self.saves = 0

    # -- plumbing --------------------------------------------------------
    @property
    def _root(self) -> bool:
        return self._trainer.comm.rank == 0

    def _log(self, event: str, **fields: Any) -> None:
        self._trainer.log(event, **fields)

    def _warn(self, msg: str) -> None:
        self._warn_out(msg)
        if self._trainer is not None:
            self._log("checkpoint_warning", message=msg)


    def _write(self, snap: Snapshot) -> WriteResult:
        """Write one snapshot durably and prune old ones (rank 0; main thread or writer thread)."""
        t0 = time.perf_counter()
        try:
            path = write_checkpoint(self.directory, snap, fault_point=faults.point)
            pruned = prune(self.directory, snap.step, self.keep)
        except Exception as exc:   # e.g. a full disk: report it, keep training on the previous good one
            return WriteResult(snap.step, None, (time.perf_counter() - t0) * 1e3, snap.nbytes, time.time(),
                               error=f"{type(exc).__name__}: {exc}")
        return WriteResult(snap.step, path.name, (time.perf_counter() - t0) * 1e3, snap.nbytes, time.time(),
                           pruned=[p.name for p in pruned])

    def _report(self, results: Iterable[WriteResult]) -> None:
        for r in results:
            if r.error:
                ptr = read_pointer(self.directory)
                kept = f"the latest good one stays '{self.directory / ptr['file']}'" if ptr else "there is no good one yet"
                self._warn(f"checkpoint of step {r.step} was not written ({r.error}); {kept}")
            else:
                self._log("checkpoint_written", step=r.step, file=r.path, write_ms=r.write_ms, bytes=r.nbytes,
                          t_done=r.t_done, strategy=self.strategy, pruned=r.pruned)

    # -- the trainer's hooks ---------------------------------------------
    def begin(self, trainer: Any) -> bool:
        """At the start of fit(): restore (and return True), or write the step-0 checkpoint (and return False)."""
        self._trainer = trainer
        if self.resume:
            self._restore()
            return True
        # Decided on the lowest rank and broadcast, so that every rank stops alike.
        problem = trainer.comm.bcast_obj(self._check_directory)
        if problem:
            raise CheckpointError(problem)
        # A step-0 checkpoint, always blocking: a rollback then always has a
        # target, even when the first failure comes before the first period.
        self._save(initial=True)
        return False

    def _check_directory(self) -> str | None:
        """Why this run cannot write its checkpoints here (None: it can)."""
        problem = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if has_checkpoint(self.directory):
                ptr = read_pointer(self.directory)
                what = f"step {ptr['step']}" if ptr else "old checkpoint files"
                problem = (f"checkpoint directory '{self.directory}' already holds checkpoints ({what}) and "
                           "this run does not resume: pass --resume to continue from them, or use an empty --ckpt-dir")
            else:
                remove_stale_temporaries(self.directory)
        except OSError as exc:
            problem = (f"checkpoint directory '{self.directory}' cannot be created ({exc.strerror}): "
                       "pass a writable --ckpt-dir")
        return problem

    def after_step(self, trainer: Any) -> None:
        """At a step boundary: save if K steps have passed or an epoch ended (the same on every rank)."""
        step = trainer.opt.step_count
        due = (self.every > 0 and step % self.every == 0) or (self.epoch and trainer.epoch_ended)
        if due:
            self._save()

    def close(self) -> None:
        """Wait for the checkpoints in flight (training's end, or before a rollback)."""
        if self._writer is not None:
            self._report(self._writer.close())
            self._writer = None

    # -- save and restore ------------------------------------------------
    def _save(self, initial: bool = False) -> None:
        t0 = time.perf_counter()
        blocking = initial or self.strategy == "blocking"
        rec: dict[str, Any] = {"strategy": "blocking" if blocking else self.strategy, "initial": initial,
                               "step": self._trainer.opt.step_count}
        comm = self._trainer.comm
        while True:
            size, ok = comm.size, True
            if self._root:
                snap = capture(self._trainer)
                snap.initial = initial
                rec.update(bytes=snap.nbytes, snapshot_ms=(time.perf_counter() - t0) * 1e3)
                if blocking:
                    res = self._write(snap)
                    rec["write_ms"] = res.write_ms
                    ok = res.error is None
                    self._report([res])
                else:
                    if self._writer is None:
                        self._writer = OverlappedWriter(self._write, self.max_inflight)
                    self._report(self._writer.finished())
                    rec["queue_ms"] = self._writer.submit(snap)
            if not blocking:
                break
            # The barrier of the blocking strategy, and its uniform verdict.  A
            # rank that dies meanwhile (the writer, say) is repaired here, and
            # the new lowest survivor writes the same checkpoint again.
            ok = bool(comm.agree(1 if ok else 0))
            if comm.size == size:
                break
            rec["rewritten"] = True
        rec["stall_ms"] = (time.perf_counter() - t0) * 1e3
        rec["ok"] = ok
        self.saves += 1
        self._log("checkpoint", **rec)

    def _load_for_restore(self) -> tuple:
        """On the lowest rank: the latest good checkpoint, or the error every rank will raise."""
        try:
            if self.directory.is_dir():
                remove_stale_temporaries(self.directory)   # left by a writer that was killed
            ck = load_latest(self.directory, warn=self._warn)
            check_model(ck, self._trainer.model)
            return ("ok", str(ck.path), ck.header, ck.sections)
        except CheckpointError as exc:
            return ("error", str(exc))

    def _restore(self) -> None:
        tr = self._trainer
        t0 = time.perf_counter()
        # Re-read by whichever rank is lowest when the broadcast is (re)tried.
        msg = tr.comm.bcast_obj(self._load_for_restore)
        if msg[0] == "error":
            raise CheckpointError(msg[1])
        _, path, header, sections = msg
        tr.opt.set_state(sections["replica"])      # the sampler state re-plans itself for this world
        set_rng_state(pickle.loads(sections["rng"]))
        self._log("resume", file=Path(path).name, step=header["step"], epoch=header["epoch"],
                  ckpt_world=header["world_size"], world=tr.comm.size, remapped=header["world_size"] != tr.comm.size,
                  bytes=sum(len(v) for v in sections.values()), load_ms=(time.perf_counter() - t0) * 1e3)


def checkpointer_from_args(args: Any, resume: bool = False) -> Checkpointer | None:
    """Build the train command's Checkpointer from its flags (None without --ckpt-dir)."""
    if not args.ckpt_dir:
        if args.recovery != "shrink":
            raise ValueError(f"--recovery {args.recovery} rolls back to a checkpoint: add --ckpt-dir DIR "
                             "(and --ckpt-every K or --ckpt-epoch)")
        for flag, val in (("--ckpt-every", args.ckpt_every), ("--ckpt-epoch", args.ckpt_epoch),
                          ("--resume", args.resume)):
            if val:
                raise ValueError(f"{flag} needs a checkpoint directory: add --ckpt-dir DIR")
        return None
    for spec in args.kill:
        if spec.endswith(":checkpoint") and not spec.startswith("0@"):
            raise ValueError(f"kill spec {spec!r} never fires: only rank 0 writes checkpoints (use 0@STEP:checkpoint)")
    epoch = args.ckpt_epoch or not args.ckpt_every   # no cadence given: every epoch
    return Checkpointer(args.ckpt_dir, every=args.ckpt_every, epoch=epoch, strategy=args.ckpt_strategy,
                        max_inflight=args.ckpt_inflight, keep=args.ckpt_keep, resume=resume or args.resume)
