"""`run(job)`: how each recovery mode starts, trains and ends, on one rank: the top of a rank's program."""
from __future__ import annotations

import importlib
import math
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.modes import PROG, Recovery, Replace, UsageError

if TYPE_CHECKING:
    from ..training.config import TrainJob
    from ..training.trainer import Trainer
    from ..transport.comm import FaultTolerantComm
    from ..transport.faults import Kill


def make_comm(recovery: Recovery) -> FaultTolerantComm:
    """The communicator of a recovery mode over the job's world."""
    from ..transport.comm import FaultTolerantComm, PlainComm

    if recovery is Recovery.REINIT:
        from ..membership.reinit import join_world
        return join_world()     # a replacement spawned by a rebuild joins its spawners here
    if recovery is Recovery.RESTART:
        return PlainComm()      # type: ignore[return-value]  # same interface, failures are fatal
    return FaultTolerantComm()


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
    from ..transport import hangs
    from ..transport.comm import FaultPathError, FaultToleranceUnavailable
    from ..transport.exits import fault_tolerant
    from ..transport.faults import KillSpecError, fails_before_ready, parse_kills
    from ..transport.lifecycle import finalize

    def end(code: int) -> int:
        # Under ULFM, at exit the ranks leave together without MPI_Finalize (exits.py); else finalize, bounded.
        return code if fault_tolerant() else finalize(job.finalize_timeout, code)

    torch.set_num_threads(1)   # one rank per core; more threads only fight
    # Before the first collective: the start-up is watched with the job's own bound too.
    hangs.configure(job.config.step_timeout, job.config.straggler)
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
                comm = make_comm(job.recovery)
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
        if not summary.get("consistent", True):
            # The final check is an agreed value: every rank returns this status alike.
            if comm.rank == 0:      # the shared end check's line (training/end_check.py)
                print(trainer.inconsistency, file=sys.stderr, flush=True)
            return end(1)
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
