"""A respawned process's side of respawn's join (respawn.py): ready, merged with its owner, waiting, joined."""
from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ..transport import exits
from ..transport.collectives import EXCHANGE_FAILED
from ..transport.comm import _fault_tolerant_dup, agree_all_ok, require_fault_tolerance, retire
from ..transport.stall import Watchdog
from . import forkserver
from .reinit import _watchdog
from .respawn_batch import JOIN, TAG, wait


class Joining(Protocol):
    """What join sets and calls on the RespawnComm being built (respawn.py, which imports this module)."""

    slot: int | None
    slots: int
    placement: list[int]
    handover: Any
    pending_handover: bool
    takeover: dict | None
    world_history: list[int]
    joined: dict[str, Any] | None

    @property
    def size(self) -> int: ...
    def _setup(self, comm: MPI.Intracomm, world_rank: int | None = None, alive: list[int] | None = None) -> None: ...
    def _claim(self, world: MPI.Intracomm, held: list[int | None]) -> Any: ...
    def _take_world(self, world: MPI.Intracomm, held: list[int | None], claim: Any) -> dict[str, Any]: ...


def join(self: Joining, parent: MPI.Intercomm, fail_before_ready: bool = False) -> None:
    """A newcomer (self: its RespawnComm, being built): get ready, merge with the rank that spawned it, wait
    (test-and-sleep) for the join, and take part in it."""
    require_fault_tolerance()
    exits.arm_at_exit()
    t_start = time.time()
    timer = _watchdog("joining the survivors", "the survivors train on without this process", survived=True)
    for module in forkserver.PRELOAD:     # torch's first optimizer imports torch._dynamo (2 s here)
        importlib.import_module(module)
    if fail_before_ready:
        raise RuntimeError("the kill schedule's `newcomer` phase: this respawned process fails before it is ready")
    self.slot, self.handover, self.pending_handover, self.takeover = None, None, False, None
    code = np.zeros(2, dtype=np.int64)
    try:
        parent.Set_errhandler(MPI.ERRORS_RETURN)
        t_ready = time.time()
        wait(parent.Isend(np.array([os.getpid()], dtype=np.int64), dest=0, tag=TAG))
        pool = MPI.Intracomm(parent.Merge(high=True))
        pool.Set_errhandler(MPI.ERRORS_RETURN)
        timer.close()         # ready: waiting in the pool for a failure may take any time
        wait(pool.Ibcast(code, root=0))
        if code[0] != JOIN:
            raise _leave(None, "")
        wait(pool.Isend(np.zeros(1, dtype=np.int64), dest=0, tag=TAG))     # alive: the leader goes on
        timer = _watchdog("joining the survivors", "the survivors train on without this process",
                          why="a process died inside the join, and Open MPI 5.0.x does not return from that",
                          survived=True)
        MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
        inter = MPI.COMM_WORLD.Create_intercomm(0, pool, 0, TAG)
        merged = MPI.Intracomm(inter.Merge(high=True))
        world = _fault_tolerant_dup(merged)
        retire(merged)
        claim = None
        try:
            info = world.bcast(None, root=int(code[1]))     # the leader, survivors first in world order
            held = world.allgather(None)
            self.slots, self.placement = info["slots"], info["placement"]    # the slots' GPUs (device.py)
            claim = self._claim(world, held)
        except EXCHANGE_FAILED:
            pass
        if not agree_all_ok(world, claim is not None) or claim is None:     # as the survivors decide it
            raise _leave(timer, "a process failed during the join")
    except MPI.Exception as exc:
        raise _leave(timer, f"the survivors went away ({exc.Get_error_string()})") from None
    self._setup(MPI.Intracomm(MPI.COMM_NULL), -1, [])
    self._take_world(world, held, claim)
    timer.close()
    self.world_history = info["history"] + [self.size]
    if self.slot is not None:
        self.takeover = {"slot": self.slot, "startup": False, "root": 0}
    self.joined = {"status": "newcomer", "slots": [] if self.slot is None else [self.slot],
                   "t_start": t_start, "ready_s": t_ready - t_start, "t_joined": time.time(),
                   "world": self.size, "forked": os.environ.get(forkserver.FORKED_ENV) == "1"}


def _leave(timer: Watchdog | None, why: str) -> SystemExit:
    """A newcomer that is not needed exits (0) as the ranks do (exits.py): without MPI_Finalize under ULFM,
    which can wait for good after a failure (its bounded form then made mpirun's status 124: seed 155)."""
    if timer is not None:
        timer.close()
    if why:
        print(f"ulfmtrain: warning: a respawned process leaves: {why}; the survivors train on",
              file=sys.stderr, flush=True)
    return SystemExit(exits.finalize(5.0, 0))
