"""Hot spares: K ranks wait beside the N that train, and take a dead rank's slot with the survivors' live state.

The training communicator has N *slots* (a slot is a logical rank: its
shard, its sampler queue, its place in the reduction).  The K spares are in
the world communicator only, waiting in a test-and-sleep loop on an
`MPI_Ibarrier` that the training ranks join when training ends.  On a
failure the survivors revoke the world as well, which wakes the spares;
everyone repairs the world, the lowest waiting spares take the dead slots in
slot order, and the training communicator is split again with the same size
and order.  The survivors hand the committed state to the newcomers and redo
the aborted step with all N contributions: with the same seed the run ends
where a failure-free run ends.  When the spares run out, the slots left
empty are removed as in shrink mode.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from mpi4py import MPI

from . import _ftcoll, lifecycle
from .comm import FaultTolerantComm, RecoveryEvent, _fault_tolerant_dup, require_fault_tolerance, retire
from .device import local_rank

WAIT_POLL_S = 0.005     # a waiting spare tests its barrier this often: no core spins


class SpareComm(FaultTolerantComm):
    """A FaultTolerantComm over N slots of a world of N + K ranks; world_rank is the slot (None: a waiting spare).

    Args:
        spares: K, the last K ranks of MPI_COMM_WORLD.
    """

    def __init__(self, spares: int) -> None:
        require_fault_tolerance()
        world = _fault_tolerant_dup(MPI.COMM_WORLD)
        if not 0 <= spares < world.Get_size():     # 0: respawn alone refills (respawn.py)
            raise ValueError(f"--spares {spares} leaves no rank to train with {world.Get_size()} ranks: "
                             f"launch more ranks (-n N --spares K starts N + K)")
        self.world = world
        self.slots = world.Get_size() - spares
        me = world.Get_rank()
        self.slot: int | None = me if me < self.slots else None
        self.spares_left = spares
        self.handover: Callable[[int, int], None] | None = None   # (root, next attempt) -> state sent/received
        self.pending_handover: tuple[int, int] | None = None    # a respawn join: after the step's update
        self.takeover: dict | None = None      # a spare that took a slot: which slot, and the root of the handover
        self.placement: list[int] = world.allgather(local_rank())   # slot s keeps launch rank s's GPU (device.py)
        self._setup(self._split(), -1 if self.slot is None else self.slot, list(range(self.slots)))
        lifecycle.arm_at_exit()

    @property
    def is_spare(self) -> bool:
        return self.slot is None

    @property
    def rank(self) -> int:
        return -1 if self.slot is None else self.comm.Get_rank()

    @property
    def size(self) -> int:
        return len(self.alive)        # the training communicator's size, also on a waiting spare

    def _split(self) -> MPI.Intracomm:
        comm = self.world.Split(0 if self.slot is not None else MPI.UNDEFINED, self.slot or 0)
        if comm != MPI.COMM_NULL:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        return MPI.Intracomm(comm)

    # -- the world: who holds which slot after a failure --------------------------
    def _repair_world(self) -> dict:
        """Repair the world with every live rank (training or waiting); give dead slots to waiting spares."""
        old = self.world
        fresh, report = _ftcoll.repair(old)
        retire(old)
        self.world = fresh
        slots = fresh.allgather(-1 if self.slot is None else self.slot)
        dead = sorted(set(self.alive) - set(slots))    # slots removed earlier are not dead again
        waiting = [r for r, s in enumerate(slots) if s == -1]
        taken = dict(zip(dead, waiting))
        if self.slot is None and fresh.Get_rank() in taken.values():
            self.slot = next(s for s, r in taken.items() if r == fresh.Get_rank())
        self.spares_left = len(waiting) - len(taken)
        if self.comm != MPI.COMM_NULL:
            retire(self.comm)
        self.comm = self._split()
        self.world_rank = self.slot if self.slot is not None else -1
        survivors = [s for s in slots if s >= 0]
        self.alive = sorted(survivors + list(taken))
        self.world_history.append(self.size)
        return {"report": report, "replaced": {s: int(r) for s, r in taken.items()},
                "removed": sorted(set(dead) - set(taken)), "root": min(survivors, default=0)}

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        size_before, wall_error = self.size, time.time() - (MPI.Wtime() - t_error)
        _ftcoll.revoke(self.world)          # wakes the waiting spares
        plan = self._repair_world()
        r = plan["report"]
        event = RecoveryEvent(
            step=self.step, what=what, committed=committed, wall_error=wall_error,
            detect_ms=(t_error - t_start) * 1e3, commit_agree_ms=agree_ms, revoke_ms=r["revoke_ms"],
            shrink_ms=r["shrink_ms"], agree_ms=r["agree_ms"], shrinks=r["shrinks"], size_before=size_before,
            size_after=self.size, removed=plan["removed"], extra={"replaced": plan["replaced"]})
        self.events.append(event)
        for fn in self._listeners:
            fn(event)
        if plan["replaced"] and self.handover is not None:
            # The newcomers get the committed state: an aborted step is then redone with them.
            self.receivers |= set(plan["replaced"])
            t0 = MPI.Wtime()
            self.handover(self.alive.index(plan["root"]), 0 if committed else self._attempt + 1)
            event.extra["handover_ms"] = (MPI.Wtime() - t0) * 1e3   # the newcomers' start-up included

    # -- a spare ------------------------------------------------------------------
    def wait_for_slot(self) -> bool:
        """Wait until a slot needs this spare (True) or training ends (False); no core spins meanwhile."""
        while self.slot is None:
            try:
                req = self.world.Ibarrier()
                while not req.Test():
                    time.sleep(WAIT_POLL_S)
                return False                  # every training rank joined: training ended
            except MPI.Exception:
                plan = self._repair_world()   # a failure somewhere: maybe a slot for me
                if self.slot is not None:
                    self.takeover = {"slot": self.slot, "root": self.alive.index(plan["root"])}
                    self.receivers |= set(plan["replaced"])
        return True

    def release_spares(self) -> None:
        """Training ranks, at the end: join the barrier the waiting spares test, so they can leave."""
        while self.spares_left:
            try:
                self.world.Ibarrier().Wait()
                return
            except MPI.Exception:             # a waiting spare died: repair the world and try again
                _ftcoll.revoke(self.world)
                self._repair_world()
