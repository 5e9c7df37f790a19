"""The hang board: each process of a job says there, a few times a second, that it runs and what it waits for.

One directory per job on a host (mode 0700), one JSON row per process (`PID.json`), rewritten atomically by
that process's hang watch (hangs.py) at every tick.  A row holds its writer's pid and start time, host, rank,
role (member of the training communicator, waiting spare, other), the host's monotonic clock at the write
(the heartbeat), whether its main thread waits in ulfmtrain or works and for how long, the bound it applies,
and its own work per step.  Under `launch --agent` the rows travel to the head node through the tether and
each rank's agent writes its rank's row there, with the agent's own pid: killing the agent is how a rank on
another host is made to die by a signal (agent.py, tether.py).

What an observer (a rank, or an agent for its rank) decides from the board (`verdicts`, `nobody_comes`) is a
function of the rows alone, and every observer reads the same rows: the one writer of each row is the process
it describes.  A verdict is a SIGKILL, and killing a process twice is killing it once; a marker file
(`PID.evicted`, created exclusively) lets the first observer print the one line that says why.

Standard library only: agent.py loads this file by path (importing the package would initialize MPI there).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

Row = dict[str, Any]
_FILE = re.compile(r"(\d+)\.(json|tmp|evicted)")     # a board's files: PID.json, PID.tmp, PID.evicted
_WRITE_TRIES = 3      # a row is written again into a board re-made after the last process to leave removed it
STEPS_MEASURED = 16      # a straggler's slowness must hold over this many steps of its own (its median's window)
# ... and cost at least this share of a step: removing it must shorten the job's steps by half or more (a rank
# 3x slower in 1 ms of work within a 45 ms step is scheduler noise on a loaded machine, not worth a rank).
STRAGGLER_SHARE = 0.5
# (pid, start) -> (its CPU time in clock ticks, when it last changed on this observer's clock): a process that
# holds Python's lock in a long call runs without a heartbeat, one that is stopped does not run at all.
_last_ran: dict[tuple[int, Any], tuple[int, float]] = {}


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state is [0], utime [11], stime [12], start [19])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The child processes of pid in its process group (DataLoader workers; not a server it started in a group
    of its own, such as the fork server, whose death would end every process it forked)."""
    mine = _stat(pid)
    out = []
    for name in os.listdir("/proc"):
        fields = _stat(name) if name.isdigit() else None
        if fields and mine and int(fields[1]) == pid and fields[2] == mine[2]:
            out.append(int(name))
    return out


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, its identity."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def cpu_ticks(pid: int | str = "self") -> int:
    """CPU time the process used so far, every thread, in clock ticks (10 ms): user + system."""
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12]) if fields else 0


def directory_for(job: str) -> str:
    """The board of job `job` on this host: a folder in shared memory (or the temporary folder) of this user."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"ulfmtrain-{os.getuid()}-{job}")


class Board:
    """One job's rows on this host (a directory)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        # A process's row has two writers: its main thread (hangs.publish, as it becomes a member) and its hang
        # watch's thread; both through PID.tmp, whose rename the other would find gone.
        self._writing = threading.Lock()
        self._make()

    def _make(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)         # (a link put there by another user, to a folder of ours, is refused)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"the hang board {self.dir} is not this user's alone (a folder of mode 0700)")

    def _path(self, pid: int, suffix: str = "json") -> str:
        return os.path.join(self.dir, f"{pid}.{suffix}")

    def write(self, row: Row) -> None:
        """Publish `row` as the row of row["pid"] (write, then rename: a reader never sees half a row)."""
        tmp = self._path(row["pid"], "tmp")
        with self._writing:
            for attempt in range(_WRITE_TRIES):
                try:
                    with open(tmp, "w") as f:
                        json.dump(row, f)
                    break
                except FileNotFoundError:   # the last process to leave removed the board: this one is not gone
                    if attempt == _WRITE_TRIES - 1:
                        raise
                    self._make()
            os.replace(tmp, self._path(row["pid"]))

    def remove(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._path(pid))

    def rows(self) -> list[Row]:
        """Every row on the board, of live processes only (a row whose writer is gone is removed)."""
        out = []
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                if not name.endswith(".json"):
                    continue
                try:
                    with open(os.path.join(self.dir, name)) as f:
                        row = json.load(f)
                except (OSError, ValueError):
                    continue
                if start_time(row["pid"]) != row.get("start"):
                    self.remove(row["pid"])         # its writer died (or its pid is another process now)
                    continue
                out.append(row)
        return out

    def evicted(self, pid: int) -> float | None:
        """When pid was declared hung (time.time() of its marker), or None."""
        try:
            return os.stat(self._path(pid, "evicted")).st_mtime
        except OSError:
            return None

    def last_eviction(self) -> float:
        """time.time() of the latest eviction on this board (0 if none)."""
        with contextlib.suppress(OSError):
            return max((os.stat(os.path.join(self.dir, n)).st_mtime for n in os.listdir(self.dir)
                        if n.endswith(".evicted")), default=0.0)
        return 0.0

    def evict(self, row: Row, line: str) -> None:
        """Declare row's process hung: the first observer prints `line`; every observer SIGKILLs it (idempotent).
        Nothing happens to a pid that is another process now, or another user's."""
        if not _same(row["pid"], row["start"]):
            return
        try:
            fd = os.open(self._path(row["pid"], "evicted"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.write(fd, line.encode())
            os.close(fd)
            print(line, file=sys.stderr, flush=True)
        except FileExistsError:
            pass
        with contextlib.suppress(OSError):
            os.kill(row["pid"], signal.SIGKILL)

    def close(self, pid: int) -> None:
        """Remove pid's row; the last process to leave removes the board.  Only the files of processes that are
        gone go (a live one may be writing its first row, or have renamed it since rows() looked), and the board
        only once nothing else is in it (rmdir of a folder that is not empty fails)."""
        self.remove(pid)
        with contextlib.suppress(OSError):
            if not self.rows():
                for name in os.listdir(self.dir):
                    writer = _FILE.fullmatch(name)
                    if writer and (int(writer[1]) == pid or not os.path.exists(f"/proc/{writer[1]}")):
                        os.unlink(os.path.join(self.dir, name))
                os.rmdir(self.dir)


def _same(pid: int, start: int) -> bool:
    """pid is still the process that started at `start`, and this user's."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid() and start_time(pid) == start
    except OSError:
        return False


def _who(row: Row) -> str:
    rank = row.get("rank")
    role = row.get("role")
    name = "a waiting spare" if role == "spare" else f"world rank {rank}" if rank is not None else "a process"
    return f"{name} (pid {row['pid']} on {row['host']})"


def verdicts(me: Row, rows: list[Row], now: float) -> list[tuple[Row, str]]:
    """The processes `me` must evict, each with the line that says why; `now` is this host's monotonic clock.

    * frozen: while me waits in ulfmtrain, any process of the job on this host whose heartbeat is older than
      me's bound and that has used no CPU time for half of it (SIGSTOP, a frozen cgroup); one that holds
      Python's lock in a long call (loading a library) runs, and is not frozen (each call keeps the CPU clock of
      each process: an observer that starts waiting judges a process half a bound after it first saw it, or at
      once if that process has not run since it last looked);
    * straggler (me["straggler"], a factor, and me a member): a member whose own work per step, the median of
      its last STEPS_MEASURED steps, is more than that factor times the median of the other members', and more
      than theirs by STRAGGLER_SHARE of a step (me's median time between two commits).
    """
    out: list[tuple[Row, str]] = []
    bound, straggler = me["bound"], me.get("straggler")
    others = [r for r in rows if r["pid"] != me["pid"] and r["host"] == me["host"]]
    still = {r["pid"]: _not_run_for(r, now) for r in others}       # every turn: the CPU clock of each
    for key in set(_last_ran) - {(r["pid"], r["start"]) for r in others}:
        del _last_ran[key]
    if me["state"] == "wait":
        for r in others:
            idle = now - r["mono"]
            if idle > bound and still[r["pid"]] >= bound / 2:
                out.append((r, f"ulfmtrain: {_who(r)} has not run for {idle:.1f} s (frozen: SIGSTOP, a stuck "
                               f"host?) while {me['where']} waited for it; bound {bound:g} s: it is SIGKILLed so "
                               "that the others go on without it"))
    if straggler and me["role"] == "member":
        members = [r for r in [me, *others] if r["role"] == "member" and r["steps"] >= STEPS_MEASURED]
        for r in members:
            rest = [m["work"] for m in members if m is not r]
            if not rest or r in (x for x, _ in out):
                continue
            typical = statistics.median(rest)
            if typical > 0 and r["work"] > straggler * typical and r["work"] - typical > STRAGGLER_SHARE * me["step"]:
                out.append((r, f"ulfmtrain: {_who(r)} is a straggler: its own work per step takes {r['work']:.3g} s, "
                               f"{r['work'] / typical:.1f}x the median of its peers ({typical:.3g} s; straggler "
                               f"factor {straggler:g}): it is SIGKILLed so that the others go on without it"))
    return out


def _not_run_for(row: Row, now: float) -> float:
    """How long the row's process has used no CPU time, as far as this observer has seen: its own CPU time (this
    host), or what its tether last reported ("cpu_now", written by its agent under `launch --agent`)."""
    cpu = row["cpu_now"] if "cpu_now" in row else cpu_ticks(row["pid"])
    key = (row["pid"], row["start"])
    seen = _last_ran.get(key)
    if seen is None or seen[0] != cpu:
        _last_ran[key] = (cpu, now)
        return 0.0
    return now - seen[1]


def nobody_comes(me: Row, rows: list[Row]) -> bool:
    """Every member of the job on this board has waited in ulfmtrain past me's bound for it, none of them in a
    wait a watchdog of its own bounds (a spawn, a merge): nobody runs that could end the wait (a death nobody
    reported, or a fault path that never returns)."""
    return all(r["state"] == "wait" and r["for"] >= me["nobody"] and not r.get("bounded") for r in rows
               if r["role"] == "member" and r["host"] == me["host"])


def relay(board: Board, line: str, pid: int, start: int | None, host: str, cpu_now: int) -> Row:
    """An agent writes its rank's row (an "h {...}" line from the rank's host) as its own: its pid (the process
    to kill), its host and this host's clock; cpu_now, the rank's CPU time as its tether last saw it."""
    row = json.loads(line)
    row.update(pid=pid, start=start, host=host, mono=time.monotonic(), cpu_now=max(cpu_now, row["cpu"]))
    board.write(row)
    return row


def judge(board: Board, me: Row) -> str | None:
    """An observer's turn (a rank for itself, an agent for its rank): evict what verdicts says; return the line
    to end with when nobody comes, else None."""
    rows = board.rows()
    for other, line in verdicts(me, rows, time.monotonic()):
        board.evict(other, line)
    if me["role"] != "member" or me["state"] != "wait" or me["for"] < me["nobody"] or me.get("bounded"):
        return None
    if time.time() - board.last_eviction() < me["bound"]:
        return None             # an eviction within the bound: its repair is under way
    if me["spans_hosts"]:       # peers on other hosts are out of sight (the normal launch across hosts)
        return (f"ulfmtrain: error: {me['where']} has waited in ulfmtrain for {me['for']:.0f} s (bound "
                f"{me['nobody']:g} s) for a peer that may be on another host and hung: the job ends (status 3); "
                "`launch --agent` evicts a hung rank on another host instead")
    if nobody_comes(me, rows):
        return (f"ulfmtrain: error: {me['where']} and every rank of the job have waited in ulfmtrain for "
                f"{me['for']:.0f} s (bound {me['nobody']:g} s), none of them hung: a death that Open MPI did not "
                "report, or a fault path that never returns; the job ends (status 3). Resume it from a checkpoint "
                "(--ckpt-dir, under `ulfmtrain supervise`)")
    return None
