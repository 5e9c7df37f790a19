"""Respawn (`--replace respawn`): processes spawned in the background refill the empty slots and the spares.

Once no spare is left, a failure leaves its slot empty and the survivors train
on, shrunk.  At the next step boundaries the lowest survivor alone spawns, on
its main thread, one process (0.1 s each on one host under `launch`, while its
peers wait in the next reduction) per empty slot plus one per missing spare,
each as its own MPI job over MPI_COMM_SELF (PRRTE ends a whole spawned job when
one of its processes dies), and everyone keeps training while the newcomers
start, as forks of the host's fork server (forkserver.py), which imported torch
at the job's start.  A newcomer, its imports done, says it is ready and waits
(test-and-sleep) merged with the spawning rank, which merges between two steps.  Every commit
agree carries three more bits (comm.py `_commit_bits`): "I own a batch", "a
newcomer is ready", "it succeeded"; only the owner sends zeros, so every rank
learns the same state at the same step.  At each step boundary where a newcomer
is ready and the world has an empty slot or lacks a spare, every rank joins it
alike: an intercommunicator from the survivors' world to it (the owner leads),
merged and dup'ed fault-tolerantly; it takes the lowest empty slot or waits as
a spare; the training communicator is split again in slot order; the data
partition rebalances (join listeners).  The join itself comes at the start of the
survivors' next step (at_step_start), after everything their loop does after a
step (the schedule, the scaler, a checkpoint), and they hand the newcomer the
state there, as they hand it to a spare.  No checkpoint,
no rollback.  Only the owner's death loses a batch (its newcomers leave, and
the next lowest survivor spawns again); a spawn or a join that fails leaves the
world at its size, is reported to the listeners, and is tried again LEAVE_S
later, up to SPAWN_RETRIES times in a row, then after the next failure.

With one spare, the waiting spare spawns its own successor while it waits and
owns that batch: when the spare takes a slot, its bits say the newcomer is
ready, it leads the join, and the training ranks never wait in MPI_Comm_spawn.
"""
from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from ..transport import faults
from ..transport.collectives import EXCHANGE_FAILED
from ..transport.comm import _fault_tolerant_dup, agree_all_ok, retire
from ..transport.stall import die_told
from . import forkserver, newcomer
from .reinit import _watchdog
from .respawn_batch import ANSWER_S, JOIN, TAG, Batch, wait
from .spares import WAIT_POLL_S, SpareComm

if TYPE_CHECKING:
    from ..training.trainer import Trainer

NO_BATCH, READY, OK = 1, 2, 4   # commit-agree bits: nobody owns a batch; a newcomer is ready; no failure
# After a failed join, no spawn for this long: the newcomer it sent away, connected to every survivor, leaves
# within it (its finalize is bounded at 5 s).  A spawn that overlapped its exit deadlocked the spawning rank in
# Open MPI 5.0.11 (MPI_Comm_spawn, in the TCP transport's failure path): 2 of 6 runs, and once in CI; 0 of 9 now.
LEAVE_S = 6.0
# A failed batch or join is spawned again (LEAVE_S later) this many times in a row; then the world stays shrunk
# until the next repair (a spawn that cannot succeed costs every rank 0.1 s per try).
SPAWN_RETRIES = 2
JoinListener = Callable[[dict[str, Any]], None]
_JOIN_FIX = "the job ends; resume it from a checkpoint (--ckpt-dir, under `ulfmtrain supervise`)"   # a join's bound
Claim = tuple[int | None, dict[int, int], MPI.Intracomm]    # this process's slot, slot -> newcomer, its split


class RespawnComm(SpareComm):
    """A SpareComm whose empty slots and used spares are refilled by processes spawned in the background.

    Args:
        spares: K waiting spares (0: none); the last K ranks of MPI_COMM_WORLD.
        command: the program and arguments of a newcomer (this job, without kills: a newcomer takes a slot
            whose kill has fired); started as a fork of the host's fork server where it can be
            (`python [-P] (-m MODULE | SCRIPT)` of this interpreter; forkserver.py).
        fail_before_ready: a newcomer raises an error before it says it is ready (the `newcomer` kill phase).
    """

    def __init__(self, spares: int, command: list[str], fail_before_ready: bool = False) -> None:
        self.command, self.spares_target = forkserver.wrap(command), spares
        self._spawn: Batch | None = None
        self._spawn_wanted = False         # after a failure: refill
        self._spawn_after = 0.0            # no spawn before this time.time() (LEAVE_S)
        self._retries = 0                  # failed batches or joins since the last repair or join
        self._batch_seen = False           # a batch existed at the last boundary
        self._repaired = False             # a repair happened in the transaction in flight
        self._join_listeners: list[JoinListener] = []
        self._unheard: list[dict[str, Any]] = []    # a waiting spare's records: attach logs them once it trains
        # Called at the boundary that decides a join (the trainer: a durable checkpoint after that step's update,
        # before the join at the next step's start), so a job that a death inside the merge ends redoes no step.
        self.before_join: Callable[[], None] | None = None
        self._join_due: tuple[Batch | None] | None = None   # decided at a boundary, done at the next step's start
        self.joined: dict[str, Any] | None = None    # a newcomer: what it logs about its join
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            forkserver.start()
            super().__init__(spares)
        else:
            try:
                newcomer.join(self, parent, fail_before_ready)
            except Exception:
                # Gone at once, by a signal: Open MPI tells a peer connected to it of that (not of an exit),
                # and MPI_Finalize could wait for peers that will never come.  A spawning rank that never
                # heard from it gives up after the spawn bound (respawn_batch.Batch.poll).
                traceback.print_exc()
                die_told("ulfmtrain: error: a respawned process failed before it joined (above); it ends, and "
                         "the survivors spawn again")

    def add_join_listener(self, fn: JoinListener) -> None:
        """Call fn(record) when a spawn starts, joins (after the new communicator, before the handover) or fails."""
        self._join_listeners.append(fn)

    def _notify(self, status: str, slots: list[int], **fields: Any) -> None:
        rec = {"status": status, "slots": slots, "step": self.step, "world": self.size, **fields}
        if self.slot is None:
            self._unheard.append(rec)
        for fn in self._join_listeners:
            fn(rec)

    def _empty(self) -> list[int]:
        return sorted(set(range(self.slots)) - set(self.alive))

    # -- the survivors ----------------------------------------------------------
    def _commit_bits(self) -> int:
        # ANDed over the training ranks: only the owner of a batch (the rank that spawned it) sends zeros,
        # so every rank learns its state, also a spare that took a slot after the batch was started.
        s, step = self._spawn, super()._commit_bits()     # (the hang watch's step time, above these bits)
        if s is None:
            return step | NO_BATCH | READY | OK
        if s.ready():
            return step | READY | OK
        return step | (READY if s.finished() else OK)      # finished with nothing ready: it failed

    def transaction(self, attempt: Any, commit: Any = None, *, what: str = "step",
                    before_agree: Any = None) -> Any:
        # A spare that took its slot in this transaction's repair enters at the survivors' redo (its first
        # attempt is theirs, not 0): it skips this boundary as they do (it ran one alone, and waited there for good).
        self._repaired = self._next_attempt > 0
        result = super().transaction(attempt, commit, what=what, before_agree=before_agree)
        # After a repair, or a commit agree that met a process failure (the repair is due in the next
        # transaction), the agreed bits may include a rank that is now dead, and a 100-failure soak saw them
        # differ between ranks after such an agree: decide at the next boundary.
        if what == "step" and self.slot is not None and not self._repaired:
            if not self.agreed_bits & NO_BATCH or self._batch_seen:    # uniform: a join may follow
                # The commit agree's return code is not uniform: whether any rank met a failure in it is
                # agreed here, so that every rank joins or none does (and all repair at the next one).
                if not agree_all_ok(self.comm, not self._failure_seen):
                    self._failure_seen = True
                    return result
            elif self._failure_seen:
                return result               # nothing shared follows: only the lowest rank may spawn
            self._boundary()
        return result

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        try:
            super()._repair(what, committed, t_start, t_error, agree_ms)
        finally:            # also when a repair at start-up starts it over (StartOver): refill after it
            self._repaired = self._spawn_wanted = True
            self._join_due = None         # decided on bits that a dead rank sent: decided again
            self._retries = 0

    def _boundary(self) -> None:
        """After a committed step: join a ready batch, or start one (every decision here is uniform)."""
        if self._spawn is not None:
            self._spawn.poll(self.step, alone=self.size == 1)  # the owner only: the next commit agree says it
        bits = self.agreed_bits
        # A spare that took a slot in this step is not at this boundary: it waits for the state.
        if self.pending_handover:
            return
        if not bits & NO_BATCH:
            self._batch_seen = True
            if not bits & READY:
                return                                   # not ready: train on
            s = self._spawn
            if not bits & OK:
                self._batch_seen, self._spawn = False, None
                # Only the owner holds the batch, and knows why it failed.
                reason = ("the spawn failed: the spawning rank's log says why" if s is None
                          else "; ".join(s.errors) or "MPI_Comm_spawn failed")
                self._notify("failed", s.slots if s else [], reason=reason, **(s.times() if s else {}))
                self._retry_later()
            elif (self._empty() or self.spares_left < self.spares_target) and self.spares_left == 0:
                # (A waiting spare would not take part: a newcomer joins once none is left.)  One newcomer
                # per boundary; the next one, if any, at the next.
                if self.before_join is not None:
                    self.before_join()
                self._batch_seen = False
                self._join_due = (s,)
            return
        if self._batch_seen:                             # gone without a join: its owner died
            self._batch_seen = False
            self._notify("failed", [], reason="the spawning rank failed")
        # (Not the vacant slots a waiting spare takes at the next step: a spawn for one would make two owners.)
        empty = sorted(set(self._empty()) - self._vacant)
        count = len(empty) + self.spares_target - self.spares_left
        # World rank 0, the lowest survivor, spawns alone: it leads the join (waiting spares rank last).
        if self._spawn_wanted and count > 0 and self.world.Get_rank() == 0 and time.time() >= self._spawn_after:
            self._spawn_wanted = False
            self._spawn = Batch(self.command + faults.newcomer_args(self.step), count, empty)
            self._notify("spawning", empty, count=count, t_spawn=self._spawn.t_start)

    def at_step_start(self) -> None:
        """A training rank enters a step: a vacant slot is refilled (SpareComm's), a join decided at the last
        boundary happens, and the newcomer gets the state (its script then joins this step)."""
        super().at_step_start()
        if self._join_due is not None:
            (s,), self._join_due = self._join_due, None
            self._join(s)
            if s is not None and s.done():
                self._spawn = None
        if self.pending_handover:
            self.pending_handover = False
            self.hand_over()

    def _retry_later(self) -> None:
        """After a failed batch or join (uniform): spawn again, not before LEAVE_S (the newcomers it sent away
        leave within it), and at most SPAWN_RETRIES times in a row."""
        self._spawn_after = time.time() + LEAVE_S
        if self._retries < SPAWN_RETRIES:
            self._retries += 1
            self._spawn_wanted = True

    def _join(self, s: Batch | None) -> None:
        """Every training rank (s: the batch on its owner, None elsewhere): one ready newcomer joins the world."""
        t0 = time.perf_counter()
        ok, inter, world, info, held, pool, lead = 1, None, None, {}, [], None, 0
        times: dict[str, float] = {}
        try:
            # The owner leads: world rank 0, or the spare that spawned its successor while it waited.
            n = self.world.Get_size()
            owner = np.array([self.world.Get_rank() if s is not None else n], dtype=np.int64)
            self.world.Allreduce(MPI.IN_PLACE, owner, op=MPI.MIN)
            lead = int(owner[0])
            if lead == n:
                raise MPI.Exception(MPI.ERR_OTHER)     # (not reached: the owner's bits decided this join)
            s = s if self.world.Get_rank() == lead else None
            if s is not None:
                pool, times = s.pop()
                # The newcomer waits in Ibcast; it learns the leader's rank in the joined world here, and answers.
                # One that died while it waited (a spare's successor waits for minutes) left every survivor in
                # MPI_Intercomm_create for good (Open MPI did not return: a soak stalled until a kill): no
                # answer within ANSWER_S fails the join, alike everywhere (the agree below).
                pool.Ibcast(np.array([JOIN, lead], dtype=np.int64), root=0).Wait()
                ok = int(wait(pool.Irecv(np.zeros(1, dtype=np.int64), source=1, tag=TAG), ANSWER_S,
                              poll=WAIT_POLL_S / 5))     # (every training rank waits for it)
        except MPI.Exception:
            ok = 0
        if agree_all_ok(self.world, bool(ok)):
            faults.point(self.step, Phase.INTERCOMM)
            # A member dead by now (after the agree: a second kill inside a repair) leaves the others inside
            # MPI_Intercomm_create for good: Open MPI 5.0.x's context-id allocation retries its failed reduction,
            # printing "NBC_Progress: an error 75" each time (a 1000-failure soak stalled so at its 437th): bounded
            # as the merge is.
            timer = _watchdog("joining a respawned process", _JOIN_FIX, why="a process died inside "
                              "MPI_Intercomm_create, and Open MPI 5.0.x does not return from that")
            try:
                # The leader's peer is its pool (the newcomer is rank 1 of it); elsewhere it is not read.
                inter = self.world.Create_intercomm(lead, self.world if pool is None else pool, 1, TAG)
            except MPI.Exception:
                ok = 0
            timer.close()
        else:
            ok = 0
        faults.point(self.step, Phase.JOIN)
        # Open MPI 5.0.x's MPI_Intercomm_merge never returns when a member is dead (its context-id allocation
        # loops), and revoking does not free it: merge only when every survivor holds the intercommunicator and
        # is alive (uniform), and bound the merge itself, which leaves a window of about 16 ms.
        go = agree_all_ok(self.world, bool(ok))
        if go and inter is not None:
            faults.point(self.step, Phase.MERGE)
            timer = _watchdog("joining a respawned process", _JOIN_FIX, why="a process died inside "
                              "MPI_Intercomm_merge, and Open MPI 5.0.x does not return from that")
            try:
                merged = MPI.Intracomm(inter.Merge(high=False))     # survivors first, in world order
                retire(inter)
                inter = None
                world = _fault_tolerant_dup(merged)
                retire(merged)
            except MPI.Exception:
                ok = 0
            timer.close()
            # Uniform among the survivors again before the new world is used.
            go = agree_all_ok(self.world, bool(ok))
        claim = None
        if go and world is not None:
            # A death before the split makes it return an error (kill phase split); one inside it was never
            # measured, and the split allocates a context id as the merge does: bounded alike.
            timer = _watchdog("joining a respawned process", _JOIN_FIX, why="a process died inside the join's "
                              "split, and Open MPI 5.0.x did not return from that")
            try:
                info = world.bcast({"slots": self.slots, "history": self.world_history, "placement": self.placement,
                                    **times} if s
                                   else None, root=lead)
                held = world.allgather(self.slot)
                faults.point(self.step, Phase.SPLIT)
                claim = self._claim(world, held)
            except EXCHANGE_FAILED:
                ok = 0
            go = agree_all_ok(world, bool(ok))      # the newcomer takes part: it leaves unless all went through
            timer.close()
        if not go or world is None or claim is None:
            for c in (world, inter, pool):
                if c is not None:
                    _ftcoll.revoke(c)     # a newcomer waiting on them leaves
            if claim is not None and claim[2] != MPI.COMM_NULL:
                retire(claim[2])          # split on some processes only: nobody uses it
            self._notify("failed", [], reason="a process failed during the join")
            self._retry_later()
            return
        size_before = self.size
        times = {k: info[k] for k in ("t_spawn", "spawn_s", "ready_s")}
        plan = self._take_world(world, held, claim)
        self.world_history.append(self.size)
        self._spawn_wanted, self._retries = True, 0          # a spare may still be missing
        self._notify("joined", sorted(plan["taken"]), spares=plan["spares"], size_before=size_before,
                     size_after=self.size, join_ms=(time.perf_counter() - t0) * 1e3, **times)
        if plan["taken"] and self.handover is not None:
            self.pending_handover = True    # handed over in at_step_start, before this step goes on

    def _claim(self, world: MPI.Intracomm, held: list[int | None]) -> Claim:
        """Everyone, survivors and newcomers, a collective on the joined world: the lowest newcomers take the
        empty slots, and the training communicator is split from it in slot order.  Inside the join's agreed part:
        a process that died before the split (a newcomer that failed, a survivor killed) fails the join alike
        everywhere, instead of raising on the others after the agree (64 ranks: every rank ended)."""
        survivors = [s for s in held if s is not None]
        newcomers = [r for r, s in enumerate(held) if s is None]
        taken = dict(zip(sorted(set(range(self.slots)) - set(survivors)), newcomers))
        slot = self.slot
        if slot is None and world.Get_rank() in taken.values():
            slot = next(s for s, r in taken.items() if r == world.Get_rank())
        return slot, taken, self._split(slot, world)

    def _take_world(self, world: MPI.Intracomm, held: list[int | None], claim: Claim) -> dict[str, Any]:
        """Everyone, once the join went through everywhere (claim: _claim's, agreed): the joined world is the
        world, and the split its training communicator (every process split it before that agree)."""
        self.slot, taken, comm = claim
        survivors = [s for s in held if s is not None]
        newcomers = [r for r, s in enumerate(held) if s is None]
        old, self.world = getattr(self, "world", None), world
        if old is not None:
            retire(old)
        if getattr(self, "comm", MPI.COMM_NULL) != MPI.COMM_NULL:
            retire(self.comm)
        self.comm = comm
        self.world_rank = self.slot if self.slot is not None else -1
        self.alive = sorted(survivors + list(taken))
        self.receivers |= set(taken)
        self.spares_left = len(newcomers) - len(taken)
        return {"taken": taken, "spares": self.spares_left}

    # -- a waiting spare --------------------------------------------------------
    def _while_waiting(self) -> None:
        """The one waiting spare of --spares 1: spawn its successor and merge with it once it is ready, so that
        when this spare takes a slot the newcomer that refills the pool is there, and the training ranks never
        wait in MPI_Comm_spawn (0.1 s per failure here: the largest part of a failure's cost in the soak).  With
        more spares the training ranks refill them: a waiting spare's batch is not in their commit agree."""
        if self.spares_target != 1 or self.spares_left != 1:
            return
        s = self._spawn
        if s is None:
            if time.time() < self._spawn_after:
                return
            s = self._spawn = Batch(self.command + faults.newcomer_args(self.step), 1, [])
            self._notify("spawning", [], count=1, t_spawn=s.t_start)
        s.poll(self.step)
        if s.done():             # it failed: again LEAVE_S later, SPAWN_RETRIES times; then the training ranks
            self._spawn = None
            self._notify("failed", [], reason="; ".join(s.errors) or "MPI_Comm_spawn failed", **s.times())
            self._retries += 1
            self._spawn_after = time.time() + (LEAVE_S if self._retries <= SPAWN_RETRIES else math.inf)

    def wait_for_slot(self) -> bool:
        """SpareComm's; when training ends without this spare, its successor is sent away."""
        if super().wait_for_slot():
            # A training rank now, refilling as the others do after a repair (they reset this in _repair).
            self._spawn_wanted, self._retries, self._spawn_after = True, 0, min(self._spawn_after, time.time())
            return True
        self._dismiss(alone=False)
        return False

    def close(self) -> None:
        """Training ranks, at the end: send a batch in flight or waiting away, then release the spares."""
        if self.slot is not None:
            self._dismiss(alone=self.size == 1)
        self.release_spares()

    def _dismiss(self, alone: bool) -> None:
        """At the end (bounded: a spawn that never completes is left to the newcomers' own watchdog)."""
        s, self._spawn = self._spawn, None
        if s is not None:
            s.dismiss(self.step, alone=alone)
            self._notify("dismissed", s.slots, reason="training ended before the join", **s.times())

def attach(trainer: Trainer) -> None:
    """Rebalance `trainer`'s data at every join and log every respawn record in its event log."""
    from ..core.events import Event
    from ..data.plan import holdings_of

    comm = trainer.comm
    assert isinstance(comm, RespawnComm)

    def on_record(rec: dict[str, Any]) -> None:
        if rec["status"] == "joined" and rec["slots"]:
            # The partition of this world, as a fresh trainer (a newcomer's) computes it.
            here = holdings_of(trainer.train.count, comm.alive)
            trainer.sampler.rebalance(here)
            got, secs = trainer.shard.retarget(here[comm.world_rank])
            rec.update(rebalance_ms=secs * 1e3, bytes_read=got)
        trainer.log(Event.RESPAWN, **rec)

    comm.add_join_listener(on_record)
    for rec in comm._unheard:           # (logged here only: the data's listeners act on the records they hear)
        trainer.log(Event.RESPAWN, **rec)
    comm._unheard.clear()
    if trainer.checkpointer is not None:
        comm.before_join = trainer.checkpointer.request
    if comm.joined:
        trainer.log(Event.RESPAWN, **comm.joined)
