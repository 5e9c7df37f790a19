"""How a rank leaves the job: a failure of any kind is a process failure its peers see; a job that is done ends
with its own status, without an MPI_Finalize that can hang.

Open MPI 5.0.x tells ULFM survivors of a process killed by a signal, not of one that exits (and MPI_Finalize
after a failure can wait for good: docs/failures.md).  So, in a rank under `mpirun --with-ft ulfm`:

* An uncaught exception (KeyboardInterrupt from SIGINT included; SIGTERM is turned into `Terminated`): the
  traceback is printed once, the rank revokes its training communicator (a peer waiting for it in a
  collective goes to its commit agree) and takes part in that agree with LEAVING | FAILED and every lower bit
  set (the AND's identity: it decides nothing for the others).  If every member raised (a deterministic bug),
  they all end with status 1; if the others are leaving too, it ends with status 1; else a peer trains on,
  and it dies by SIGKILL so that ULFM reports it and the survivors repair.
* The program's end (its last line, or sys.exit(n)): first what the layers above registered to run then
  (before_leave: a script's end check, then the spares' release; a failed end check sets the status the
  process ends with), then the same agree with LEAVING, after a grace of
  DONE_GRACE_S without the revoke (peers that are done come to it by themselves).  If every member is
  leaving, the process ends with its own status, without MPI_Finalize (mpirun then reports the ranks' own
  statuses: 0 after a failure survived).  If a peer trains on (this rank left early), it dies by SIGKILL.

The exit agree meets a peer's next agree on that communicator, whatever it is: a commit agree (LEAVING is
never set there: comm.py's subclass bits stay below it), or the first of FaultTolerantComm.agree's two, whose
value is the caller's.  So a value with LEAVING set is confirmed by a second agree, which meets that peer's
second (0 or 1) if it was one.  Decisions come only from these agreed values.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from . import jobtree, lifecycle

LEAVING = 1 << 29          # this member is leaving the job
FAILED = 1 << 30           # ... because it failed
NEUTRAL = LEAVING - 1      # every bit below LEAVING: the AND's identity
DONE_GRACE_S = 1.0         # a rank at its end waits this long for done peers before revoking
FAILED_BOUND_S = 30.0      # a failed rank waits this long for its peers' agree, then dies by SIGKILL
WORLD_BOUND_S = 5.0        # before any FaultTolerantComm: the agree on MPI_COMM_WORLD
_POLL_S = 0.0005

_wrappers: list[weakref.ref] = []
_left = False              # the exit protocol ran (an exception's): the end of the program must not run it again
_left_failed = False       # ... for a failure
_previous_hook = sys.excepthook
_previous_unraisable = sys.unraisablehook
_TORCH_SIGCHLD = os.path.join("torch", "utils", "data", "_utils", "signal_handling.py")
_installed = False
_armed = False
_at_leave: list[Callable[[], None]] = []   # what ends with a job that is done (the fork server: forkserver.drain)
_end_status: int | None = None    # the status the process ends with, whatever its program's (a failed end check)
_leaving = threading.Lock()  # one thread leaves (the hang watch's, for a stuck main thread, or the main thread)
_on_arm: list[Callable[[], object]] = []     # what starts with the exit protocol (the hang watch)
_script_end: list[Callable[[], None]] = []   # what judges the program first at its end (a sampler's verdict)
_before_leave: list[Callable[[], None]] = []   # what a program's end runs first (a script's end check, the spares)


class Terminated(BaseException):
    """SIGTERM arrived: leave as a failure (BaseException: no `except Exception` on the way swallows it)."""


def register(wrapper: Any) -> None:
    """A communicator wrapper whose `.comm` is this rank's training communicator (the latest one counts)."""
    _wrappers.append(weakref.ref(wrapper))


def fault_tolerant() -> bool:
    """mpirun enabled ULFM and MPI is initialized (and not finalized) in this process."""
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return False
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI
    return bool(MPI.Is_initialized() and not MPI.Is_finalized())


def at_leave(end: Callable[[], None]) -> None:
    """Call `end` once this rank leaves a job whose members all leave (the layers above hook in here)."""
    if end not in _at_leave:
        _at_leave.append(end)


def left_failed() -> bool:
    """The exit protocol ran for a failure (an uncaught exception): the program's end judges nothing."""
    return _left_failed


def before_leave(fn: Callable[[], None]) -> None:
    """Call `fn` when the program ends (its last line, sys.exit, or an explicit finalize), before it leaves the job:
    in registration order; not after a failure."""
    _before_leave.append(fn)


def at_script_end(fn: Callable[[], None]) -> None:
    """Call `fn` first when the program ends (its last line, sys.exit, or its own MPI.Finalize()), before the
    steps of before_leave; once."""
    if fn not in _script_end:
        _script_end.append(fn)


def end_with(status: int) -> None:
    """At the end of the program: end with `status` once this rank has left the job with its peers (an end
    check that failed after the training completed everywhere).  Without the exit protocol armed (a world of
    one), at once."""
    global _end_status
    if _end_status is None:
        _end_status = status
    if not _armed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def arm_at_exit(timeout: float = 5.0) -> None:
    """At interpreter exit, leave the job: under ULFM, together with the peers and without
    MPI_Finalize, which can hang after a failure; else finalize, bounded.  Also installs the hooks that make an
    uncaught exception or SIGTERM a failure the peers see (exits.install), and ends the rank once the job's
    launcher is gone (jobtree.watch_launcher).

    Idempotent: only the first call registers.
    """
    global _armed
    if not _armed:
        _armed = True
        install()
        jobtree.watch_launcher()
        jobtree.workers_die_with_rank()
        jobtree.note("started")
        # Python's atexit handlers run before mpi4py's own finalize hook, which then finds MPI finalized.
        atexit.register(finalize, timeout)
        _hold_mpi_finalize(timeout)
        for fn in _on_arm:
            fn()


class _ScriptFinalize:
    """mpi4py's MPI.Finalize as a script calls it (optional there, and a habit): the end of this rank as at its
    last line (the verdicts, the end check, leaving with the peers), then MPI_Finalize where this process ends
    with it.  Before, MPI ended under them: the end check went unrun, and the job aborted (MPI_Comm_size after
    MPI_FINALIZE) or said every rank had died by a signal."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def __call__(self) -> None:
        finalize(self.timeout)


def _hold_mpi_finalize(timeout: float) -> None:
    from mpi4py import MPI

    if not isinstance(MPI.Finalize, _ScriptFinalize):
        setattr(MPI, "Finalize", _ScriptFinalize(timeout))  # noqa: B010  # mypy: a module's function


def when_armed(fn: Callable[[], object]) -> None:
    """fn() once the exit protocol is armed, at once if it is (hangs.py: the hang watch starts with it)."""
    if _armed:
        fn()
    else:
        _on_arm.append(fn)


def install() -> None:
    """The exception hook and the SIGTERM handler (idempotent; main thread only)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.excepthook = _excepthook
    sys.unraisablehook = _unraisable
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def _wrapper() -> Any:
    for ref in reversed(_wrappers):
        w = ref()
        if w is not None:
            return w
    return None


def _hold_signals() -> None:
    """The rank is leaving: from here no signal handler may raise into it (main thread only).  torch's SIGCHLD
    handler raises again at every SIGCHLD once a DataLoader worker died: it cut into the traceback being printed
    (a frame without its source line, or "lost sys.stderr" and an object dump in place of the traceback) and
    into the exit agree.  A no-op, not SIG_DFL: a signal caught already calls the handler set when it is run
    (Python reports SIG_DFL there as a race); a second SIGINT or SIGTERM is ignored as well."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)


def _ignore(signum: int, frame: Any) -> None:
    pass


def quiet_torch_sigchld() -> None:
    """Keep torch's SIGCHLD handler (set by a DataLoader with workers; main thread) from raising once the program is
    ending by an exception: after a worker died it raised at every SIGCHLD, and one that came as the exception hook
    began cut the hook short (no traceback, and the rank ended as if its program had: out of phase)."""
    handler = signal.getsignal(signal.SIGCHLD)
    code = getattr(handler, "__code__", None)
    if code is None or not code.co_filename.endswith(_TORCH_SIGCHLD) or \
            threading.current_thread() is not threading.main_thread():
        return

    def unless_ending(signum: int, frame: Any) -> None:
        if not _left and not _ended_by_exception():
            handler(signum, frame)      # type: ignore[operator,misc]  # (a function: its __code__ says so)
    signal.signal(signal.SIGCHLD, unless_ending)


def _ended_by_exception() -> bool:
    """An exception reached the program's top level: Python set sys.last_traceback before it called the hook, and
    it holds __main__'s module code (a library's PyErr_Print of a callback's error sets it too, without that)."""
    tb = getattr(sys, "last_traceback", None)
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>" and tb.tb_frame.f_globals.get("__name__") == "__main__":
            return True
        tb = tb.tb_next
    return False


def _unraisable(u: Any) -> None:
    """An exception nothing can catch (raised inside a __del__ or a finalizer) goes to Python's hook, but for one
    of torch's SIGCHLD handler raising again for a DataLoader worker's death: it lands in whatever __del__ runs
    while the first exception unwinds, before _excepthook holds the signals, and printed an "Exception ignored"
    into the rank's one traceback (test_failure_kinds' worker kill, 1 run in about 40)."""
    tb = u.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and tb.tb_frame.f_code.co_filename.endswith(_TORCH_SIGCHLD):
        return
    _previous_unraisable(u)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    _hold_signals()
    if issubclass(exc_type, Terminated):
        print(f"ulfmtrain: error: world rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')} got SIGTERM",
              file=sys.stderr, flush=True)
    else:
        _previous_hook(exc_type, exc, tb)      # the traceback, once
    if fault_tolerant() and not _left:      # (left: after the script's MPI.Finalize(), it ends with status 1)
        leave(failed=True)


def at_exit() -> None:
    """The program ended (its last line or sys.exit): leave together with the peers, or by SIGKILL if they train
    on.  Returns (without MPI_Finalize) when every member is leaving."""
    while _before_leave and not _left:
        _before_leave.pop(0)()
    if not _left:
        leave(failed=False)


def ends_with_mpi_finalize() -> bool:
    """How this process ends, decided here only: True, with MPI_Finalize, bounded (lifecycle.finalize), without
    ULFM, or where mpi4py would call it at exit with no bound (the program imported mpi4py.MPI before ulfmtrain:
    then MPI_Finalize also ends PMIx); False, under ULFM, without it (it can wait for good after a failure):
    the rank leaves with its peers and ends PMIx itself (_pmix_finalize)."""
    return not fault_tolerant() or lifecycle.mpi4py_finalizes_at_exit()


def finalize(timeout: float = 5.0, exit_code: int = 0) -> int:
    """The end of a rank, explicit (FaultTolerantComm.finalize) or at interpreter exit (arm_at_exit): under ULFM,
    leave with the peers now (MPI stays initialized); then MPI_Finalize, bounded, where ends_with_mpi_finalize
    says so.  Returns exit_code."""
    if not _left and _ended_by_exception() and fault_tolerant():
        # The program ended by an exception whose hook did not finish (the script's own hook failed, or a signal
        # handler raised as it began; Python printed both): a failure, not the end of the program.
        leave(failed=True)
    while _script_end:
        _script_end.pop(0)()
    finalizes = ends_with_mpi_finalize()     # decided before leaving, which ends PMIx where it is False
    if fault_tolerant():
        at_exit()
    code = lifecycle.finalize(timeout, exit_code) if finalizes else exit_code
    if _end_status is not None:             # the status Python would end with was fixed before the exit steps
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_end_status)
    return code


def leave(failed: bool, bound: float | None = None) -> None:
    """The exit protocol (see the module's docstring); returns only when every member is leaving.  bound: how
    long to wait for the peers' agree (FAILED_BOUND_S, or WORLD_BOUND_S before any FaultTolerantComm)."""
    global _left, _left_failed
    if not _leaving.acquire(blocking=False):
        threading.Event().wait()        # another thread of this process is leaving: the process ends with it
    _left, _left_failed = True, failed
    _hold_signals()
    from mpi4py import MPI

    from .stall import die_told

    sys.stdout.flush()
    sys.stderr.flush()
    w = _wrapper()
    comm = getattr(w, "comm", None) if w is not None else MPI.COMM_WORLD
    me = MPI.COMM_WORLD.Get_rank()
    why = "failed (above)" if failed else "ended its program"
    if comm is None or comm == MPI.COMM_NULL:
        if failed:      # a waiting spare: its death is repaired in the world
            die_told(f"ulfmtrain: world rank {me} {why}; it ends by SIGKILL so that the others see it leave")
        _pmix_finalize()        # a spare released at the end
        return
    bound = bound or (FAILED_BOUND_S if w is not None else WORLD_BOUND_S)
    value = NEUTRAL | LEAVING | (FAILED if failed else 0)
    first = _agree(comm, value, 0.0 if failed and w is not None else DONE_GRACE_S, bound)
    second = _agree(comm, value, 0.0, bound) if first is not None and first & LEAVING else None
    agreed = (first or 0) & (second or 0)
    if not agreed & LEAVING:
        die_told(f"ulfmtrain: world rank {me} {why} while its peers train on; it ends by SIGKILL so that "
                 "they see it leave and go on without it")
    if agreed & FAILED and comm.Get_rank() == 0:
        print(f"ulfmtrain: error: every rank failed (a bug that every rank meets?): the job ends with status 1 "
              f"instead of shrinking (world rank {me}'s traceback is above)", file=sys.stderr, flush=True)
    spares: int = getattr(w, "spares_left", 0)
    if failed and spares:
        w.release_spares()      # waiting spares leave too
    for end in _at_leave:
        end()
    jobtree.note("ended")
    _pmix_finalize()


def _pmix_finalize() -> None:
    """Tell this host's PRRTE daemon that the process ends cleanly: the last thing MPI_Finalize does, without the
    job-wide fence before it that waits for good after a failure.  Without it, once a job has spawned
    processes, mpirun reports a process that exits without MPI_Finalize as an abnormal end (status 1)."""
    import ctypes

    if ends_with_mpi_finalize():
        return      # MPI_Finalize comes (bounded) and ends PMIx itself: a PMIx ended before it makes it fail
    try:
        with open("/proc/self/maps") as maps:     # libmpi's own libpmix (no pmix.h ships with the wheel)
            path = next((line.split()[-1] for line in maps if "/libpmix.so" in line), None)
        if path is not None:
            ctypes.CDLL(path).PMIx_Finalize(None, ctypes.c_size_t(0))
    except OSError:
        pass


def _agree(comm: Any, value: int, grace: float, bound: float) -> int | None:
    """MPIX_Comm_iagree of value; revoke comm after `grace` s (at once if 0); None if not done in `bound` s."""
    import numpy as np
    from mpi4py import MPI

    from .. import _ftcoll

    if not grace and comm != MPI.COMM_WORLD:
        _ftcoll.revoke(comm)
    buf = np.array([value], dtype=np.intc)
    t0 = time.monotonic()
    revoked = not grace
    try:
        req = comm.Iagree(buf)
    except MPI.Exception:
        return None
    while True:
        try:
            if req.Test():
                return int(buf[0])
        except MPI.Exception:           # a member died: the value is the AND over the others
            return int(buf[0])
        idle = time.monotonic() - t0
        if not revoked and idle >= grace and comm != MPI.COMM_WORLD:
            _ftcoll.revoke(comm)        # a peer may be waiting for this rank in a collective
            revoked = True
        if idle >= bound:
            return None
        time.sleep(_POLL_S)


def die_after_failure() -> NoReturn:
    """For a caller that caught a failure itself and printed it (the fork server's child): leave as a failure,
    then end with status 1."""
    if fault_tolerant() and not _left:
        leave(failed=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
