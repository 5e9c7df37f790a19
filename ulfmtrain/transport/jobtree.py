"""A job's processes on one host, as a tree under the process that launched it, and how they all end.

`launch` and `supervise` run mpirun as their child.  PRRTE puts each rank in a process group of its own, a
rank forks DataLoader workers and (with respawn) a fork server in a session of its own, and a rank that dies
leaves its children to the init process: no process group or session holds a whole job.  The tree does.  The
launcher becomes a child subreaper (orphans of the job are re-parented to it, not to init), and ends the job
by its tree: end_tree freezes every descendant (SIGSTOP, so that none forks, reports a peer's death or starts
a repair in between), then SIGKILLs them all.

When the launcher itself is SIGKILLed, it cannot do that.  Then the kernel sends mpirun SIGTERM
(PR_SET_PDEATHSIG, set by the launcher), and mpirun ends each rank's process group; and each rank sees its
launcher go (watch_launcher: a pidfd named by $ULFMTRAIN_LAUNCHER, on the launcher's host only) and ends its
own tree and itself, at once.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

LAUNCHER_ENV = "ULFMTRAIN_LAUNCHER"     # BOOT_ID:PID:START of the process that launched this job
ENDS_ENV = "ULFMTRAIN_ENDS"             # a folder of the launcher's host: each rank notes its start and its end
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None     # starttime, field 22 of stat: a pid reused later differs


def identity(pid: int) -> str:
    """BOOT_ID:PID:START, which names process `pid` of this machine and no process that takes its pid later."""
    with open(_BOOT_ID) as f:
        return f"{f.read().strip()}:{pid}:{_start_time(pid)}"


def descendants(root: int) -> list[int]:
    """The live processes below `root` (children first, then theirs), zombies left out."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def end_tree(root: int, bound_s: float = 5.0) -> int:
    """SIGKILL every descendant of `root`; return how many there were.

    They are frozen first (SIGSTOP, again until no new one appears), so that none acts on another's death;
    then killed together.  Repeated until none is left or `bound_s` has passed (a process that a killed
    one's parent had not reaped yet is a zombie, not counted).  Nothing is reaped here: the caller's wait for
    its child (mpirun) still gets its status.
    """
    ended: set[int] = set()
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        frozen: set[int] = set()
        while new := [p for p in descendants(root) if p not in frozen]:
            for pid in new:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
            frozen.update(new)
        if not frozen:
            break
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        ended |= frozen
        time.sleep(0.01)
    return len(ended)


def become_subreaper(on: bool = True) -> bool:
    """Orphans among this process's descendants become its children (not init's): end_tree finds them.  Returns
    whether it was one before (a caller in a longer-lived process, a test suite, sets that back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    return bool(was.value)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a child before its exec (a preexec_fn): `sig` when `parent` dies, even by SIGKILL.  SIGTERM for mpirun:
    it then ends each rank's process group (the rank's DataLoader workers with it) before it exits; killed, it
    would leave its ranks to notice that alone, and their workers to notice their ranks gone."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:        # it died before the prctl
        os._exit(1)


class _Forks:
    """Whether the latest fork came from the main thread, and from which process (workers_die_with_rank)."""

    main, parent = False, 0

    def before(self) -> None:
        self.main, self.parent = threading.current_thread() is threading.main_thread(), os.getpid()

    def in_worker(self) -> None:
        if self.main:                 # (PR_SET_PDEATHSIG follows the forking thread: only the main one lasts)
            die_with_parent(self.parent, signal.SIGKILL)
            sys.excepthook = quiet_once_orphaned(self.parent, sys.excepthook)


def quiet_once_orphaned(parent: int, hook: Callable[..., Any], wait: float = 1.0) -> Callable[..., None]:
    """A worker's exception hook: a lost connection (its rank SIGKILLed while a batch's descriptors were handed
    over: multiprocessing's resource sharer reports it through sys.excepthook) prints nothing once the rank is
    gone.  The kernel closes a dying process's sockets before it signals its children (PR_SET_PDEATHSIG), so the
    worker can see the reset first: it waits up to `wait` s for the rank to be gone (or its own SIGKILL)."""
    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)):
            deadline = time.monotonic() + wait
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
            if os.getppid() != parent:
                return
        hook(kind, value, tb)
    return excepthook


_forks = _Forks()


def workers_die_with_rank() -> None:
    """In a rank: a multiprocessing child it forks from its main thread (a DataLoader worker) is SIGKILLed when
    the rank dies, even by SIGKILL.  Such a worker otherwise outlived it until torch's own 5 s check, and one
    caught handing a batch's file descriptors over printed a traceback (multiprocessing's resource sharer)."""
    import multiprocessing.util

    os.register_at_fork(before=_forks.before)
    multiprocessing.util.register_after_fork(_forks, _Forks.in_worker)


def watch_launcher() -> None:
    """In a rank: once the process named by $ULFMTRAIN_LAUNCHER is gone (launch SIGKILLed), end this rank's tree
    (its DataLoader workers, a fork server it started) and the rank, by SIGKILL.  A daemon thread that waits on
    a pidfd; nothing on another host than the launcher's, nor where the variable is unset."""
    boot, _, rest = os.environ.get(LAUNCHER_ENV, "").partition(":")
    pid, _, start = rest.partition(":")
    try:
        with open(_BOOT_ID) as f:
            if not pid.isdigit() or f.read().strip() != boot:
                return
    except OSError:
        return
    try:
        fd = os.pidfd_open(int(pid))
    except OSError:
        fd = -1                       # gone already (or no pidfd here: then the identity check below says)
    if _start_time(int(pid)) != start:
        _orphaned(int(pid))
    if fd >= 0:
        threading.Thread(target=_wait_then_end, args=(fd, int(pid)), name="ulfmtrain-launcher-watch",
                         daemon=True).start()


def _wait_then_end(fd: int, pid: int) -> None:
    select.select([fd], [], [])      # readable once the process has ended
    _orphaned(pid)


def _orphaned(pid: int) -> None:
    if os.environ.get("OMPI_COMM_WORLD_RANK") == "0":
        print(f"ulfmtrain: the job's launcher (pid {pid}) is gone: every rank ends", file=sys.stderr, flush=True)
    end_tree(os.getpid(), bound_s=1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def note(what: str) -> None:
    """In a rank: note in $ULFMTRAIN_ENDS that this process `started` (armed its exit protocol) or `ended` (left
    the job through it, every member leaving).  Nothing where the folder is not on this host."""
    folder = os.environ.get(ENDS_ENV, "")
    if folder and os.path.isdir(folder):
        with contextlib.suppress(OSError), open(os.path.join(folder, f"{os.getpid()}.{what}"), "w"):
            pass


def none_ended(folder: str) -> bool:
    """Ranks started (note) and not one ended its program: every rank died by a signal (crashed or killed), which
    mpirun's status does not count under ULFM."""
    names = os.listdir(folder)
    return any(n.endswith(".started") for n in names) and not any(n.endswith(".ended") for n in names)
