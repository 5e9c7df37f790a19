"""A fork server on each host: a respawned process starts as a fork of one that has imported torch already.

A newcomer started from scratch spends about 2.3 s of CPU here on Python's start-up, `import torch` and
torch._dynamo before it can join, on the cores the training ranks use: the largest part of what a failure
costs a respawn soak.  With respawn on, the first rank of each host (local rank 0 of the launched job)
starts this server, which imports what a newcomer needs once and waits.  MPI_Comm_spawn then starts
`spawn_shim.py` (a few ms), which hands the server its command, environment (the spawned process's PMIx
identity), working directory and standard streams; the server forks, and the child runs the command's
module or script as Python would, calling MPI_Init as the spawned process.  The shim ends as the child ends.
Without a server on the host (another host, or ULFMTRAIN_FORKSERVER=0) the shim execs the command.

The server lives until the parent of the rank that started it (PRRTE's daemon) ends; its children die with
it.  Its socket lives in this user's private folder on the host (core/userdir.py: 0700; not the abstract
namespace, where any local user could connect first or take the name), each side checks the other's
credentials (SO_PEERCRED: the same user), and it runs only `python [-P] (-m MODULE | SCRIPT)` of its own
interpreter.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import hashlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys

from ..core import userdir
from ..transport import exits, lifecycle
from ..transport.lifecycle import local_rank
from .spawn_shim import ADDRESS_ENV, ENABLE_ENV, HOST, MAX_MESSAGE, command_line, on_this_host, peer, served

FORKED_ENV = "ULFMTRAIN_FORKED"            # set in a newcomer that the server forked
# What a newcomer imports before it says it is ready (respawn imports PRELOAD in a newcomer that started
# without a server); the server imports _IMPORTS too.  By name: the server preloads the layers above it.
PRELOAD = ("torch._dynamo", "ulfmtrain.training.trainer")
_IMPORTS = ("ulfmtrain.cli", "ulfmtrain.job.run", "ulfmtrain.membership.respawn")
_LAUNCH_ENV = ("OMPI_", "PMIX_", "PRTE_")  # the starting rank's MPI identity: not the server's
_PR_SET_PDEATHSIG = 1


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def address() -> str | None:
    """This job's server address: a socket in this user's private folder, one per host (HOST); None, said once,
    where that folder cannot be trusted."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    try:
        folder = userdir.private_dir()
    except userdir.UnsafeFolder as exc:
        if not _warned:
            _warned.append(1)
            print(f"ulfmtrain: warning: {exc}: newcomers start from scratch", file=sys.stderr, flush=True)
        return None
    job = hashlib.sha256(os.environ.get("PMIX_NAMESPACE", "").encode()).hexdigest()[:16]
    return str(folder / f"forkserver-{job}-{HOST}")


_warned: list[int] = []


def wrap(command: list[str]) -> list[str]:
    """The spawn command that starts `command` as a fork of the server, or `command` itself when disabled."""
    where = address() if enabled() else None
    if where is None:
        return command
    return command_line(where, command)


_server: subprocess.Popen[bytes] | None = None    # the server this rank started


def start() -> subprocess.Popen[bytes] | None:
    """Start this host's server, once per host (local rank 0 of the launched job), if enabled."""
    global _server
    where = address() if enabled() and local_rank() == 0 and ADDRESS_ENV not in os.environ else None
    if where is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    # Its own process group (a kill of this rank's must not end it), in the rank's session: a session of its own
    # is a scheduling group of its own under Linux's autogroup, whose one share every newcomer it forks then
    # split (three newcomers at 33 % of a core each beside an original rank at 96 %, each step waiting for
    # them).  No standard streams of this rank: PRRTE counts a process as ended only once its output pipes close.
    _server = subprocess.Popen([sys.executable, "-P", "-m", "ulfmtrain.membership.forkserver", where,
                                str(os.getppid())], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, process_group=0)
    exits.at_leave(drain)
    return _server


def drain() -> None:
    """The job is done: the server this rank started, or the one that forked it, ends once its forked processes
    have (it would otherwise wait for PRRTE's daemon to end, seconds after mpirun)."""
    pids = ([_server.pid] if _server is not None else []) + ([os.getppid()] if os.environ.get(FORKED_ENV) else [])
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)


def _take_start_env(env: dict[str, str]) -> None:
    """What Python and torch read from the environment at their start (in the server), read again from the
    shim's: its PYTHONPATH, PYTHONUNBUFFERED and OMP_NUM_THREADS."""
    sys.path[0:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)      # type: ignore[union-attr]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and threads != os.environ.get("OMP_NUM_THREADS") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _become(request: dict, fds: list[int], server: int) -> None:
    """In the forked child: take the shim's streams, environment (with the server's address, for its own
    spawns) and directory, and run its module."""
    code: object = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:
            os._exit(1)               # the server died before prctl: nobody would end this child
        os.setpgid(0, 0)              # its own process group: it ends with its DataLoader workers (serve)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _take_start_env(request["env"])
        os.environ.clear()
        os.environ.update(request["env"], **{FORKED_ENV: "1"})
        exits.at_leave(drain)         # the job done: this server ends once its children have
        os.chdir(request["cwd"])
        kind, name, args, safe = served(request["command"])
        sys.argv = [name, *args]
        if not safe:                  # what Python puts first on the path without -P
            sys.path.insert(0, os.getcwd() if kind == "module" else os.path.dirname(os.path.abspath(name)))
        if lifecycle.under_mpirun():
            lifecycle.init()          # what importing ulfmtrain does in a rank (it is imported here already)
            exits.arm_at_exit()
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        # As Python ends on an uncaught exception: sys.last_* set, then the hook (exits.py's in a rank: the
        # traceback or the SIGTERM line, once, then the exit protocol, which dies by SIGKILL unless every member
        # is leaving).  A hook that fails prints its error and the original, and the rank leaves as failed at
        # exit (exits.finalize reads sys.last_traceback); before, nothing was printed and it ended as if its
        # program had (torch's SIGCHLD storm, or a script's own hook: "out of phase" in a job of two).
        etype, tb = type(exc), exc.__traceback__
        sys.last_type, sys.last_value, sys.last_traceback = etype, exc, tb
        try:
            sys.excepthook(etype, exc, tb)
        except BaseException as failed:
            print("Error in sys.excepthook:", file=sys.stderr)
            sys.__excepthook__(type(failed), failed, failed.__traceback__)
            print("\nOriginal exception was:", file=sys.stderr)
            sys.__excepthook__(etype, exc, tb)
    finally:
        try:
            atexit._run_exitfuncs()   # the bounded MPI_Finalize among them
        finally:
            if not isinstance(code, int | None):   # SystemExit("why"), as Python ends on it
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)


def serve(address: str, watch: int, keep: bool = False) -> None:
    """Fork a newcomer for each shim that connects, until process `watch` ends.  keep: serve many jobs (the test
    suite's server, `launch`'s ranks under $ULFMTRAIN_FORKSERVER_AT): a job's end (drain) does not end it."""
    path = on_this_host(address)
    listener = _listen(path)       # first: a shim that comes during the imports waits for them
    if listener is None:
        return
    try:
        _serve(listener, watch, keep)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _listen(path: str) -> socket.socket | None:
    """A listening socket at path; a stale one (its server gone) is replaced; None when a live server has it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
    except OSError:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            if probe.connect_ex(path) == 0:
                listener.close()
                return None           # served already
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def _serve(listener: socket.socket, watch: int, keep: bool) -> None:
    try:
        ended = os.pidfd_open(watch)
    except ProcessLookupError:
        return
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False   # MPI_Init is each child's, as the spawned process
    error = _preload()           # served to every shim, which says it and starts from scratch
    gc.freeze()                  # the imported objects stay out of collections: fewer pages copied per child
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    draining = []       # SIGUSR1 (drain()): end once no forked process is left
    signal.signal(signal.SIGUSR1, (lambda *_: None) if keep else (lambda *_: draining.append(1)))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(ended, selectors.EVENT_READ, "end")
    shims: dict[int, socket.socket] = {}   # child pid -> its shim's connection

    def done(pid: int, status: int | None) -> None:
        conn = shims.pop(pid, None)
        if conn is not None:
            sel.unregister(conn)
            with conn, contextlib.suppress(OSError):
                if status is not None:
                    conn.send(json.dumps({"status": status}).encode())

    while not (draining and not shims):
        for key, _ in sel.select():
            if key.data == "end":
                for pid in shims:    # with their process groups (DataLoader workers); else SIGKILL at our exit
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                return
            if key.data == "reap":
                os.read(wake_r, 4096)
                while (reaped := _reap()) is not None:
                    done(*reaped)
            elif key.data == "accept":
                conn, _ = listener.accept()
                own = [listener.fileno(), wake_r, wake_w, ended, sel.fileno(), *(c.fileno() for c in shims.values())]
                pid = _fork_for(conn, error, own)
                if pid:
                    shims[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                else:
                    conn.close()
            elif key.data in shims:  # the shim died (or spoke out of turn): its child goes too
                # (Not when this batch reaped the child already: its pid is free, and a kill would end the
                # server, or whatever process takes the pid next.)
                with contextlib.suppress(OSError):
                    os.killpg(key.data, signal.SIGKILL)     # with its DataLoader workers
                done(key.data, None)


def _preload() -> str:
    """Import what a newcomer needs; the error if an import failed."""
    name = ""
    try:
        for name in (*_IMPORTS, *PRELOAD):
            importlib.import_module(name)
    except Exception as exc:
        return f"the fork server could not import {name} ({exc})"
    return ""


def _reap() -> tuple[int, int] | None:
    """Reap an ended child, after the rest of its process group (its DataLoader workers): as PRRTE ends a rank's
    group, so that none outlives it by the seconds torch's workers take to see their parent gone.  (While the
    child is a zombie, its pid and group id cannot be taken by another process.)"""
    try:
        ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if ended is None:
        return None
    with contextlib.suppress(OSError):
        os.killpg(ended.si_pid, signal.SIGKILL)
    return os.waitpid(ended.si_pid, 0)


def _exec_signals() -> None:
    """In a fork: the signal handlers of a process that PRRTE execs.  PRRTE sets SIGTERM, SIGINT, SIGHUP, SIGPIPE
    and SIGCHLD to their defaults before exec, and Python then makes SIGINT a KeyboardInterrupt and ignores
    SIGPIPE.  A fork keeps the server's own (SIGUSR1's, SIGCHLD's), and the server those it inherited: from a
    test suite run in the background, SIGINT ignored, so a rank's SIGINT did nothing."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def _fork_for(conn: socket.socket, error: str, server_fds: list[int]) -> int:
    """Fork a child for the shim on `conn` and tell it the pid; 0 when it was refused."""
    if peer(conn)[1] != os.getuid():
        return 0
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(data)
        if not error:
            served(request["command"])
    except (OSError, ValueError, KeyError) as exc:
        error = error or str(exc)
    if error or len(fds) != 3:
        # Closed at once: PRRTE counts the shim's process as ended only when its output pipes close.
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"error": error or "the shim sent no standard streams"}).encode())
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        _exec_signals()
        for fd in server_fds:    # closed, not unregistered: the epoll instance is the server's too
            os.close(fd)
        conn.close()
        _become(request, fds, server)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)          # as the child does: set before any killpg of it, whichever runs first
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        os.kill(pid, signal.SIGKILL)   # its shim is gone: reaped with the others
        return 0
    return pid


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), keep=sys.argv[3:] == ["--keep"])
