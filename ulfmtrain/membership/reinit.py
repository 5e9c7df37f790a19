"""Reinit-style global restart inside one job, emulated on ULFM: revoke, shrink, spawn, merge, roll back.

The Reinit proposal (paper 001, §5.3) re-initializes MPI after a failure and
sends every process back to its last checkpoint, with the original number of
processes.  Open MPI has no MPI_Reinit, so on a failure:

1. the C fault path revokes and shrinks the communicator (as in shrink mode);
2. instead of training on, the survivors spawn one replacement per dead rank
   (MPI_Comm_spawn) and merge with them, ordered so that each replacement
   takes the dead rank's slot;
3. every rank, old and new, builds a fresh trainer: it reads its whole shard
   again and rolls back to the latest good checkpoint.

A survivor's death in the rebuild, before or after the spawn, is met by every survivor alike: they repair
and rebuild again (rebuild_world).  A death inside the spawn or the merge, or after the merge before the
rebuilt world's first agree, is not survived: Open MPI 5.0.x returns from neither call, and the watchdog ends
the job (the window is the spawn's 0.1-1 s and a few milliseconds).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from ..transport import faults
from ..transport.collectives import EXCHANGE_FAILED
from ..transport.comm import FaultTolerantComm, agree_all_ok
from ..transport.faults import Kill, parse_kill
from ..transport.lifecycle import env_seconds
from ..transport.stall import Watchdog

if TYPE_CHECKING:
    from ..training.config import TrainJob

SPAWN_TIMEOUT_ENV = "ULFMTRAIN_SPAWN_TIMEOUT"
SPAWN_TIMEOUT_S = 60.0   # a spawn takes 1-10 s here; one that has not finished by then will not
SPAWN_TRIES = 3          # rebuild attempts (each after a repair) before the survivors roll back alone


class GlobalRestart(Exception):
    """A rank failed: the survivors hold the shrunk communicator and must rebuild the world."""

    def __init__(self, shrunk: MPI.Intracomm, report: dict, wall_error: float, t_shrunk: float) -> None:
        super().__init__(f"a rank failed during {report['what']}: global restart")
        self.shrunk, self.report, self.wall_error, self.t_shrunk = shrunk, report, wall_error, t_shrunk


class ReinitComm(FaultTolerantComm):
    """A FaultTolerantComm over a world whose ranks are fixed slots: any failure is a GlobalRestart.

    world_rank is the slot (what logs, kill specs and shards are keyed by),
    not the rank in MPI_COMM_WORLD, which a spawned replacement does not share.
    """

    def __init__(self, comm: MPI.Intracomm, slot: int, target: int) -> None:
        super().__init__(comm)
        self.world_rank = slot
        self.target = target              # the world size every rebuild restores
        self.alive = self.comm.allgather(slot)
        self.world_history = [self.size]
        self.replacement = False          # True in a process spawned by a rebuild
        self.joined: dict[str, Any] = {}  # what a replacement logs about the rebuild that made it

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        # No shrink-and-continue: unwind to fit_with_reinit with the shrunk communicator.
        wall_error = time.time() - (MPI.Wtime() - t_error)
        fresh, report = _ftcoll.repair(self.comm)
        report.update(what=what, detect_ms=(t_error - t_start) * 1e3, commit_agree_ms=agree_ms)
        raise GlobalRestart(fresh, report, wall_error, time.time())


def replacement_job(job: TrainJob, dead: set[int]) -> TrainJob:
    """The job of a replacement: the same, resuming, less the kills of the dead slots (they fired)."""
    kept = [spec for spec in job.kill_specs if parse_kill(spec).rank not in dead]
    return job.replace(kill_specs=kept, checkpoint={"resume": True})


def spawn_command(job: TrainJob) -> list[str]:
    """The program and arguments MPI_Comm_spawn starts for `job`: ulfmtrain, started like this process."""
    # -P: a source tree in the working directory must not shadow the installed package.
    flags = ["-P"] if getattr(sys.flags, "safe_path", False) else []
    return [sys.executable, *flags, "-m", "ulfmtrain", *job.to_argv()]


def spawn_timeout() -> float:
    """The bound on one spawn or join in seconds: $ULFMTRAIN_SPAWN_TIMEOUT, or 60."""
    return env_seconds(SPAWN_TIMEOUT_ENV, SPAWN_TIMEOUT_S)


def _watchdog(what: str, fix: str = "use --recovery restart under `ulfmtrain supervise`",
              why: str = "MPI_Comm_spawn under ULFM can hang on Open MPI 5.0.x", survived: bool = False) -> Watchdog:
    """A bound on one spawn or join: close() it once the call returned.  survived: the others go on without
    this process (stall.Watchdog)."""
    bound = spawn_timeout()
    return Watchdog(bound, lambda _: f"ulfmtrain: error: {what} did not finish in {bound:g} s ({why}): {fix}",
                    survived)


def _world(merged: MPI.Intracomm, slot: int, target: int, history: list[int]) -> ReinitComm:
    """Order the merged ranks by slot and agree on the result before first use."""
    world = MPI.Intracomm(merged.Split(0, slot))   # mpi4py types Split's result as Comm
    world.Set_errhandler(MPI.ERRORS_RETURN)
    world.Agree(1)
    comm = ReinitComm(world, slot, target)
    comm.world_history = history + [comm.size]
    return comm


def rebuild_world(g: GlobalRestart, old: ReinitComm, job: TrainJob) -> tuple[ReinitComm, dict[str, Any]]:
    """Survivors: spawn a replacement per dead slot, merge, and return the rebuilt world and its timings.

    The one repair loop: a survivor that dies in the gather of the slots, before the spawn or after it fails
    the agree that follows on every survivor alike; they repair the shrunk world (revoke, shrink) and start
    over, spawning for every slot dead by then.  A spawn that fails with nobody dead, SPAWN_TRIES times, leaves
    the survivors to roll back alone.  A death inside the spawn or the merge is bounded by the watchdog, not
    survived (Open MPI 5.0.x returns from neither).
    """
    shrunk = g.shrunk
    r = g.report
    info: dict[str, Any] = {
        "wall_error": g.wall_error, "t_shrunk": g.t_shrunk, "failed_in": r["what"],
        "detect_ms": r["detect_ms"], "revoke_ms": r["revoke_ms"], "shrink_ms": r["shrink_ms"],
        "agree_ms": r["agree_ms"], "size_before": old.size, "t_spawn": time.time(), "spawned": 0,
        "spawn_ok": False, "rebuilds": 0}
    timer = _watchdog("rebuilding the world")
    # Cancelled only on success: a rebuild that threw must not hang the exit either.
    inter: MPI.Intercomm | None = None
    for tries in range(1, SPAWN_TRIES + 1):
        inter, slots, ok = None, [], True
        try:
            slots = shrunk.allgather(old.world_rank)
            faults.point(old.step, Phase.REBUILD)
        except EXCHANGE_FAILED:
            ok = False
        # Everyone alive before the spawn: MPI_Comm_spawn over a world with a dead member never returns in
        # Open MPI 5.0.x (its connect/accept waits for that member; the watchdog bounds it).
        if agree_all_ok(shrunk, ok):
            try:
                dead = sorted(set(range(old.target)) - set(slots))
                command = spawn_command(replacement_job(job, set(dead)))
                inter = shrunk.Spawn(command[0], command[1:], maxprocs=len(dead), root=0)
            except MPI.Exception as exc:
                info["spawn_error"] = exc.Get_error_string()
            if agree_all_ok(shrunk, inter is not None):    # every survivor alike: a spawn that went through
                break
        if inter is not None:
            _ftcoll.revoke(inter)          # its replacements wait in their merge: they leave
            inter = None
        shrunk, rep = _ftcoll.repair(shrunk)    # whoever died meanwhile is out; a failed spawn: the same world
        info["rebuilds"] = tries
        for k in ("revoke_ms", "shrink_ms", "agree_ms"):
            info[k] += rep[k]
    slots = shrunk.allgather(old.world_rank) if inter is None else slots
    dead = sorted(set(range(old.target)) - set(slots))
    history = old.world_history + [shrunk.Get_size()]
    info.update(dead=dead, survivors=len(slots), t_spawned=time.time())
    if inter is None:
        print(f"ulfmtrain: warning: MPI_Comm_spawn failed ({info.get('spawn_error', 'on another rank')}); "
              f"rolling back on the {len(slots)} survivors", file=sys.stderr, flush=True)
        merged = shrunk
    else:
        merged = inter.Merge(high=False)     # survivors first
        info.update(spawn_ok=True, spawned=len(dead))
        merged.bcast({"slots": dead, "survivors": len(slots), "target": old.target,
                      "history": history, "info": info}, root=0)
    info["t_merged"] = time.time()
    comm = _world(merged, old.world_rank, old.target, history)
    timer.close()
    info.update(t_world=time.time(), size_after=comm.size)
    return comm, info


def join_world() -> ReinitComm:
    """The reinit world of this process: MPI_COMM_WORLD, or for a replacement the world its spawners rebuilt."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return ReinitComm(MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    timer = _watchdog("joining the survivors")
    # Cancelled only on success: a rebuild that threw must not hang the exit either.
    merged = parent.Merge(high=True)
    plan = merged.bcast(None, root=0)
    slot = plan["slots"][merged.Get_rank() - plan["survivors"]]
    info = dict(plan["info"], t_merged=time.time())
    comm = _world(merged, slot, plan["target"], plan["history"])
    timer.close()
    comm.replacement = True
    comm.joined = dict(info, t_world=time.time(), size_after=comm.size, replacement=True)
    return comm


def fit_with_reinit(trainer: Any, build: Callable[[ReinitComm, list[Kill], bool], Any],
                    job: TrainJob) -> dict[str, Any]:
    """Train; on every failure rebuild the world to its full size and roll every rank back to the checkpoint."""
    kills = [parse_kill(spec) for spec in job.kill_specs]
    if trainer.comm.joined:
        trainer.log("reinit", **trainer.comm.joined)
    while True:
        try:
            return trainer.fit()
        except GlobalRestart as g:
            comm, info = rebuild_world(g, trainer.comm, job)
            dead = set(info["dead"])
            kills = [k for k in kills if k.rank not in dead]
            job = replacement_job(job, dead)
            if hasattr(trainer.log, "close"):
                trainer.log.close()
            trainer.opt.close()                   # its hooks and thread (overlap) must not outlive it
            trainer = build(comm, kills, True)    # reads the whole shard again and resumes
            trainer.log("reinit", **info)
