"""Every mode and policy, defined once (`run(job)`, how each mode starts, trains and ends, is ulfmtrain.job.run).

The enums are `StrEnum`s: their values are what the command line, the logs
and the checkpoints carry, and they compare equal to those strings.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Any

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
    INTERCOMM = "intercomm"    # in the first join at or after STEP, right before MPI_Intercomm_create: bounded
    JOIN = "join"              # in the first join of a respawned process at or after STEP, before the merge
    MERGE = "merge"            # the same join, once the survivors agreed to merge: Open MPI 5.0.x never returns
    SPLIT = "split"            # the same join, once merged: before the split of the training communicator
    HANDOVER = "handover"      # the sender of the first hand-over to a spare or newcomer at or after STEP
    READY = "ready"            # the spawning rank SIGKILLs the first respawned process ready at or after STEP
    NEWCOMER = "newcomer"      # the processes RANK respawns at or after STEP raise an error before they are ready
    REBUILD = "rebuild"        # reinit: in the first rebuild at or after STEP, before the spawn


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
