"""Stop a job when told: what `launch` and `supervise` do on SIGINT, SIGTERM and SIGHUP, and when SIGKILLed.

A terminal's Ctrl-C or hang-up, or a batch scheduler's SIGTERM, reaches the launcher alone: mpirun runs in a
session of its own.  The launcher then ends the whole job by its process tree (transport/jobtree.py: mpirun,
every rank, their DataLoader workers, fork servers and newcomers, the agents of `launch --agent` and what they
started on this host), prints one line and exits with 128 + the signal's number (130, 143, 129), as a shell
reports a job ended by that signal.  A checkpoint being written is left as it was: the files are replaced by
rename only (checkpoint/format.py), so the directory holds the previous good checkpoint or the new one.

SIGKILL cannot be handled: the kernel then sends mpirun SIGTERM (PR_SET_PDEATHSIG), which ends its ranks'
process groups; each rank on this host ends itself once the launcher is gone (jobtree.watch_launcher, named
by $ULFMTRAIN_LAUNCHER), and each agent once mpirun is gone (agent.py); a rank on another host ends when its
agent's link closes (tether.py).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..transport import jobtree
from . import lost_daemon

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The launcher was told to stop by a signal (BaseException: nothing on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    for sig in STOP_SIGNALS:          # one stop: a second Ctrl-C must not interrupt the ending of the job
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals(prog: str) -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP end every process this one started (its tree), print one
    line, and raise Stopped (its .status: 128 + the signal).  The process adopts its job's orphans."""
    was = jobtree.become_subreaper()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    except Stopped as stop:
        ended = jobtree.end_tree(os.getpid())
        print(f"{prog}: stopped by {stop}: the job ended ({ended} processes: mpirun, its ranks and their "
              f"children)", file=sys.stderr, flush=True)
        raise
    finally:
        if signal.getsignal(signal.SIGINT) is _raise_stopped:     # (after a stop they stay ignored)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not was:       # (launch called in a longer-lived process: its later orphans are init's again)
            jobtree.become_subreaper(False)


def start(cmd: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start mpirun in a session of its own (a terminal's signals reach the launcher alone), to end its job when
    this process dies, even by SIGKILL, with $ULFMTRAIN_LAUNCHER naming this process to the ranks."""
    me = os.getpid()
    return subprocess.Popen(list(cmd), env={**(os.environ if env is None else env),
                                            jobtree.LAUNCHER_ENV: jobtree.identity(me)},
                            start_new_session=True, preexec_fn=lambda: jobtree.die_with_parent(me), **popen)


def run(prog: str, cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None, *,
        one_host: bool = False) -> int:
    """Run mpirun (start) to its end and return its status (LOST_HOST, and one line, when PRRTE ended the job
    for a lost host: lost_daemon); past `timeout` s, end the job's tree and raise subprocess.TimeoutExpired.
    one_host (every rank can note its end here): status 1, with one line, where mpirun says 0 though every rank
    died by a signal (jobtree.none_ended): under ULFM such deaths do not count, and the job left no result."""
    with tempfile.TemporaryDirectory(prefix="ulfmtrain-ends.") as ends:
        extra = {jobtree.ENDS_ENV: ends} if one_host else {}
        proc = start(cmd, {**(os.environ if env is None else env), **extra}, stderr=subprocess.PIPE)
        watch = lost_daemon.Watch(proc)
        try:
            rc = watch.status(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            jobtree.end_tree(os.getpid())
            raise
        if rc == 0 and one_host and jobtree.none_ended(ends):
            print(f"{prog}: error: every rank died by a signal (killed, or crashed) before it ended its program: "
                  "the job left no result (mpirun says 0: under ULFM a death by signal does not count)",
                  file=sys.stderr, flush=True)
            return 1
        return rc
