"""The step watchdog: a rank that commits no step for --step-timeout seconds ends the job, saying why.

Open MPI tells the survivors of every process death it sees.  A peer it does
not see (a rank frozen by its host, or, rarely, a death reported to nobody)
leaves every rank waiting in a collective for good.  As torch.distributed's
collective timeout does, a rank that has committed no step for that long
writes one line and exits with status 3: the job ends instead of hanging, and
`ulfmtrain supervise` can relaunch it from a checkpoint.  The thread runs while
the rank waits inside MPI: the fault path's calls release the GIL.  The same
watchdog, never petted, bounds a spawn or a join (reinit.py, respawn.py).  One
whose peers train on without its process (a respawn's spawn, merge or join)
ends it with SIGKILL instead: Open MPI 5.0.x tells the others of a process
killed by a signal, but not of one that exits without MPI_Finalize (they would
wait in their collective for good).

A user's own loop gets the same watchdog by default (`commit_watch`, a commit hook of every
DistributedOptimizer): it starts at the first committed step, so a long first step (compilation, a cold
cache) is not counted, and it fires only while the main thread waits in ulfmtrain (a collective, the
commit agree), so minutes of the program's own work after its last step (an evaluation, a save) are not
a hang.  Its bound, $ULFMTRAIN_STEP_TIMEOUT (600 s, `off` to disable), is train's --step-timeout default:
steps take seconds, and 600 s also covers a peer writing a checkpoint of tens of GB between two steps.
`train` keeps its own (--step-timeout), which turns this one off.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from .lifecycle import INIT_HANG_EXIT_CODE, env_seconds

# The status of every bound the job ends itself at: MPI_Init, a spawn or join, a step.
STALL_EXIT_CODE = INIT_HANG_EXIT_CODE
STEP_TIMEOUT_ENV = "ULFMTRAIN_STEP_TIMEOUT"
DEFAULT_STEP_TIMEOUT = 600.0
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_explicit = False      # a step watchdog of its own (train's --step-timeout) turns the default one off


class Watchdog:
    """Ends the process, with one line on stderr and status 3, once `pet` has not been called for `timeout` s.

    line(idle) gives the line; a watchdog that is never petted bounds one wait (reinit.py, respawn.py).
    With survived=True the process ends by SIGKILL, so that Open MPI reports its death to the ranks that go on.
    """

    def __init__(self, timeout: float, line: Callable[[float], str], survived: bool = False,
                 only_if: Callable[[], bool] | None = None) -> None:
        self.timeout, self._line, self._survived, self._only_if = timeout, line, survived, only_if
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ulfmtrain-watchdog", daemon=True)
        self._thread.start()

    def pet(self) -> None:
        """Progress: the bound starts again."""
        self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout and (self._only_if is None or self._only_if()):
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


def step_watchdog(timeout: float, where: Callable[[], str]) -> Watchdog:
    """The training loop's watchdog (pet it at each committed step); where() names the rank and its step."""
    global _explicit
    _explicit = True
    return Watchdog(timeout, lambda idle: (
        f"ulfmtrain: error: {where()} committed no step for {idle:.0f} s (--step-timeout {timeout:g}): a peer "
        "hung, or died without Open MPI reporting it; the job ends. Resume it from a checkpoint (--ckpt-dir, "
        "under `ulfmtrain supervise`), or raise --step-timeout if one step can take that long"))


def step_timeout() -> float | None:
    """$ULFMTRAIN_STEP_TIMEOUT in seconds (600 when unset), or None for `off`."""
    if os.environ.get(STEP_TIMEOUT_ENV, "").strip().lower() == "off":
        return None
    return env_seconds(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT)


def _main_waits_in_ulfmtrain() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


def commit_watch(where: Callable[[], str]) -> Callable[[], None]:
    """A commit hook that runs the default step watchdog of a user's loop (see the module's docstring)."""
    timeout = step_timeout()          # a bad value stops here, when the optimizer is made
    dog: list[Watchdog] = []

    def pet() -> None:
        if timeout is None or _explicit:
            return
        if dog:
            dog[0].pet()
            return
        dog.append(Watchdog(timeout, lambda idle: (
            f"ulfmtrain: error: {where()} has waited in a collective with no step committed for {idle:.0f} s "
            f"(${STEP_TIMEOUT_ENV}, {timeout:g} s): a peer hung, or died without Open MPI reporting it; the job "
            f"ends. Raise ${STEP_TIMEOUT_ENV} if a step can take that long, or set it to off"),
            only_if=_main_waits_in_ulfmtrain))

    return pet
