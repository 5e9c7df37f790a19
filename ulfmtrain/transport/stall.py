"""The bounded waits: a spawn, a join or a rebuild that does not finish in time ends its process, saying why.

A watchdog that is never petted bounds one wait (reinit.py, respawn.py): one line on stderr and status 3 (the
job ends instead of hanging, and `ulfmtrain supervise` can relaunch it from a checkpoint).  The thread runs
while the rank waits inside MPI: the fault path's calls release the GIL.  One whose peers train on without its
process (a respawn's spawn, merge or join) ends it with SIGKILL instead: Open MPI 5.0.x tells the others of a
process killed by a signal, but not of one that exits without MPI_Finalize (they would wait in their
collective for good).  A rank that makes no progress in training is the hang watch's (hangs.py).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from .lifecycle import INIT_HANG_EXIT_CODE

# The status of every bound the job ends itself at: MPI_Init, a spawn or join, a step.
STALL_EXIT_CODE = INIT_HANG_EXIT_CODE
_open: set[Watchdog] = set()


def in_bounded_wait() -> bool:
    """A watchdog bounds a wait of this process now (a spawn, a merge, a join): the hang watch leaves that wait
    to it (hangs.py)."""
    return bool(_open)


class Watchdog:
    """Ends the process, with one line on stderr and status 3, once `pet` has not been called for `timeout` s.

    line(idle) gives the line; a watchdog that is never petted bounds one wait (reinit.py, respawn.py).
    With survived=True the process ends by SIGKILL, so that Open MPI reports its death to the ranks that go on.
    """

    def __init__(self, timeout: float, line: Callable[[float], str], survived: bool = False) -> None:
        self.timeout, self._line, self._survived = timeout, line, survived
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ulfmtrain-watchdog", daemon=True)
        self._thread.start()
        _open.add(self)

    def pet(self) -> None:
        """Progress: the bound starts again."""
        self._last = time.monotonic()

    def close(self) -> None:
        _open.discard(self)
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout:
                if self._survived:
                    die_told(self._line(idle))
                print(self._line(idle), file=sys.stderr, flush=True)
                os._exit(STALL_EXIT_CODE)


def die_told(line: str) -> NoReturn:
    """One line on stderr, then SIGKILL: the one end of a process that Open MPI 5.0.x tells ULFM survivors of
    (agent.die does the same where the package cannot be imported)."""
    print(line, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")
