"""Respawn (`--replace respawn`): processes spawned in the background refill the empty slots and the spares.

Once no spare is left, a failure leaves its slot empty and the survivors train
on, shrunk.  At the next step boundary they start `MPI_Comm_spawn` on a thread
(MPI runs with THREAD_MULTIPLE), over a fault-tolerant dup of their world, and
keep training.  The thread spawns one process per empty slot plus one per
missing spare, waits (test-and-sleep: no core spins) until the newcomers have
imported torch, merges with them and dups the merged communicator.  Every
commit agree carries two more bits (comm.py `_commit_bits`): "my spawn thread
finished" and "it succeeded".  The step whose agree says every thread finished
is the join, on every rank alike: the survivors tell the waiting newcomers the
plan, the lowest newcomers take the empty slots in slot order (the rest wait
as spares), the training communicator is split again in slot order, the data
partition rebalances (join listeners), and after the step's update the
survivors hand the committed state to the newcomers, as they do for spares.
No checkpoint, no rollback.  A spawn or a join that fails leaves the world at
its size, is reported to the listeners, and is tried again after the next
failure.  A failure while a spawn is in flight abandons it: its communicators
are revoked, which sends its newcomers away.
"""
from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import _ftcoll, lifecycle
from .comm import _fault_tolerant_dup, require_fault_tolerance
from .reinit import SPAWN_TIMEOUT_S, _watchdog
from .spares import WAIT_POLL_S, SpareComm

if TYPE_CHECKING:
    from .trainer import Trainer

END, JOIN = 0, 1            # what the survivors tell the waiting newcomers: go away, or join now
PRELOAD = ("torch._dynamo", "ulfmtrain.trainer")   # imported before a newcomer says it is ready
SpawnCommand = Callable[[list[int]], list[str]]     # empty slots -> program and arguments to spawn
JoinListener = Callable[[dict[str, Any]], None]


def _wait(req: MPI.Request) -> None:
    """Complete a request by test-and-sleep: a background wait must not take a core from training."""
    while not req.Test():
        time.sleep(WAIT_POLL_S)


class _Dismissed(Exception):
    """A newcomer is not needed (training ended) or its join failed: it leaves."""


class _Spawn:
    """One background spawn of `count` processes: spawn, wait until they are ready, merge, dup."""

    def __init__(self, world: MPI.Intracomm, command: list[str], count: int, slots: list[int]) -> None:
        self.base = _fault_tolerant_dup(world)     # collective, on the main thread of every survivor
        self.command, self.count, self.slots = command, count, slots
        self.t_start = time.time()
        self.t_spawned = self.t_done = 0.0
        self.inter: MPI.Intercomm | None = None
        self.world: MPI.Intracomm | None = None
        self.error: str | None = None
        self.abandoned = False
        self.finished = threading.Event()
        threading.Thread(target=self._run, name="ulfmtrain-respawn", daemon=True).start()

    def _run(self) -> None:
        try:
            inter = self.base.Spawn(self.command[0], self.command[1:], maxprocs=self.count, root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            self.inter, self.t_spawned = inter, time.time()
            if self.abandoned:          # a failure while MPI_Comm_spawn ran: send the newcomers away
                _ftcoll.revoke(inter)
            _wait(inter.Ibarrier())             # the newcomers have imported torch: a join will not wait
            merged = MPI.Intracomm(inter.Merge(high=False))    # survivors first, in world order
            self.world = _fault_tolerant_dup(merged)
            merged.Free()
        except MPI.Exception as exc:
            self.error = f"{exc.Get_error_string()} (spawning {self.count})"
        finally:
            self.t_done = time.time()
            self.finished.set()

    def bits(self) -> int:
        """This rank's part of the decision: 1 = the thread finished, 2 = it succeeded."""
        return (1 | (2 if self.world is not None else 0)) if self.finished.is_set() else 0

    def abandon(self) -> None:
        """Revoke what this spawn made, so that its thread and its newcomers stop waiting."""
        self.abandoned = True
        for c in (self.world, self.inter, self.base):
            if c is not None:
                _ftcoll.revoke(c)


class RespawnComm(SpareComm):
    """A SpareComm whose empty slots and used spares are refilled by processes spawned in the background.

    Args:
        spares: K waiting spares (0: none); the last K ranks of MPI_COMM_WORLD.
        command: empty slots -> the program and arguments of a newcomer (this job, less the kills of
            those slots).
    """

    def __init__(self, spares: int, command: SpawnCommand) -> None:
        self.command, self.spares_target = command, spares
        self._spawn: _Spawn | None = None
        self._spawn_wanted = False         # after a failure: refill once (a failed spawn waits for the next one)
        self._join_listeners: list[JoinListener] = []
        self.joined: dict[str, Any] | None = None    # a newcomer: what it logs about its join
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            super().__init__(spares)
        else:
            self._join_as_newcomer(parent)

    def add_join_listener(self, fn: JoinListener) -> None:
        """Call fn(record) when a spawn starts, joins (after the new communicator, before the handover) or fails."""
        self._join_listeners.append(fn)

    def _notify(self, status: str, slots: list[int], **fields: Any) -> None:
        rec = {"status": status, "slots": slots, "step": self.step, "world": self.size, **fields}
        for fn in self._join_listeners:
            fn(rec)

    def _empty(self) -> list[int]:
        return sorted(set(range(self.slots)) - set(self.alive))

    # -- the survivors ----------------------------------------------------------
    def _commit_bits(self) -> int:
        return self._spawn.bits() if self._spawn is not None else 0

    def transaction(self, attempt: Any, commit: Any = None, *, what: str = "step",
                    before_agree: Any = None) -> Any:
        result = super().transaction(attempt, commit, what=what, before_agree=before_agree)
        if what == "step" and self.slot is not None:
            self._boundary()
        return result

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        s, self._spawn = self._spawn, None
        if s is not None:
            s.abandon()
            self._notify("failed", s.slots, reason="a rank failed while the spawn was in flight",
                         t_spawn=s.t_start)
        super()._repair(what, committed, t_start, t_error, agree_ms)
        self._spawn_wanted = True

    def _boundary(self) -> None:
        """After a committed step: join a finished spawn, or start one (every decision here is uniform)."""
        s = self._spawn
        if s is not None:
            if self.agreed_bits & 1:                     # every survivor's thread finished
                self._spawn = None
                if self.agreed_bits & 2:
                    self._join(s)
                else:
                    s.abandon()
                    self._notify("failed", s.slots, reason=s.error or "the spawn failed on another rank",
                                 t_spawn=s.t_start)
            return
        empty = self._empty()
        count = len(empty) + self.spares_target
        # Not while a spare that took a slot waits for the state: it is not at this boundary.
        if self._spawn_wanted and self.spares_left == 0 and count and self.pending_handover is None:
            # spares_left == 0: the world holds only training ranks, every one of them here.
            self._spawn_wanted = False
            self._spawn = _Spawn(self.world, self.command(empty), count, empty)
            self._notify("spawning", empty, count=count, t_spawn=self._spawn.t_start)

    def _join(self, s: _Spawn) -> None:
        t0 = time.perf_counter()
        world = s.world
        assert world is not None
        ok = 1
        try:
            world.Ibcast(np.array([JOIN, 0], dtype=np.int64), root=0).Wait()   # the newcomers wait in Ibcast
            world.bcast({"slots": self.slots, "history": self.world_history}, root=0)
            held = world.allgather(self.slot)
        except MPI.Exception:
            _ftcoll.revoke(world)
            ok = 0
        flag, status = _ftcoll.agree(world, ok)
        if not (flag and status == _ftcoll.OK):
            s.abandon()
            self._notify("failed", s.slots, reason="a process failed during the join", t_spawn=s.t_start)
            return
        size_before = self.size
        plan = self._take_world(world, held)
        for c in (s.inter, s.base):
            if c is not None:
                c.Free()
        self.world_history.append(self.size)
        spawn = {"t_spawn": s.t_start, "spawn_s": s.t_spawned - s.t_start, "ready_s": s.t_done - s.t_start}
        self._notify("joined", sorted(plan["taken"]), spares=plan["spares"], size_before=size_before,
                     size_after=self.size, join_ms=(time.perf_counter() - t0) * 1e3, **spawn)
        if plan["taken"] and self.handover is not None:
            self.pending_handover = (plan["root"], 0)   # after this step's update (DistributedOptimizer.step)

    def _take_world(self, world: MPI.Intracomm, held: list[int | None]) -> dict[str, Any]:
        """Everyone, survivors and newcomers: the lowest newcomers take the empty slots; split in slot order."""
        survivors = [s for s in held if s is not None]
        newcomers = [r for r, s in enumerate(held) if s is None]
        taken = dict(zip(sorted(set(range(self.slots)) - set(survivors)), newcomers))
        if self.slot is None and world.Get_rank() in taken.values():
            self.slot = next(s for s, r in taken.items() if r == world.Get_rank())
        old, self.world = getattr(self, "world", None), world
        if old is not None:
            old.Free()
        if getattr(self, "comm", MPI.COMM_NULL) != MPI.COMM_NULL:
            self.comm.Free()
        self.comm = self._split()
        if self.comm != MPI.COMM_NULL:
            _ftcoll.agree(self.comm, 1)     # before first use: no peer is still creating it
        self.world_rank = self.slot if self.slot is not None else -1
        self.alive = sorted(survivors + list(taken))
        self.spares_left = len(newcomers) - len(taken)
        return {"taken": taken, "spares": self.spares_left, "root": self.alive.index(min(survivors))}

    def close(self) -> None:
        """Training ranks, at the end: settle a spawn in flight (its newcomers leave), then release the spares."""
        s = self._spawn
        if s is not None and self.slot is not None:
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            # Uniform: every rank's thread finished, or some rank's deadline passed; a failure abandons it.
            while self._spawn is s and not self.agree(int(s.finished.is_set())):
                if not self.agree(int(time.monotonic() < deadline)):
                    break
                time.sleep(0.05)
            if self._spawn is s:
                self._spawn = None
                if self.agree(int(s.world is not None)) and s.world is not None:
                    try:
                        s.world.Ibcast(np.array([END, 0], dtype=np.int64), root=0).Wait()
                    except MPI.Exception:
                        s.abandon()
                    self._notify("dismissed", s.slots, reason="training ended before the join", t_spawn=s.t_start,
                                 spawn_s=s.t_spawned - s.t_start, ready_s=s.t_done - s.t_start)
                else:
                    s.abandon()
                    self._notify("failed", s.slots, reason=s.error or "the spawn did not finish before the end",
                                 t_spawn=s.t_start)
        self.release_spares()

    # -- a newcomer -------------------------------------------------------------
    def _join_as_newcomer(self, parent: MPI.Intercomm) -> None:
        """Get ready, merge with the survivors, and wait (test-and-sleep) for the join at a step boundary."""
        require_fault_tolerance()
        lifecycle.arm_at_exit()
        t_start = time.time()
        timer = _watchdog("joining the survivors", "the survivors train on without this process")
        for module in PRELOAD:     # torch's first optimizer imports torch._dynamo (2 s here)
            importlib.import_module(module)
        self.slot, self.handover, self.pending_handover, self.takeover = None, None, None, None
        code = np.zeros(2, dtype=np.int64)
        try:
            parent.Set_errhandler(MPI.ERRORS_RETURN)
            t_ready = time.time()
            _wait(parent.Ibarrier())
            merged = MPI.Intracomm(parent.Merge(high=True))
            world = _fault_tolerant_dup(merged)
            merged.Free()
            _wait(world.Ibcast(code, root=0))
            if code[0] != JOIN:
                raise _Dismissed("")
            info = world.bcast(None, root=0)
            held = world.allgather(None)
            ok = 1
        except MPI.Exception as exc:
            raise self._leave(timer, f"the survivors went away ({exc.Get_error_string()})") from None
        except _Dismissed:
            raise self._leave(timer, "") from None
        flag, status = _ftcoll.agree(world, ok)
        if not (flag and status == _ftcoll.OK):
            raise self._leave(timer, "a process failed during the join")
        self.slots = info["slots"]
        self._setup(MPI.Intracomm(MPI.COMM_NULL), -1, [])
        plan = self._take_world(world, held)
        timer.cancel()
        self.world_history = info["history"] + [self.size]
        if self.slot is not None:
            self.takeover = {"slot": self.slot, "root": plan["root"]}
        self.joined = {"status": "newcomer", "slots": [] if self.slot is None else [self.slot],
                       "t_start": t_start, "ready_s": t_ready - t_start, "t_joined": time.time(),
                       "world": self.size}

    @staticmethod
    def _leave(timer: threading.Timer, why: str) -> SystemExit:
        """A newcomer that is not needed exits (0) through the bounded finalize."""
        timer.cancel()
        if why:
            print(f"ulfmtrain: warning: a respawned process leaves: {why}; the survivors train on",
                  file=sys.stderr, flush=True)
        return SystemExit(lifecycle.finalize(5.0, 0))


def attach(trainer: Trainer) -> None:
    """Rebalance `trainer`'s data at every join and log every respawn record in its event log."""
    from .data.plan import initial_holdings
    from .events import Event

    comm = trainer.comm
    assert isinstance(comm, RespawnComm)

    def on_record(rec: dict[str, Any]) -> None:
        if rec["status"] == "joined" and rec["slots"]:
            # The partition of this world, as a fresh trainer (a newcomer's) computes it.
            shards = initial_holdings(trainer.train.count, comm.size)
            here = {w: shards[i] for i, w in enumerate(comm.alive)}
            trainer.sampler.rebalance(here)
            got, secs = trainer.shard.retarget(here[comm.world_rank])
            rec.update(rebalance_ms=secs * 1e3, bytes_read=got)
        trainer.log(Event.RESPAWN, **rec)

    comm.add_join_listener(on_record)
    if comm.joined:
        trainer.log(Event.RESPAWN, **comm.joined)
