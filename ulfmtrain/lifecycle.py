"""Shut-down: one bounded MPI_Finalize for every exit path, armed at interpreter exit.

MPI_Finalize after a failure can hang (ompi #11404, #9434).  The watchdog is
a C thread (mpi4py's Finalize holds the GIL, so a Python timer could never
fire); on a hang it ends the process with a non-zero code, so a hang is never
reported as success.
"""
from __future__ import annotations

import atexit
import math
import sys

HANG_EXIT_CODE = 124          # as timeout(1)
_armed = False


def finalize(timeout: float = 5.0, exit_code: int = 0) -> int:
    """MPI_Finalize within `timeout` seconds, else exit with exit_code (124 if it was 0); return exit_code."""
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"finalize timeout must be a positive number of seconds, got {timeout!r}")
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return exit_code
    from . import _ftcoll

    sys.stdout.flush()
    sys.stderr.flush()
    _ftcoll.finalize(float(timeout), exit_code or HANG_EXIT_CODE)
    return exit_code


def arm_at_exit(timeout: float = 5.0) -> None:
    """Finalize, bounded, at interpreter exit: a program that never calls finalize cannot hang there."""
    global _armed
    if not _armed:
        _armed = True
        # Python's atexit handlers run before mpi4py's own finalize hook, which then finds MPI finalized.
        atexit.register(finalize, timeout)
