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
from typing import Protocol

import numpy as np
from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from ..transport import exits, faults
from ..transport.collectives import EXCHANGE_FAILED
from ..transport.comm import (
    FaultPathError,
    FaultTolerantComm,
    RecoveryEvent,
    StartOver,
    _fault_tolerant_dup,
    agree_all_ok,
    handles_held,
    require_fault_tolerance,
    retire,
)
from ..transport.lifecycle import local_rank

WAIT_POLL_S = 0.005     # a waiting spare tests its barrier this often: no core spins
HANDOVER_TAG = 1712     # the hand-over's messages on the training communicator (nothing else sends there)


class StateHolder(Protocol):
    """What sends and takes the committed state in a hand-over (the job's state: training/job_state.py)."""

    def payload(self) -> bytes: ...
    def take(self, blob: bytes) -> None: ...


class SpareComm(FaultTolerantComm):
    """A FaultTolerantComm over N slots of a world of N + K ranks; world_rank is the slot (None: a waiting spare).

    A failure inside a script's collective (comm.allreduce, comm.barrier) is repaired without the spares: the
    dead slot stays vacant while the survivors finish the collective and whatever else their script does before
    its next step, and at the start of that step a spare takes it (at_step_start), where a replacement's script
    can join them.

    Args:
        spares: K, the last K ranks of MPI_COMM_WORLD.
    """

    _vacant: frozenset[int] = frozenset()     # dead slots that a spare takes at the next step

    def __init__(self, spares: int) -> None:
        require_fault_tolerance()
        launched = MPI.COMM_WORLD.Get_size()
        if not 0 <= spares < launched:     # 0: respawn alone refills (respawn.py)
            raise ValueError(f"--spares {spares} leaves no rank to train with {launched} ranks: "
                             f"launch more ranks (-n N --spares K starts N + K)")
        world = _fault_tolerant_dup(MPI.COMM_WORLD)
        self.world = world
        # Slots and spares by launch rank: the dup leaves out a rank that died before it, which is a dead slot
        # (or spare) to repair below, not a reason to number the others anew (one slot fewer, and a training
        # rank taken for a spare that waited to the end).
        self.slots = launched - spares
        me = MPI.COMM_WORLD.Get_rank()
        self.slot: int | None = me if me < self.slots else None
        self.spares_left = spares
        self.handover: StateHolder | None = None   # what sends and takes the state (the job's state)
        self.pending_handover = False           # a respawn join: hand over before the step goes on
        self.takeover: dict | None = None      # a spare that took a slot: which slot, and whether in start-up
        self.handover_bytes: dict[str, int] = {}    # what this rank sent and received in the last hand-over
        # The first collectives.  A death in them is repaired like any other (the one loop), before anything
        # started: a spare that takes a slot here holds it from the start, with nothing to hand over.
        t_start = MPI.Wtime()
        try:
            placement, comm, ok = world.allgather(local_rank()), self._split(self.slot), True
        except EXCHANGE_FAILED:
            placement, comm, ok = [], MPI.Intracomm(MPI.COMM_NULL), False
        self.placement: list[int] = placement   # slot s keeps launch rank s's GPU (device.py)
        self._setup(comm, -1 if self.slot is None else self.slot, list(range(self.slots)))
        exits.arm_at_exit()
        if not agree_all_ok(world, ok and world.Get_size() == launched):
            self._repair_at_start(t_start)

    def _repair_at_start(self, t_start: float) -> None:
        """A death in the constructor's collectives: repair (dead slots go to spares), then gather each slot's
        local rank from the rank that holds it now; a death meanwhile: again."""
        t_error = MPI.Wtime()
        while True:
            size_before = self.size if self.comm != MPI.COMM_NULL else self.slots
            _ftcoll.revoke(self.world)
            self.events.append(self._event(self._repair_world(), "connect", False, time.time(),
                                           (t_error - t_start) * 1e3, 0.0, size_before))
            self.receivers.clear()          # nothing started: nothing to hand over
            try:
                held, ok = self.world.allgather((self.slot, local_rank())), True
            except EXCHANGE_FAILED:
                held, ok = [], False
            if agree_all_ok(self.world, ok):
                break
        # (A slot nobody holds any more keeps the host's first GPU, for a respawned process that takes it.)
        place = {s: lr for s, lr in held if s is not None}
        self.placement = [place.get(s, 0) for s in range(self.slots)]

    @property
    def is_spare(self) -> bool:
        return self.slot is None

    @property
    def rank(self) -> int:
        return -1 if self.slot is None else self.comm.Get_rank()

    @property
    def size(self) -> int:
        return len(self.alive)        # the training communicator's size, also on a waiting spare

    def _split(self, slot: int | None, world: MPI.Intracomm | None = None) -> MPI.Intracomm:
        """The training communicator of the world (or of `world`, a joined one not yet taken), in slot order."""
        comm = (self.world if world is None else world).Split(0 if slot is not None else MPI.UNDEFINED, slot or 0)
        if comm != MPI.COMM_NULL:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        return MPI.Intracomm(comm)

    # -- the world: who holds which slot after a failure --------------------------
    def _repair_world(self, assign: bool = True) -> dict:
        """Repair the world with every live rank (training or waiting); give dead slots to waiting spares (or,
        assign=False, leave as many vacant: spares take them at the next step).

        One loop: a death at any moment of it (the shrink, the allgather, the split) is met alike by every
        live rank (an agree on "all of it went through here") and the world is repaired again.
        """
        total = {"revoke_ms": 0.0, "shrink_ms": 0.0, "agree_ms": 0.0, "shrinks": 0}
        while True:
            old = self.world
            fresh, report = _ftcoll.repair(old)
            retire(old)
            self.world = fresh
            for k in total:
                total[k] += report[k]
            comm, slot, ok = MPI.Intracomm(MPI.COMM_NULL), self.slot, True
            try:
                # (slot or -1, waiting for the state: a rank that took a slot in a repair whose hand-over failed)
                mine = (-1 if self.slot is None else self.slot, self.slot is not None and self.slot in self.receivers)
                # (With the training ranks' `assign`, alike on all of them: a waiting spare does not know it.)
                held = fresh.allgather((*mine, int(self.started), int(self.saving), int(assign)))
                slots = [h[0] for h in held]
                # Slots removed earlier are not dead again; vacant ones are.
                dead = sorted((set(self.alive) | self._vacant) - set(slots))
                waiting = [r for r, s in enumerate(slots) if s == -1]
                given = all(h[4] for h in held if h[0] >= 0)
                taken = dict(zip(dead, waiting)) if given else {}
                vacant = frozenset(() if given else dead[:len(waiting)])
                if slot is None and fresh.Get_rank() in taken.values():
                    slot = next(s for s, r in taken.items() if r == fresh.Get_rank())
                comm = self._split(slot)
            except EXCHANGE_FAILED:
                ok = False
            if agree_all_ok(fresh, ok):
                break
            if comm != MPI.COMM_NULL:
                retire(comm)
            _ftcoll.revoke(fresh)       # every live rank repairs again (a waiting spare wakes too)
        self.slot, self._vacant = slot, vacant
        self.spares_left = len(waiting) - len(taken)
        if self.comm != MPI.COMM_NULL:
            retire(self.comm)
        self.comm = comm
        self.world_rank = self.slot if self.slot is not None else -1
        survivors = [s for s in slots if s >= 0]
        self.alive = sorted(survivors + list(taken))
        self.receivers = {h[0] for h in held if h[1] and h[0] in self.alive} | set(taken)
        self.world_history.append(self.size)
        startup = not all(h[2] for h in held if h[0] >= 0 and not h[1])
        senders = [s for s in survivors if s not in self.receivers]
        return {"report": total, "replaced": {s: int(r) for s, r in taken.items()}, "saving": any(h[3] for h in held),
                "removed": sorted(set(dead) - set(taken) - vacant), "vacant": sorted(vacant),
                "root": min(senders, default=-1), "startup": startup}

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        """Repair, then hand the committed state to the ranks that took slots; a death in either: again.

        During start-up (before the initial state is agreed) the ranks that took slots are handed nothing:
        every rank, survivors and newcomers, starts the start-up over together (StartOver).
        """
        attempt = 0 if committed else self._attempt + 1
        # A script's collective is finished without the spares: a replacement's script can join its peers at a
        # step (or the end), not inside whatever its peers run between steps.
        assign = what not in ("allreduce", "barrier")
        while True:
            size_before, wall_error = self.size, time.time() - (MPI.Wtime() - t_error)
            _ftcoll.revoke(self.world)          # wakes the waiting spares
            plan = self._repair_world(assign)
            event = self._event(plan, what, committed, wall_error, (t_error - t_start) * 1e3, agree_ms, size_before)
            self.events.append(event)
            for fn in self._listeners:
                fn(event)
            if plan["startup"] and self.receivers:
                self.receivers.clear()
                raise StartOver
            if not self.receivers or self.handover is None:
                return
            # The newcomers get the committed state: an aborted step is then redone with them.
            t0 = MPI.Wtime()
            done = self._hand_over_once(attempt)
            event.extra["handover_ms"] = (MPI.Wtime() - t0) * 1e3   # the newcomers' start-up included
            event.extra.update(self.handover_bytes)
            if done:
                return
            what, committed, t_start = "handover", True, MPI.Wtime()
            t_error, agree_ms = t_start, 0.0

    def _event(self, plan: dict, what: str, committed: bool, wall_error: float, detect_ms: float,
               commit_agree_ms: float, size_before: int) -> RecoveryEvent:
        """The record of one repair of the world (plan: _repair_world's)."""
        r = plan["report"]
        return RecoveryEvent(
            step=self.step, what=what, committed=committed, wall_error=wall_error, detect_ms=detect_ms,
            commit_agree_ms=commit_agree_ms, revoke_ms=r["revoke_ms"], shrink_ms=r["shrink_ms"],
            agree_ms=r["agree_ms"], shrinks=r["shrinks"], size_before=size_before, size_after=self.size,
            removed=plan["removed"],
            extra={"replaced": plan["replaced"], "vacant": plan["vacant"],
                   "handles": handles_held(self.world, self.comm)})

    # -- the hand-over: one attempt, inside the repair loop -------------------------
    def _hand_over_once(self, attempt: int) -> bool:
        """The lowest sender sends, each receiver takes the committed state (with the attempt that comes next);
        True if every live slot got it (uniform), False if a rank died meanwhile (then every rank repairs again).

        Point to point, to the receivers only: a broadcast over the training communicator made every survivor
        receive (and allocate) the whole state it already held, n - 1 copies of it per failure where one is
        needed (the memory and the bytes on every survivor's link grew with n).  The decision stays one agree.
        """
        assert self.handover is not None
        senders = [i for i, w in enumerate(self.alive) if w not in self.receivers]
        receivers = [i for i, w in enumerate(self.alive) if w in self.receivers]
        if not senders:
            raise FaultPathError("every rank that held the state to hand over has died")
        src, receiving = senders[0], self.world_rank in self.receivers
        if not receiving:
            faults.point(self.step, Phase.HANDOVER)
        size = np.zeros(1, dtype=np.int64)
        data = np.empty(0, dtype=np.uint8)
        status = _ftcoll.OK
        sent = 0
        if self.rank == src:
            data = np.frombuffer(bytearray(self.handover.payload() + attempt.to_bytes(8, "little")),
                                 dtype=np.uint8)
            size[0] = data.size
            for dest in receivers:
                status = _ftcoll.send_try(self.comm, size, dest, HANDOVER_TAG)
                if status == _ftcoll.OK:
                    status = _ftcoll.send_try(self.comm, data, dest, HANDOVER_TAG)
                if status != _ftcoll.OK:
                    break
                sent += data.size
        elif receiving:
            status = _ftcoll.recv_try(self.comm, size, src, HANDOVER_TAG)
            if status == _ftcoll.OK:
                data = np.empty(int(size[0]), dtype=np.uint8)
                status = _ftcoll.recv_try(self.comm, data, src, HANDOVER_TAG)
        self.handover_bytes = {"handover_bytes_sent": sent, "handover_bytes_received": data.size if receiving else 0}
        if not agree_all_ok(self.comm, status == _ftcoll.OK):
            return False
        if receiving:
            blob = data.tobytes()
            self.handover.take(blob[:-8])
            self.start_attempts_at(int.from_bytes(blob[-8:], "little"))
            self.started = True
        self.receivers.clear()
        return True

    def hand_over(self) -> None:
        """Outside a repair (a spare that took a slot, a respawn join at a step's start): the hand-over, until
        every live slot has the state; a death meanwhile re-enters the repair (which hands over again)."""
        if self.handover is None or not self.receivers:
            return
        if not self._hand_over_once(0):
            t = MPI.Wtime()
            self._repair("handover", True, t, t, 0.0)

    def at_step_start(self) -> None:
        """A training rank enters a step (DistributedOptimizer): slots a repair left vacant go to the waiting spares
        now, and the state to them (uniform: every survivor holds the same vacant slots)."""
        if self._vacant and self.slot is not None:
            t = MPI.Wtime()
            self._repair("refill", True, t, t, 0.0)

    # -- a spare ------------------------------------------------------------------
    def wait_for_slot(self) -> bool:
        """Wait until a slot needs this spare (True) or training ends (False); no core spins meanwhile."""
        while self.slot is None:
            try:
                req = self.world.Ibarrier()
                while not req.Test():
                    self._while_waiting()
                    time.sleep(WAIT_POLL_S)
                return False                  # every training rank joined: training ended
            except MPI.Exception:
                plan = self._repair_world()   # a failure somewhere: maybe a slot for me
                if self.slot is not None:
                    # During start-up the survivors start it over with me; later they hand me their state.
                    # (root: the comm rank that sends the state, for callers of opt.handover(root, receive=True))
                    # (save: the survivors repaired inside a checkpoint's save, whose next round it joins)
                    self.takeover = {"slot": self.slot, "startup": plan["startup"], "save": plan["saving"],
                                     "root": self.alive.index(plan["root"]) if plan["root"] >= 0 else 0}
                    if plan["startup"]:
                        # Nothing is handed over: it starts the start-up with them (as the survivors, which
                        # clear it in _repair).  A stale entry would make it a receiver in a later repair.
                        self.receivers.clear()
        return True

    def _while_waiting(self) -> None:
        """A waiting spare, between two tests of its barrier (respawn: spawn its successor)."""

    def release_spares(self) -> None:
        """Training ranks, at the end: join the barrier the waiting spares test, so they can leave."""
        while self.spares_left:
            try:
                self.world.Ibarrier().Wait()
                return
            except MPI.Exception:             # a waiting spare died: repair the world and try again
                _ftcoll.revoke(self.world)
                self._repair_world()
