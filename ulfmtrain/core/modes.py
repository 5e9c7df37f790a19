"""Every mode and policy, defined once, and `run(job)`: how each recovery mode starts, trains and ends.

The enums are `StrEnum`s: their values are what the command line, the logs
and the checkpoints carry, and they compare equal to those strings.
"""
from __future__ import annotations

import importlib
import math
import sys
import time
import traceback
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:      # light at import: supervise, compare and the parser need only the enums
    from ..training.config import TrainJob
    from ..training.trainer import Trainer
    from ..transport.comm import FaultTolerantComm
    from ..transport.faults import Kill

PROG = "ulfmtrain"


class Recovery(StrEnum):
    """What the job does when a rank dies."""

    SHRINK = "shrink"      # ULFM: the survivors shrink the communicator and train on
    RESTART = "restart"    # plain MPI: the job ends, `supervise` relaunches it from the latest checkpoint
    REINIT = "reinit"      # ULFM: survivors spawn replacements and every rank rolls back to the checkpoint

    @property
    def fault_tolerant(self) -> bool:
        """mpirun gets --with-ft ulfm."""
        return self is not Recovery.RESTART

    @property
    def needs_checkpoints(self) -> bool:
        """The mode rolls back to a checkpoint, so --ckpt-dir is required."""
        return self is not Recovery.SHRINK

    def make_comm(self) -> FaultTolerantComm:
        """This mode's communicator over the job's world."""
        from ..transport.comm import FaultTolerantComm, PlainComm

        if self is Recovery.REINIT:
            from ..membership.reinit import join_world
            return join_world()     # a replacement spawned by a rebuild joins its spawners here
        if self is Recovery.RESTART:
            return PlainComm()      # type: ignore[return-value]  # same interface, failures are fatal
        return FaultTolerantComm()


class Replace(StrEnum):
    """What fills a dead rank's slot once no spare is left (shrink mode)."""

    NONE = "none"          # nothing: the slot stays empty and the survivors train on (shrink)
    RESPAWN = "respawn"    # a process spawned in the background joins at a step boundary (respawn.py)


class Reload(StrEnum):
    """What a survivor reads after a failure."""

    PARTIAL = "partial"    # only its share of the lost records
    FULL = "full"          # its whole new shard again


class DataPolicy(StrEnum):
    """What happens to a dead rank's uncommitted records of the current epoch."""

    EXACTLY_ONCE = "exactly-once"   # handed to the survivors
    LOSSY = "lossy"                 # skipped this epoch (paper 000's Lossy-Forward)


class LrScaling(StrEnum):
    """How the learning rate follows the world size (the global batch) after a shrink or a join."""

    LINEAR = "linear"      # lr x live slots / slots it was set for (Goyal et al.'s linear scaling rule)
    NONE = "none"          # the configured lr at any world size


class LrSchedule(StrEnum):
    """How the learning rate changes from step to step."""

    CONSTANT = "constant"  # --lr throughout (before any world-size scaling)
    COSINE = "cosine"      # torch's CosineAnnealingLR from --lr to 0 over the failure-free run's steps


class CheckpointStrategy(StrEnum):
    """How rank 0 writes a checkpoint."""

    BLOCKING = "blocking"       # every rank waits while it writes
    OVERLAPPED = "overlapped"   # it snapshots; a background thread writes


class Device(StrEnum):
    """Where each rank trains."""

    CPU = "cpu"
    CUDA = "cuda"      # cuda:(local rank % GPUs on the host); several ranks may share one GPU
    AUTO = "auto"      # CUDA when torch sees a GPU, else CPU


class Phase(StrEnum):
    """Program points where a kill schedule can fire (faults.point)."""

    INIT = "init"              # before the initial state broadcast (STEP 0)
    FORWARD = "forward"
    BACKWARD = "backward"      # =FRACTION of the way through backward
    ALLREDUCE = "allreduce"    # between two buckets of the reduction (after the sample count, with one bucket)
    ERROR = "error"            # no kill: there, the reduction meets an MPI error with no rank dead (=COUNT attempts)
    COMMIT = "commit"          # right before the commit agree
    DISAGREE = "disagree"      # no kill: this rank's commit agree of STEP returns another code than its peers
    UPDATE = "update"
    RECOVERY = "recovery"      # inside the next repair, after the shrink
    CHECKPOINT = "checkpoint"  # rank 0, half-way through writing the checkpoint of STEP
    FINAL = "final"            # before the final consistency check (any STEP)
    JOIN = "join"              # in the first join of a respawned process at or after STEP, before the merge
    MERGE = "merge"            # the same join, once the survivors agreed to merge: Open MPI 5.0.x never returns
    HANDOVER = "handover"      # the sender of the first hand-over to a spare or newcomer at or after STEP
    READY = "ready"            # the spawning rank SIGKILLs the first respawned process ready at or after STEP
    NEWCOMER = "newcomer"      # the processes RANK respawns at or after STEP raise an error before they are ready


def choices(enum: type[StrEnum]) -> list[str]:
    """The values of an enum, for a parser or an error message."""
    return [m.value for m in enum]


def parse(enum: type[StrEnum], value: str, what: str) -> Any:
    """The member whose value is `value`, or one ValueError line naming the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(choices(enum))}") from None


class UsageError(ValueError):
    """Bad input: reported as one line, exit status 2."""


class _PeerFailed(Exception):
    """Another rank reported the error; this one exits quietly."""


def _build_trainer(job: TrainJob, model: Any, comm: Any, kills: list[Kill], resume: bool) -> Trainer:
    """A trainer over this rank's shard, or every rank stops together (one uniform decision)."""
    from ..data.format import DatasetError
    from ..training.trainer import Trainer

    train_path, test_path = job.dataset_paths()
    error = None
    t_init, t0 = time.time(), time.perf_counter()
    try:
        trainer = Trainer(model, comm, train_path, test_path, job.config, kills, job.out,
                          checkpointer=job.checkpointer(resume))
    except DatasetError as exc:   # e.g. a corrupt record in my shard only
        error = exc
    init_ms = (time.perf_counter() - t0) * 1e3
    # Uniform: either every rank loaded its shard or all stop together, rather than the others
    # "recovering" from the one that exited.  (A spare taking a slot joins training ranks that are past this.)
    if getattr(comm, "takeover", None) is not None:
        if error:
            raise error
    else:
        from ..transport.comm import StartOver
        try:
            loaded = comm.agree(0 if error else 1)
        except StartOver as exc:    # spares took slots in its repair: they join the start-up in fit()
            loaded = exc.value
        if not loaded:
            if error:
                raise error
            raise _PeerFailed
    if job.recovery is not Recovery.SHRINK:
        # Reading the whole shard is the data reload of a restart: compare times it.
        trainer.log("ready", t_init=t_init, init_ms=init_ms, load_ms=trainer.load_ms,
                    bytes_read=trainer.train.bytes_read, recovery=job.recovery, world=comm.size)
    return trainer


def run(job: TrainJob) -> int:
    """Train `job` on this rank (under mpirun) in its recovery mode; return the exit status."""
    import torch
    from mpi4py import MPI

    from ..checkpoint.format import CheckpointError
    from ..data.format import DatasetError, DatasetFile
    from ..training.device import device_for, select_device, slot_local_rank
    from ..training.models import build_model
    from ..transport.comm import FaultPathError, FaultToleranceUnavailable
    from ..transport.exits import fault_tolerant
    from ..transport.faults import KillSpecError, fails_before_ready, parse_kills
    from ..transport.lifecycle import finalize

    def end(code: int) -> int:
        # Under ULFM, at exit the ranks leave together without MPI_Finalize (exits.py); else finalize, bounded.
        return code if fault_tolerant() else finalize(job.finalize_timeout, code)

    torch.set_num_threads(1)   # one rank per core; more threads only fight
    first = MPI.COMM_WORLD.Get_rank() == 0
    comm: Any = None
    try:
        try:
            if job.replacement is Replace.RESPAWN and job.recovery is Recovery.SHRINK:
                from ..membership.reinit import spawn_command
                from ..membership.respawn import RespawnComm
                # Without kills: a newcomer takes a slot whose kill has fired (each slot has one at most).
                comm = RespawnComm(job.spares, spawn_command(job.replace(kill_specs=[])),
                                   fails_before_ready(parse_kills(job.kill_specs)))
            elif job.spares:
                from ..membership.spares import SpareComm
                comm = SpareComm(job.spares)
            else:
                comm = job.recovery.make_comm()
            # Every check before a spare starts waiting: bad input stops every rank alike.
            kills = parse_kills(job.kill_specs, comm.size, job.spares)
            job.validate()
            if job.replacement is Replace.RESPAWN or job.recovery is Recovery.REINIT:
                from ..membership.reinit import spawn_timeout
                spawn_timeout()          # a bad $ULFMTRAIN_SPAWN_TIMEOUT stops here, not at the first spawn
            job.checkpointer()           # its own checks, before any rank trains
            train_path, _ = job.dataset_paths()
            with DatasetFile(train_path) as ds:   # header, size and shape checks, same on every rank
                shape = ds.fields[0][2]
                classes = int(ds.meta.get("classes", 10))
            # The slot owns the GPU: a waiting spare builds on the CPU and moves to its slot's GPU once it
            # has one (device_for checks --device for everyone before any spare waits).
            spare = getattr(comm, "is_spare", False)
            device = device_for(job.device, slot_local_rank(comm))
            if not spare:
                select_device(job.device, slot_local_rank(comm))
            torch.manual_seed(job.config.seed)   # the same --seed gives the same initial model, on any device
            model = build_model(job.model, inputs=math.prod(shape), classes=classes, shape=shape,
                                dropout=job.config.dropout)
            model.to("cpu" if spare else device)
        except (FaultToleranceUnavailable, KillSpecError, DatasetError, UsageError, ValueError) as exc:
            # Every rank meets these alike: one of them says it.
            if not first:
                raise _PeerFailed from exc
            raise UsageError(str(exc)) from exc
        Path(job.out).mkdir(parents=True, exist_ok=True)
        if getattr(comm, "is_spare", False):
            # Imported while waiting, not after a failure: torch.optim's first optimizer imports
            # torch._dynamo (2 s here).
            for module in ("torch._dynamo", "ulfmtrain.training.trainer"):
                importlib.import_module(module)
            if not comm.wait_for_slot():
                return end(0)     # training ended without needing me
            model.to(select_device(job.device, slot_local_rank(comm)))     # the dead slot's GPU
            kills = [k for k in kills if k.rank != comm.world_rank]   # the dead rank's kill fired already

        def build(comm: Any, kills: list[Kill], resume: bool) -> Trainer:
            return _build_trainer(job, model, comm, kills, resume)

        trainer = build(comm, kills, getattr(comm, "replacement", False))
        if job.replacement is Replace.RESPAWN and hasattr(comm, "add_join_listener"):
            from ..membership.respawn import attach
            attach(trainer)      # rebalance the data at each join; log the respawns
        if job.recovery is Recovery.REINIT:
            from ..membership.reinit import fit_with_reinit
            summary = fit_with_reinit(trainer, build, job)
        else:
            summary = trainer.fit()
        if hasattr(comm, "close"):
            comm.close()                 # respawn: a spawn in flight is settled; then the spares leave
        elif job.spares:
            comm.release_spares()
        if comm.rank == 0:
            acc = summary["test_acc"]
            tail = f", test accuracy {acc:.4f}" if acc is not None else ""
            print(f"{PROG}: {summary['steps']} steps, world {summary['world_history']}{tail}", flush=True)
    except _PeerFailed:
        return end(2)
    except Exception as exc:
        if isinstance(exc, (DatasetError, UsageError)):
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return end(2)
        if isinstance(exc, (CheckpointError, FaultPathError)):   # raised alike on every rank: rank 0 says it
            if comm is not None and comm.rank == 0:
                print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return end(2 if isinstance(exc, CheckpointError) else 1)
        if fault_tolerant():
            raise       # unexpected, maybe on this rank alone: exits.py's hook makes it a failure the peers see
        traceback.print_exc()
        return end(1)
    return end(0)
