"""Start-up and shut-down: one bounded MPI_Init, and one bounded MPI_Finalize for every exit path.

A rank that dies before MPI_Init completes leaves its peers waiting in
MPI_Init for ever (Open MPI's start-up fence has no timeout), and MPI_Finalize
after a failure can hang (ompi #11404, #9434): under ULFM a rank leaves without
it (exits.py); without ULFM it is bounded.  Both calls run under a C
watchdog (mpi4py's calls hold the GIL, so a Python timer could never fire);
on a hang it writes one line on stderr and ends the process with a non-zero
code, so a hang is never waited on for ever nor reported as success.

Under mpirun, `import ulfmtrain` calls `start_at_import()`: mpi4py is told not
to initialize or finalize MPI itself, MPI_Init runs here, bounded, and then
exits.arm_at_exit arms the exit protocol: the exception hook, SIGTERM, and the end.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from typing import Any

INIT_TIMEOUT_ENV = "ULFMTRAIN_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 60.0   # start-up takes 0.2-3 s here; the bound also covers ranks that start late
INIT_HANG_EXIT_CODE = 3       # = _ftcoll.INIT_HANG_EXIT_CODE (not imported here: that loads mpi4py.MPI)
HANG_EXIT_CODE = 124          # a finalize that hangs, as timeout(1)


def _check_timeout(what: str, timeout: Any) -> None:
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and math.isfinite(timeout)
                                         and timeout > 0):
        raise ValueError(f"{what} timeout must be a positive number of seconds, got {timeout!r}")


def env_seconds(name: str, default: float, environ: Mapping[str, str] = os.environ) -> float:
    """A bound in seconds from $name, or `default` when it is unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r} is not a positive number of seconds "
                         f"(unset it for the default, {default:g})")
    return value


def init_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """The MPI_Init bound in seconds: $ULFMTRAIN_INIT_TIMEOUT, or 60 when it is unset or empty."""
    return env_seconds(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT, environ)


def local_rank() -> int:
    """This rank's index among the ranks of its host.

    The agent launch exports the true value (Open MPI there believes every
    rank is on the head node); otherwise mpirun's OMPI_COMM_WORLD_LOCAL_RANK.
    """
    for var in ("ULFMTRAIN_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def under_mpirun(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a rank that mpirun (or MPI_Comm_spawn) started; False in launchers and data tools."""
    return "OMPI_COMM_WORLD_SIZE" in environ or "PMIX_RANK" in environ


def init(timeout: float | None = None) -> int:
    """MPI_Init_thread(MPI_THREAD_MULTIPLE) within `timeout` s, else one line on stderr and exit 3.

    timeout defaults to $ULFMTRAIN_INIT_TIMEOUT (60 s).  Returns the thread
    level provided.  A no-op when MPI is already initialized, e.g. because the
    program imported mpi4py.MPI before ulfmtrain: that start-up is unbounded,
    the program's choice.
    """
    timeout = init_timeout() if timeout is None else timeout
    _check_timeout("MPI_Init", timeout)
    from mpi4py import MPI

    from .. import _ftcoll

    guard_revoke()
    if MPI.Is_finalized():
        raise RuntimeError("MPI was finalized already; it cannot be initialized again")
    if MPI.Is_initialized():
        return MPI.Query_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    provided = _ftcoll.init_bounded(float(timeout))
    _set_errhandlers(MPI)
    return provided


def _set_errhandlers(MPI: Any) -> None:
    """What mpi4py does after its own MPI_Init (mpi4py.rc.errors): by default errors raise exceptions."""
    import mpi4py

    handler = {"exception": MPI.ERRORS_RETURN, "abort": MPI.ERRORS_ABORT,
               "fatal": MPI.ERRORS_ARE_FATAL}.get(mpi4py.rc.errors)
    if handler is not None:
        MPI.COMM_SELF.Set_errhandler(handler)
        MPI.COMM_WORLD.Set_errhandler(handler)


def guard_revoke() -> None:
    """Guard Open MPI's revoke of a communicator still being built, which crashed a rank that learned of a death
    during a split (csrc/revoke_guard.h).  ULFMTRAIN_REVOKE_GUARD=0 leaves Open MPI's own (to show what it
    guards); mpi4py.MPI is imported by then."""
    if os.environ.get("ULFMTRAIN_REVOKE_GUARD") != "0":
        from .. import _ftcoll

        _ftcoll.guard_revoke()


def start_at_import() -> bool:
    """Under mpirun, before anything imports mpi4py.MPI: bounded MPI_Init now; True when it ran (the caller then
    arms the bounded end, exits.arm_at_exit).

    Outside mpirun nothing happens (no MPI in launchers and data tools).  Nor
    when the program imported mpi4py.MPI first or set mpi4py.rc itself: then
    MPI's start-up is the program's, and mpi4py's rules apply.
    """
    if not under_mpirun():
        return False
    if "mpi4py.MPI" in sys.modules:
        guard_revoke()              # MPI is the program's; the guard is every rank's
        return False
    import mpi4py

    rc = mpi4py.rc
    if (rc.initialize, rc.threads, rc.thread_level) != (True, True, "multiple"):
        return False
    timeout = init_timeout()      # a bad value stops here, before mpi4py is touched
    rc.initialize = False         # read when mpi4py.MPI is first imported: MPI_Init is ours
    if rc.finalize is None:
        rc.finalize = False       # the bounded finalize armed by exits replaces mpi4py's unbounded one
    init(timeout)
    return True


def finalize(timeout: float = 5.0, exit_code: int = 0) -> int:
    """MPI_Finalize within `timeout` seconds, else exit with exit_code (124 if it was 0); return exit_code."""
    _check_timeout("finalize", timeout)
    if "mpi4py.MPI" not in sys.modules:
        return exit_code          # nothing initialized MPI (importing it here could, to finalize it at once)
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return exit_code
    from .. import _ftcoll

    sys.stdout.flush()
    sys.stderr.flush()
    _ftcoll.finalize(float(timeout), exit_code or HANG_EXIT_CODE)
    return exit_code


def mpi4py_finalizes_at_exit() -> bool:
    """mpi4py calls MPI_Finalize, unbounded, at interpreter exit: the program imported mpi4py.MPI before
    ulfmtrain (start_at_import then leaves MPI's start-up and end to mpi4py's rules)."""
    import mpi4py

    rc = mpi4py.rc
    return bool(rc.initialize if rc.finalize is None else rc.finalize)
