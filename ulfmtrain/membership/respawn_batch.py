"""A batch of respawned processes (respawn.py): spawned by their owner (the lowest training rank at a step boundary,
or the one waiting spare while it waits), merged when ready."""
from __future__ import annotations

import math
import time

import numpy as np
from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from ..transport import faults
from .reinit import _watchdog, spawn_timeout
from .spares import WAIT_POLL_S

END, JOIN = 0, 1            # what the spawning rank tells its waiting batch: go away, or join now
TAG = 1711                  # of the intercommunicator between the survivors and a batch


ANSWER_S = 2.0              # a ready newcomer answers JOIN within this (it tests every WAIT_POLL_S), or is dead


def wait(req: MPI.Request, within: float = math.inf, poll: float = WAIT_POLL_S) -> bool:
    """Complete a request by test-and-sleep (a background wait must not take a core from training); False, and
    the request cancelled, if it did not complete within `within` seconds."""
    deadline = time.monotonic() + within
    while not req.Test():
        if time.monotonic() > deadline:
            req.Cancel()
            status = MPI.Status()
            req.Wait(status)        # (frees it; a message that came meanwhile is not cancelled)
            return not status.Is_cancelled()
        time.sleep(poll)
    return True


class Batch:
    """`count` newcomers spawned by their owner (at a step boundary, or a spare while it waits), one MPI job each,
    merged when ready.

    One job each: PRRTE ends every process of a spawned job when one of them dies (a spawned job is not
    started recoverable), so a batch spawned as one job would lose every newcomer to one kill.  Everything
    runs on the owner's main thread, between steps (poll).  On a second thread, while the main thread
    reduced and agreed, Open MPI 5.0.11 made the main thread's collectives fail with nobody dead, or its
    commit agree return another value there than on its peers, at the very instant a spawn or a merge
    completed on the thread: a 100-failure soak had four such errors and an 8 s stall with the merge there,
    and with only the spawn there another soak split a commit (the owner repaired, its peers went on) and
    hung at its 72nd failure.  So the others wait for the spawn calls (0.1 s each; 1.1 s with btl/ofi, see
    launch.py); not for the newcomers' start-up, which follows them.
    """

    def __init__(self, command: list[str], count: int, slots: list[int]) -> None:
        self.command, self.count, self.slots = command, count, slots
        self.t_start = time.time()
        self.t_spawned = 0.0
        self.ready_within = spawn_timeout()                    # a newcomer not ready by then is given up
        self._spawned = False                                  # poll has called MPI_Comm_spawn count times
        # Ready: the newcomer has imported torch, and sent its pid (for the `ready` kill phase).
        self._pending: list[tuple[MPI.Intercomm, MPI.Request, np.ndarray]] = []
        self._ready: list[tuple[MPI.Intracomm, float]] = []   # (the owner and one newcomer, when ready)
        self.errors: list[str] = []
        self.stop = False

    def poll(self, step: int, alone: bool = False) -> None:
        """The owner, between steps: spawn the batch (0.1 s each), or merge with the ready ones (a few ms each).

        A newcomer says it is ready with a message, not an MPI_Ibarrier: of two Ibarriers on two spawns'
        intercommunicators, tested on the main thread, Open MPI 5.0.11 completed only one.  A newcomer that
        dies between that message and the end of the merge leaves the owner in MPI_Intercomm_merge for good
        (the context-id loop of respawn's join, see _join): the owner ends itself after the spawn bound, and
        the others repair without it and respawn both.  alone: the owner is the last training rank, so nobody
        goes on without it: its bound then ends the job with status 3 rather than by SIGKILL, which mpirun would
        count as success.
        """
        if not self._spawned and not self.stop:
            self._spawned = True
            spawned = []
            for _ in range(self.count):
                # Alone in the spawn: the others wait in the next reduction and repair without this rank.
                timer = _watchdog("spawning a replacement", "the other ranks repair without this one and train on",
                                  why="MPI_Comm_spawn did not return", survived=True)
                try:
                    inter = MPI.COMM_SELF.Spawn(self.command[0], self.command[1:], maxprocs=1, root=0)
                    inter.Set_errhandler(MPI.ERRORS_RETURN)
                    self.t_spawned = self.t_spawned or time.time()
                    spawned.append(inter)
                except MPI.Exception as exc:
                    self.errors.append(f"MPI_Comm_spawn: {exc.Get_error_string()}")
                timer.close()
            for inter in spawned:
                pid = np.zeros(1, dtype=np.int64)
                self._pending.append((inter, inter.Irecv(pid, source=0, tag=TAG), pid))
            return
        for item in list(self._pending):
            inter, req, pid = item
            try:
                if not req.Test():
                    if time.time() - self.t_spawned > self.ready_within:
                        # Dead before it was ready, and nobody told: Open MPI reports a spawned process's
                        # death to its parent only over a connection, and a newcomer that never sent has none.
                        # Revoking toward it hung the spawning rank; if it lives, its own bound ends it.
                        req.Cancel()
                        self.errors.append(f"a newcomer was not ready within {self.ready_within:g} s of its spawn")
                        self._pending.remove(item)
                    continue
                faults.point(step, Phase.READY, pid=int(pid[0]))
                timer = _watchdog("merging with a ready respawned process", "the job ends; resume it from a "
                                  "checkpoint" if alone else "the other ranks repair without this one and train on",
                                  why="it died inside MPI_Intercomm_merge, and Open MPI 5.0.x does not return from "
                                  "that", survived=not alone)
                try:
                    pool = MPI.Intracomm(inter.Merge(high=False))
                finally:
                    timer.close()
                pool.Set_errhandler(MPI.ERRORS_RETURN)
                self._ready.append((pool, time.time()))
            except MPI.Exception as exc:
                self.errors.append(f"a newcomer failed before it was ready ({exc.Get_error_string()})")
            self._pending.remove(item)

    def ready(self) -> bool:
        return bool(self._ready)

    def finished(self) -> bool:
        """Every newcomer is ready, or failed."""
        return (self._spawned or self.stop) and not self._pending

    def done(self) -> bool:
        """Nothing ready, and nothing more will be."""
        return self.finished() and not self.ready()

    def pop(self) -> tuple[MPI.Intracomm, dict[str, float]]:
        """The next ready newcomer's pool, and when it was spawned and ready."""
        pool, t_ready = self._ready.pop(0)
        return pool, {"t_spawn": self.t_start, "spawn_s": self.t_spawned - self.t_start,
                      "ready_s": t_ready - self.t_start}

    def times(self) -> dict[str, float]:
        return {"t_spawn": self.t_start, "spawn_s": self.t_spawned - self.t_start}

    def dismiss(self, step: int, alone: bool = False) -> None:
        """Send the ready newcomers away (END).  The others are left to their own bound (the join watchdog):
        one that never said it is ready may be dead, and a revoke toward a process that never connected waits
        in PMIx_Get for good (the fuzzer's seed 323: training done, the spawning rank hung at its end)."""
        self.stop = True
        self.poll(step, alone)   # a newcomer that got ready since the last step waits in its merge: merge, END
        ready, self._ready = self._ready, []
        for pool, _ in ready:
            try:
                pool.Ibcast(np.array([END, 0], dtype=np.int64), root=0).Wait()
            except MPI.Exception:
                _ftcoll.revoke(pool)
        for _, req, _ in self._pending:
            req.Cancel()
        self._pending.clear()
