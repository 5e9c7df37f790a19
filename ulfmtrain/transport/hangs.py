"""The hang watch: a rank that makes no progress for a bound is a failed rank, removed as a SIGKILLed one is.

Open MPI reports a process that died by a signal, never one that stopped running: a rank frozen (SIGSTOP, a
stuck host), deadlocked in the program's own code, or waiting for a DataLoader worker that never answers leaves
its peers waiting in a collective for good.  One thread in each rank process (started with the exit protocol,
exits.arm_at_exit) looks a few times a second at where the main thread is:

* **waiting** in ulfmtrain (a frame of transport/ or membership/: a collective, a repair, the exit agree),
  with no call of the fault path returning meanwhile: the time inside one collective or repair, never the
  time since the last commit, so a program's own evaluation or save between steps is not counted;
* **working**: anything else (the program's code, torch, a checkpoint write).

It writes both, with a heartbeat, on the job's board (board.py), and applies one bound B to three rules:

1. **Its own side.**  A main thread that has worked for B without running (asleep in 95 % of the samples, its
   process under 2 % of a core and 1 KiB/s read or written: a deadlock, a stuck DataLoader) is hung: the rank
   prints one line and leaves as a failure (exits.leave: its peers, waiting for it, revoke and repair; if every
   rank is hung, the job ends with status 3).  A busy rank (an evaluation, a save, a download, a thread of its
   own that the main thread joins) is never hung.  So is one that has waited in transport/ for B asleep on a lock
   (a futex, as the kernel's wait channel says) and as idle, outside a bounded wait: a collective, a repair or an
   agree polls while it waits, so that one is deadlocked inside the MPI library (a soak met it in Open MPI's TCP
   transport: a lock taken again by the thread that held it, as a peer's death was handled).  It ends by SIGKILL
   at once, without the exit protocol, whose MPI calls could wait on the same lock; its peers repair as after
   any SIGKILL.
2. **The peers' side.**  A rank that waits SIGKILLs every process of the job whose heartbeat is older than B
   (frozen: its watch thread cannot run either); across hosts the agents do it for their ranks (agent.py).
3. **Nobody comes.**  A member that waited NOBODY_BOUNDS x B (600 s at the default floor) while every member
   waits too, none frozen and none in a wait of its own bounded (a spawn, a merge: stall.py), ends with status 3
   (a death Open MPI did not report, a fault path that never returns); so does one whose peers are on other hosts,
   out of its board's sight (the normal launch across hosts: `launch --agent` sees them all).

Stragglers (off by default, $ULFMTRAIN_STRAGGLER or train --straggler F): a member whose own work per step
(from its commit to its next contribution) is F times its peers' median, and longer than theirs by half a step,
is evicted the same way.

**The bound**: the larger of a floor (DEFAULT_FLOOR_S, or $ULFMTRAIN_STEP_TIMEOUT, or train --step-timeout; `off`
disables the watch) and STEPS_PER_BOUND times the step time agreed in the commit agree (each rank offers its
median time between two commits as a thermometer code; the AND over the ranks is the slowest rank's, uniform on
every survivor): it follows the steps the job actually runs and is never shorter than one of them.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from . import board as boards
from . import exits
from .lifecycle import INIT_HANG_EXIT_CODE, env_seconds
from .stall import die_told, in_bounded_wait

FLOOR_ENV = "ULFMTRAIN_STEP_TIMEOUT"
STRAGGLER_ENV = "ULFMTRAIN_STRAGGLER"
DEFAULT_FLOOR_S = 60.0                 # torchft's default timeout; a step of ulfmtrain's takes ms to seconds
STEPS_PER_BOUND = 10
NOBODY_BOUNDS = 10                     # "nobody comes" takes this many bounds (600 s at the default floor)
STEP_LEVELS, STEP_UNIT_S, STEP_SHIFT = 20, 0.01, 3   # thermometer: bit i = "my step <= 10 ms x 2^i"
STEPS_KEPT = 16
# A stuck main thread: runnable in at most 5 % of the samples, and its process (the watch aside) under 2 % of a core
# and 1 KiB/s read or written: a download, a slow disk or a thread of the program's own that the main thread joins
# works; a deadlock, or a wait for a DataLoader worker that never answers, does not.
IDLE_RUNNABLE, IDLE_CPU, IDLE_IO = 0.05, 0.02, 1024
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WAITS = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("transport", "membership"))
_MEMBERSHIP = _WAITS[1]     # spawns, merges and joins: they sleep in PMIx while they wait
_OVERLAP = os.path.join(_PACKAGE, "training", "overlap.py")    # the main thread waiting for the reductions
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SITE = sysconfig.get_paths()["purelib"] + os.sep

_settings: dict[str, float | None] = {}


def configure(floor: float | None = None, straggler: float | None = None) -> None:
    """Set the floor and the straggler factor for this process (train's flags); None, or a value out of range
    (TrainJob.validate reports it), keeps the environment's."""
    if floor is not None and math.isfinite(floor) and floor > 0:
        _settings["floor"] = floor
    if straggler is not None and math.isfinite(straggler) and straggler > 1:
        _settings["straggler"] = straggler


def floor() -> float | None:
    """The bound's floor in seconds, or None when the watch is off ($ULFMTRAIN_STEP_TIMEOUT=off)."""
    if "floor" in _settings:
        return _settings["floor"]
    if os.environ.get(FLOOR_ENV, "").strip().lower() == "off":
        return None
    return env_seconds(FLOOR_ENV, DEFAULT_FLOOR_S)


def straggler() -> float | None:
    """The straggler factor (None: off, the default)."""
    if "straggler" in _settings:
        return _settings["straggler"]
    raw = os.environ.get(STRAGGLER_ENV, "").strip()
    if raw in ("", "off", "0"):
        return None
    factor = env_seconds(STRAGGLER_ENV, 0.0)
    if factor <= 1:
        raise ValueError(f"{STRAGGLER_ENV}={raw!r}: give a factor above 1 (how many times slower than its peers)")
    return factor


# -- the step time, agreed ---------------------------------------------------------
class _Steps:
    """This rank's committed steps: the time between two, and its own work in each."""

    def __init__(self) -> None:
        self.commits = 0
        self.t_commit: float | None = None
        self.attempted = False
        self.intervals: collections.deque[float] = collections.deque(maxlen=STEPS_KEPT)
        self.work: collections.deque[float] = collections.deque(maxlen=STEPS_KEPT)

    def committed(self) -> None:
        now = time.monotonic()
        if self.t_commit is not None:
            self.intervals.append(now - self.t_commit)
        self.t_commit, self.attempted = now, False
        self.commits += 1

    def attempt(self, step: int, attempt: int) -> None:
        if self.t_commit is not None and not self.attempted:
            self.work.append(time.monotonic() - self.t_commit)
        self.attempted = True


steps = _Steps()
step_committed = steps.committed      # DistributedOptimizer's commit hook
step_attempted = steps.attempt        # ... and its attempt hook


def step_bits() -> int:
    """This rank's part of the commit agree (comm.py, above the bits of RespawnComm): bit i set iff its median
    step takes at most STEP_UNIT_S x 2^i; all set before it has one."""
    if not steps.intervals:
        return ((1 << STEP_LEVELS) - 1) << STEP_SHIFT
    step = statistics.median(steps.intervals)
    bits = sum(1 << i for i in range(STEP_LEVELS) if step <= STEP_UNIT_S * 2 ** i)
    return bits << STEP_SHIFT


def agreed_step(agreed_bits: int) -> float:
    """The slowest rank's step time as the commit agree left it in agreed_bits (an upper bound, within 2x)."""
    bits = (agreed_bits >> STEP_SHIFT) & ((1 << STEP_LEVELS) - 1)
    level = (bits & -bits).bit_length() - 1 if bits else STEP_LEVELS
    return STEP_UNIT_S * 2 ** level


def bound(comm: Any = None) -> float:
    """The bound in seconds: max(floor, STEPS_PER_BOUND x the agreed step time)."""
    base = floor() or DEFAULT_FLOOR_S
    bits = getattr(comm, "agreed_bits", 0)
    return max(base, STEPS_PER_BOUND * agreed_step(bits)) if bits else base


# -- where the main thread is ------------------------------------------------------
def _innermost(frame: Any) -> Any:
    """A thread's innermost frame outside the standard library (a wait in threading or queue is its caller's)."""
    f = frame
    while f is not None and (f.f_code.co_filename.startswith("<frozen")
                             or f.f_code.co_filename.startswith(_STDLIB)
                             and not f.f_code.co_filename.startswith(_SITE)):
        f = f.f_back
    return f


def classify(frame: Any) -> tuple[str, str]:
    """("wait" or "work", file:line) of a thread's stack: its innermost frame outside the standard library
    decides."""
    f = _innermost(frame)
    if f is None:
        return "work", "?"
    name = f.f_code.co_filename
    where = f"{os.path.basename(name)}:{f.f_lineno}"
    return ("wait" if name.startswith(_WAITS) or name == _OVERLAP else "work"), where


def _thread_state(tid: int) -> str:
    """The kernel's state letter of a thread of this process (R running or runnable, S, D, ...)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _io(path: str) -> int:
    """Bytes read and written so far (files, sockets, pipes), from /proc/self/io or a thread's own."""
    try:
        with open(path) as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0


def _asleep_on_a_lock(tid: int) -> bool:
    """A thread of this process sleeps on a futex (a lock, a condition), not in a sleep or a poll of its own:
    its wait channel, by name (False where the kernel hides it)."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return "futex" in f.read()
    except OSError:
        return False


def _others_work() -> tuple[float, int]:
    """CPU seconds and bytes moved so far by every thread of this process but the calling one (the watch's own
    rows and reads are not the program's work; a thread of the program's that the main thread waits for is)."""
    me = threading.get_native_id()
    return (boards.cpu_ticks() / os.sysconf("SC_CLK_TCK") - time.thread_time(),
            _io("/proc/self/io") - _io(f"/proc/self/task/{me}/io"))


class Watch:
    """The thread (see the module's docstring).  comm() gives this rank's communicator wrapper, or None;
    progress() a count that moves whenever the fault path returns or a step commits; on_stuck(line, bound) and
    on_nobody(line) end this rank."""

    def __init__(self, comm: Callable[[], Any], progress: Callable[[], int],
                 on_stuck: Callable[[str, float], None], on_nobody: Callable[[str], None]) -> None:
        self._comm, self._progress, self._on_stuck, self._on_nobody = comm, progress, on_stuck, on_nobody
        main = threading.main_thread()
        assert main.ident is not None
        # The main thread's kernel id is the pid: after os.fork() (a rank the fork server forked) Python's
        # main_thread().native_id is still the parent's, whose state and wait channel this process cannot read.
        self._main, self._tid = main.ident, os.getpid()
        self.pid, self.start = os.getpid(), boards.start_time(os.getpid())
        self.host = os.environ.get("ULFMTRAIN_HOST") or socket.gethostname()
        # The normal launch across hosts: peers on other hosts are on other boards, out of this one's sight.
        world, local = (os.environ.get(f"OMPI_COMM_WORLD_{k}SIZE") for k in ("", "LOCAL_"))
        self.spans_hosts = bool(world and local and int(local) < int(world))
        self.state, self.since, self.progress = "work", time.monotonic(), -1
        self.samples: collections.deque[tuple[float, float, int, bool, bool]] = collections.deque()
        self.last_tick = time.monotonic()
        self.board: boards.Board | None = None
        self.send: Callable[[str], None] | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    # -- what this rank says ---------------------------------------------------
    def sample(self, now: float, b: float) -> tuple[str, str]:
        """Classify the main thread; restart the clock of its state when it changes or the fault path moves."""
        inner = _innermost(sys._current_frames().get(self._main))
        state, where = classify(inner)
        progress = self._progress()
        if state != self.state or progress != self.progress:
            self.state, self.since, self.progress = state, now, progress
            self.samples.clear()
        # Membership's waits are left out of the lock rule: a spawn, a merge or a join sleeps in PMIx while it
        # waits (their own watchdogs bound them), where a collective, a repair or an agree polls.
        polls = inner is not None and not inner.f_code.co_filename.startswith(_MEMBERSHIP)
        self.samples.append((now, *_others_work(), _thread_state(self._tid) == "R",
                             state == "work" or polls and _asleep_on_a_lock(self._tid)))
        while self.samples and now - self.samples[0][0] > b:
            self.samples.popleft()
        return state, where

    def stuck_for(self, now: float, b: float) -> float:
        """How long the main thread has been stuck (0 unless for the whole bound): it worked without running, or
        waited in ulfmtrain asleep on a lock, outside a bounded wait (the module's docstring)."""
        if now - self.since < b or len(self.samples) < 4 or self.state == "wait" and in_bounded_wait():
            return 0.0
        (t0, cpu0, io0, *_), (_, cpu1, io1, *_) = self.samples[0], self.samples[-1]
        span = now - t0
        runnable = sum(s[3] for s in self.samples) / len(self.samples)
        locked = sum(s[4] for s in self.samples) / len(self.samples)
        idle = (runnable <= IDLE_RUNNABLE and locked >= 1 - IDLE_RUNNABLE and cpu1 - cpu0 <= IDLE_CPU * span
                and io1 - io0 <= IDLE_IO * span)
        return now - self.since if span >= 0.9 * b and idle else 0.0

    def make_row(self, now: float, b: float) -> dict[str, Any]:
        w = self._comm()
        role = "other" if w is None else "spare" if getattr(w, "slot", 0) is None else "member"
        rank = w.world_rank if role == "member" else None
        who = (f"world rank {rank} (after step {w.step})" if role == "member" else "a waiting spare"
               if role == "spare" else f"launch rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}")
        return {"pid": self.pid, "start": self.start, "host": self.host, "rank": rank, "role": role,
                "mono": now, "cpu": boards.cpu_ticks(), "state": self.state, "for": now - self.since, "bound": b,
                "work": statistics.median(steps.work) if steps.work else 0.0, "steps": len(steps.work),
                "step": statistics.median(steps.intervals) if steps.intervals else 0.0,
                "where": who, "size": getattr(w, "size", 0) if role == "member" else 0,
                "straggler": straggler(), "bounded": in_bounded_wait(), "nobody": NOBODY_BOUNDS * b,
                "spans_hosts": self.spans_hosts}

    # -- the loop ----------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        w = self._comm()
        b = bound(w)
        interval = _interval(b)
        if now - self.last_tick > max(4 * interval, 1.0):
            # This process did not run (stopped and resumed, or the whole job suspended): every clock restarts,
            # and rows older than the bound are not taken for frozen peers before they had a tick to write.
            self.since, self.last_tick = now, now
            self.samples.clear()
            return
        self.last_tick = now
        _, where = self.sample(now, b)
        row = self.make_row(now, b)
        if self.send is not None:           # under a tether: the agent on the head node judges (agent.py)
            self.send("h " + json.dumps(row))
        stuck = self.stuck_for(now, b)
        if stuck and self.state == "wait":
            self._on_stuck(f"ulfmtrain: error: {row['where']}: its main thread has slept on a lock inside an MPI "
                           f"call for {stuck:.1f} s (at {where}: a deadlock inside the MPI library); bound {b:g} s: "
                           "it ends by SIGKILL so that its peers repair without it", b)
            return
        if stuck:
            self._on_stuck(f"ulfmtrain: error: {row['where']}: its main thread has not returned to ulfmtrain for "
                           f"{stuck:.1f} s and does not run (at {where}: a deadlock, a stuck DataLoader?); bound "
                           f"{b:g} s: it leaves as a failed rank", b)
            return
        if self.board is None:
            return
        if self.board.evicted(self.pid):     # declared hung, and it ran again before the SIGKILL came
            die_told(f"ulfmtrain: error: {row['where']} runs again after it was declared hung: it ends")
        self.board.write(row)
        if row["state"] == "wait" or row["straggler"]:    # (a rank that works reads nobody's rows)
            line = boards.judge(self.board, row)
            if line is not None:
                self._on_nobody(line)

    def run(self) -> None:
        while not self.done.wait(_interval(bound(self._comm()))):
            try:
                self.tick()
            except Exception as exc:     # the watch must never end a healthy rank; it says what went wrong once
                print(f"ulfmtrain: warning: the hang watch stopped: {exc!r}", file=sys.stderr, flush=True)
                return


def _interval(b: float) -> float:
    return min(0.5, max(0.05, b / 12))


_watch: Watch | None = None


def start() -> Watch | None:
    """Start this rank's watch, once (exits.arm_at_exit); None when it is off or not under mpirun."""
    global _watch
    from .. import _ftcoll
    from . import tether

    try:
        if _watch is not None or floor() is None:
            return _watch
        straggler()
    except ValueError as exc:        # bad input: one line, every rank alike
        print(f"ulfmtrain: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

    _watch = Watch(exits._wrapper, lambda: _ftcoll.progress() + steps.commits, _leave_stuck, _end_nobody)
    if tether.FD_ENV in os.environ:
        _watch.send = tether.send_line
    else:
        _watch.board = boards.Board(board_directory())
        exits.at_leave(stop)
    # A row from the first moment, not from the first tick: a warm rank (a fork) can train 25 steps before that
    # tick, and one stopped in them never wrote a row, so its peers never saw it frozen (they ended with status 3).
    publish()
    _watch.thread = threading.Thread(target=_watch.run, name="ulfmtrain-hang-watch", daemon=True)
    _watch.thread.start()
    return _watch


def publish() -> None:
    """Write this process's row now: at the watch's start, and when it becomes a member or a spare (comm.py), so
    that one frozen before its first tick is seen as what it is."""
    if _watch is None:
        return
    try:
        row = _watch.make_row(time.monotonic(), bound(_watch._comm()))
    except Exception:  # noqa: BLE001  # (a communicator half made): the next tick writes it
        return
    if _watch.send is not None:
        _watch.send("h " + json.dumps(row))
    elif _watch.board is not None:
        _watch.board.write(row)


def board_directory() -> str:
    """This job's board on this host: in the session directory of the host's PRRTE daemon (one per mpirun and
    host, the jobs it spawns included; PRRTE removes it at the end), else a folder named after the job."""
    session = os.environ.get("PMIX_SERVER_TMPDIR")
    if session and os.path.isdir(session):
        return os.path.join(session, "ulfmtrain-hang-board")
    return boards.directory_for(os.environ.get("PMIX_NAMESPACE", "").split("@")[0] or str(os.getppid()))


def stop() -> None:
    """The job is done (every member leaves): the watch ends, and this process's row leaves the board."""
    if _watch is None:
        return
    _watch.done.set()
    if _watch.thread is not None and _watch.thread is not threading.current_thread():
        _watch.thread.join(timeout=5.0)
    if _watch.board is not None:
        _watch.board.close(_watch.pid)


def _leave_stuck(line: str, b: float) -> None:
    """A hung rank (this one): one line, its own child processes (DataLoader workers: one may be what it waits
    for, and they would hold mpirun's output pipes) SIGKILLed, then the exit protocol as a failure (if every
    rank leaves, status 3), or SIGKILL where it is stuck inside MPI."""
    from . import exits

    assert _watch is not None
    _watch.done.set()
    print(line, file=sys.stderr, flush=True)
    for child in boards.children(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    if _watch.state == "wait":      # asleep on a lock inside MPI: the exit protocol's calls could wait on it too
        os.kill(os.getpid(), signal.SIGKILL)
    if exits.fault_tolerant():       # (without ULFM, mpirun ends the whole job on this exit)
        exits.leave(failed=True, bound=min(exits.FAILED_BOUND_S, max(b, 1.0)))
    os._exit(INIT_HANG_EXIT_CODE)


def _end_nobody(line: str) -> None:
    assert _watch is not None
    _watch.done.set()
    print(line, file=sys.stderr, flush=True)
    if _watch.board is not None:
        _watch.board.close(_watch.pid)
    os._exit(INIT_HANG_EXIT_CODE)


# A rank that makes no progress for a bound fails (and is failed) like a killed one: from the exit protocol's
# arming on (at the package's import in a rank).
exits.when_armed(start)
