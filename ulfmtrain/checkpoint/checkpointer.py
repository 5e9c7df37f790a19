"""The trainer's checkpointer: when to save, blocking or overlapped, and the restore on resume.

It sees the training only through :class:`TrainingState`, so anything that
implements that protocol (the Trainer, a test double) can be checkpointed.
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..core.modes import CheckpointStrategy, Phase, parse
from ..training import serialize
from ..transport import faults
from .format import (
    Checkpoint,
    CheckpointError,
    Snapshot,
    Warn,
    check_model,
    has_checkpoint,
    load_latest,
    model_signature,
    prune,
    read_owner,
    read_pointer,
    remove_stale_temporaries,
    stderr_warn,
    write_checkpoint,
)
from .writer import OverlappedWriter, WriteResult

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointComm", "TrainingState", "Checkpointer", "capture", "rng_state",
           "set_rng_state"]


T = TypeVar("T")


class CheckpointComm(Protocol):
    """The slice of FaultTolerantComm (or PlainComm) a Checkpointer uses."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def bcast_obj(self, make: Callable[[], T]) -> T:
        """Return make() as run by the lowest rank, on every rank (retried there if a rank dies)."""
        ...

    def agree(self, flag: int) -> int:
        """Return the AND of every rank's flag, uniformly (repairing the world if a rank died)."""
        ...

    saving: bool   # inside a save: a spare that takes a slot in a repair of it joins its next round


class TrainingState(Protocol):
    """What a Checkpointer saves and restores, and what tells it when (the Trainer implements it)."""

    @property
    def comm(self) -> CheckpointComm:
        """The ranks: the lowest writes, every one restores alike."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The model, whose tensor names, shapes and dtypes a restore checks against the checkpoint."""
        ...

    @property
    def step(self) -> int:
        """Committed steps."""
        ...

    @property
    def epoch(self) -> int:
        """The current epoch."""
        ...

    @property
    def records_done(self) -> int:
        """Records committed so far in this epoch, over all ranks."""
        ...

    @property
    def epoch_ended(self) -> bool:
        """Whether the last committed step closed an epoch."""
        ...

    def replica_state(self) -> bytes:
        """Serialize the replicated state: model, optimizer, step and sampler (the same on every rank)."""
        ...

    def load_replica_state(self, blob: bytes) -> None:
        """Take a state made by replica_state(), possibly in another world size."""
        ...

    def log(self, event: str, **fields: Any) -> None:
        """Record a metrics event."""
        ...


def rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch generator states of this process (CUDA's too, when it is in use)."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states taken by rng_state()."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # A checkpoint from a host with more GPUs: set those this process has.
        cuda = state["cuda"][:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def capture(state: TrainingState) -> Snapshot:
    """Snapshot the replicated training state and this process's RNGs."""
    return Snapshot(
        step=state.step, epoch=state.epoch, records_done=state.records_done, world_size=state.comm.size,
        model=model_signature(state.model),
        sections={"replica": state.replica_state(), "rng": serialize.dumps(rng_state())})


def check_safe(ck: Checkpoint) -> None:
    """CheckpointError unless every section loads as data only: a checkpoint directory someone else can write
    must not run code as the user who resumes from it (serialize.py)."""
    for name, blob in ck.sections.items():
        try:
            serialize.loads(blob)
        except serialize.UnsafeState as exc:
            raise CheckpointError(f"checkpoint '{ck.path}' is refused: its {name} section holds what a safe load "
                                  f"refuses ({exc}); ulfmtrain writes no such thing, so the file was changed "
                                  "(its checksum proves no more than the writer's care): restore the directory "
                                  "from a copy you trust, or start without --resume") from None


def _job_id() -> str:
    """This mpirun job's name (the same on every rank and spare of it), or '' outside mpirun."""
    return os.environ.get("PMIX_NAMESPACE", "")


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
                 resume: bool = False, warn: Warn = stderr_warn) -> None:
        strategy = parse(CheckpointStrategy, strategy, "checkpoint strategy")
        if every < 0:
            raise ValueError(f"--ckpt-every must be 0 (off) or a positive number of steps, got {every}")
        if keep < 2:
            raise ValueError(f"--ckpt-keep must be at least 2 (the previous good checkpoint is kept), got {keep}")
        self.directory = Path(directory)
        self.every, self.epoch, self.strategy = every, epoch, strategy
        self.max_inflight, self.keep, self.resume = max_inflight, keep, resume
        self._warn_out = warn
        self._state: TrainingState | None = None    # set by begin()
        self._writer: OverlappedWriter | None = None
        self._requested = False
        self._owner: int | None = None   # the supervise attempt this job is (read_owner at begin)
        self.saves = 0

    # -- plumbing --------------------------------------------------------
    @property
    def _training(self) -> TrainingState:
        if self._state is None:
            raise RuntimeError("Checkpointer.begin() was not called")
        return self._state

    @property
    def _root(self) -> bool:
        return self._training.comm.rank == 0

    def _log(self, event: str, **fields: Any) -> None:
        self._training.log(event, **fields)

    def _warn(self, msg: str) -> None:
        self._warn_out(msg)
        if self._state is not None:
            self._log("checkpoint_warning", message=msg)

    def _write(self, snap: Snapshot) -> WriteResult:
        """Write one snapshot durably and prune old ones (rank 0; main thread or writer thread)."""
        t0 = time.perf_counter()
        owner = read_owner(self.directory)
        if owner != self._owner:
            return WriteResult(snap.step, None, 0.0, snap.nbytes, time.time(),
                               error=f"attempt {owner} of `ulfmtrain supervise` writes there now, not this "
                                     f"one ({self._owner})")
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
                kept = (f"the latest good one stays '{self.directory / ptr['file']}'" if ptr
                        else "there is no good one yet")
                self._warn(f"checkpoint of step {r.step} was not written ({r.error}); {kept}")
            else:
                self._log("checkpoint_written", step=r.step, file=r.path, write_ms=r.write_ms, bytes=r.nbytes,
                          t_done=r.t_done, strategy=self.strategy, pruned=r.pruned)

    # -- the trainer's hooks ---------------------------------------------
    def begin(self, state: TrainingState, joining: bool = False) -> bool:
        """At the start of fit(): restore (and return True), or write the step-0 checkpoint (and return False).

        joining: this process takes a slot of a running job (a spare, or a respawned process) with the
        survivors' live state; it joins their saves from the next one (the start's are collectives it would
        run alone).
        """
        self._state = state
        self._owner = read_owner(self.directory)
        if joining:
            return False
        if self.resume:
            self._restore()
            return True
        # Decided on the lowest rank and broadcast, so that every rank stops alike.
        problem = state.comm.bcast_obj(self._check_directory)
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
            ptr = read_pointer(self.directory) if has_checkpoint(self.directory) else None
            if ptr is not None and ptr["step"] == 0 and _job_id() and self._marker().is_file() \
                    and self._marker().read_text() == _job_id():
                pass    # this job's own step-0 checkpoint: a death at start-up started the start-up over
            elif has_checkpoint(self.directory):
                what = f"step {ptr['step']}" if ptr else "old checkpoint files"
                problem = (f"checkpoint directory '{self.directory}' already holds checkpoints ({what}) and "
                           "this run does not resume: pass --resume to continue from them, or use an empty --ckpt-dir")
            else:
                remove_stale_temporaries(self.directory)
                if _job_id():
                    self._marker().write_text(_job_id())
        except OSError as exc:
            problem = (f"checkpoint directory '{self.directory}' cannot be created ({exc.strerror}): "
                       "pass a writable --ckpt-dir")
        return problem

    def _marker(self) -> Path:
        """Which job started training in this directory (a start-up that starts over finds its own step 0)."""
        return self.directory / ".started-by"

    def after_step(self, state: TrainingState) -> None:
        """At a step boundary: save if K steps have passed or an epoch ended (the same on every rank)."""
        step = state.step
        due = (self.every > 0 and step % self.every == 0) or (self.epoch and state.epoch_ended)
        if due or self._requested:
            self._save()
        if self._requested:
            self._requested = False
            self.close()       # durable before what asked for it goes on

    def request(self) -> None:
        """Save at the next step boundary, durably, whatever the cadence (respawn asks before every join)."""
        self._requested = True

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
                               "step": self._training.step}
        comm = self._training.comm
        comm.saving = True
        try:
            ok = self._save_rounds(comm, blocking, initial, rec, t0)
        finally:
            comm.saving = False
        rec["stall_ms"] = (time.perf_counter() - t0) * 1e3
        rec["ok"] = ok
        self.saves += 1
        self._log("checkpoint", **rec)

    def join_save(self) -> None:
        """A spare that took a slot inside the survivors' blocking save (its writer died, say): it joins the save's
        next round, in which the lowest rank writes it again."""
        self._save()

    def _save_rounds(self, comm: CheckpointComm, blocking: bool, initial: bool, rec: dict[str, Any],
                     t0: float) -> bool:
        """Write (the lowest rank) and agree, again after every repair in the agree; the agreed verdict."""
        while True:
            repairs, ok = len(getattr(comm, "events", ())), True
            if self._root:
                snap = capture(self._training)
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
                return ok
            # The barrier of the blocking strategy, and its uniform verdict.  A
            # rank that dies meanwhile (the writer, say) is repaired here, and
            # the new lowest rank writes the same checkpoint again, with the
            # spare that took a slot in that repair, if any (join_save).
            ok = bool(comm.agree(1 if ok else 0))
            if len(getattr(comm, "events", ())) == repairs:
                return ok
            rec["rewritten"] = True

    def _load_for_restore(self) -> tuple:
        """On the lowest rank: the latest good checkpoint, or the error every rank will raise."""
        try:
            if self.directory.is_dir():
                remove_stale_temporaries(self.directory)   # left by a writer that was killed
            ck = load_latest(self.directory, warn=self._warn)
            check_safe(ck)
            check_model(ck, self._training.model)
            return ("ok", str(ck.path), ck.header, ck.sections)
        except CheckpointError as exc:
            return ("error", str(exc))

    def _restore(self) -> None:
        state = self._training
        t0 = time.perf_counter()
        faults.point(state.step, Phase.INIT)     # a resume's initial state is the restore
        # Re-read by whichever rank is lowest when the broadcast is (re)tried.
        msg = state.comm.bcast_obj(self._load_for_restore)
        if msg[0] == "error":
            raise CheckpointError(msg[1])
        _, path, header, sections = msg
        state.load_replica_state(sections["replica"])   # the sampler state re-plans itself for this world
        set_rng_state(serialize.loads(sections["rng"]))
        sampler = getattr(state, "sampler", None)
        # What the audit needs to count the records committed before the checkpoint as seen (audit.py).
        left = {} if sampler is None else {
            "resumed_epoch": sampler.epoch,
            "remaining": int(sum(len(q) - sampler.cursors[w] for w, q in sampler.queues.items()))}
        self._log("resume", file=Path(path).name, step=header["step"], epoch=header["epoch"], **left,
                  ckpt_world=header["world_size"], world=state.comm.size,
                  remapped=header["world_size"] != state.comm.size,
                  bytes=sum(len(v) for v in sections.values()), load_ms=(time.perf_counter() - t0) * 1e3)
