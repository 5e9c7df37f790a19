"""`python -m ulfmtrain supervise -n N -- train ...`: classic checkpoint-restart.

Each attempt is one mpirun.  In restart mode it runs without `--with-ft
ulfm`, as a plain MPI job does today: the first failure ends the job.  The
supervisor then relaunches it from the latest checkpoint with the same number
of ranks (or one fewer per failed rank, --relaunch fewer), until the training
completes or --max-attempts is reached.  It never touches checkpoint files;
it only decides whether to pass --resume.

OUT (the train command's --out) gets attempt-<k>/ per attempt,
supervisor.json (every attempt with its launch, failure-report and exit
times) and, on success, summary.json of the attempt that finished.
"""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..checkpoint.format import claim, has_checkpoint, read_pointer
from ..core.atomic import write_json
from ..core.events import Event, read_rank_logs, select
from ..training.config import TrainJob
from ..transport import jobtree
from ..transport.faults import Kill, parse_kills
from . import slurm, stopping
from .launch import mpirun_command, read_hostfile

PROG = "ulfmtrain supervise"
# How Open MPI's launcher reports a rank that died (prterun / mpirun).
_NOTICED = re.compile(r"noticed that process rank \d+")


class SuperviseError(Exception):
    """A supervise command line that cannot run."""


def _pump(src: Any, dst: Any, notice: list[float]) -> None:
    """Copy mpirun's output through, noting when it first reports a dead rank."""
    for line in iter(src.readline, ""):
        if not notice and _NOTICED.search(line):
            notice.append(time.time())
        dst.write(line)
        dst.flush()
    src.close()


def _started(run_dir: Path) -> bool:
    """Whether a rank of the attempt has written its start record (MPI is up, the job began)."""
    return bool(select(read_rank_logs(run_dir), Event.START))


def run_attempt(cmd: list[str], timeout: float | None, run_dir: Path | None = None,
                start_timeout: float | None = None,
                hosts_down: Callable[[], list[str]] | None = None) -> dict[str, Any]:
    """Run one mpirun; return its exit status and the times it was launched, reported a failure and exited.

    With start_timeout, an attempt whose ranks wrote no start record (in run_dir) within that many
    seconds is killed: a launch that hangs, as one does when a host goes down while its daemon starts.
    Until then hosts_down() is asked every second: a host that went down ends the attempt at once (PRRTE's
    launch would wait for its daemon until the start timeout).
    """
    t_launch = time.time()
    proc = stopping.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    notice: list[float] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, []), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, notice), daemon=True)]
    for t in pumps:
        t.start()
    timed_out = start_timed_out = False
    end = t_launch + timeout if timeout is not None else None
    # Until a start record appears: where to look for it, and by when.
    watching = run_dir if start_timeout is not None else None
    start_by = t_launch + (start_timeout or 0.0)
    probe_at, lost = t_launch + 1.0, []
    while True:
        left = None if end is None else max(0.0, end - time.time())
        if watching is not None:              # look for the start record twice a second
            left = 0.5 if left is None else min(0.5, left)
        try:
            rc = proc.wait(timeout=left)
            break
        except subprocess.TimeoutExpired:
            pass
        if watching is not None and _started(watching):
            watching = None                   # up: from here only the whole attempt's timeout applies
        elif watching is not None and time.time() >= start_by:
            start_timed_out = True
        elif watching is not None and hosts_down is not None and time.time() >= probe_at:
            lost, probe_at = hosts_down(), time.time() + 1.0
            start_timed_out = bool(lost)
        elif end is not None and time.time() >= end:
            timed_out = True
        if timed_out or start_timed_out:
            jobtree.end_tree(os.getpid())         # mpirun, its ranks (each in a process group of its own), theirs
            rc = proc.wait()
            break
    t_exit = time.time()
    for t in pumps:
        t.join(timeout=5)
    return {"rc": rc, "timed_out": timed_out, "start_timed_out": start_timed_out, "t_launch": t_launch,
            "t_failure_reported": notice[0] if notice else None, "t_exit": t_exit, "lost_in_launch": lost}


def down(hosts: list[str], is_up: Callable[[str], bool]) -> list[str]:
    """The hosts that do not answer the probe."""
    return [h for h in hosts if not is_up(h)]


def host_is_up(host: str, port: int = 22, timeout: float = 1.0) -> bool:
    """A TCP probe, as `ssh -o ConnectTimeout` would: an answer (even a refusal) means up, silence means down."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:                   # timed out, unreachable: a host that lost power or its link
        return False


def live_hostfile(hostfile: str, path: Path, port: int, timeout: float) -> tuple[int, list[str], list[str]]:
    """Probe the hostfile's hosts; write the live ones to path; return their slots, the live and the dead hosts."""
    lines, live, dead, slots = [], [], [], 0
    for host, n, line in read_hostfile(hostfile):
        if host_is_up(host, port, timeout):
            lines.append(line)
            live.append(host)
            slots += n
        else:
            dead.append(host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(x + "\n" for x in lines))
    return slots, live, dead


def supervise(n: int | None, job: TrainJob, *, max_attempts: int = 5, relaunch: str = "same",
              min_ranks: int = 1, timeout: float | None = None, mpirun_args: Sequence[str] = (),
              hostfile: str | None = None, probe_port: int = 22, probe_timeout: float = 1.0,
              start_timeout: float | None = 600.0, allocation: slurm.Allocation | None = None) -> int:
    """Run the train job until it completes, relaunching from the latest checkpoint; return an exit status.

    With a hostfile, each attempt runs on the hosts that answer a TCP probe, with
    as many ranks as they hold (at most n): a host that died is left out.  An
    attempt that fails before training starts is an error to fix, and is not
    relaunched, unless a host it ran on no longer answers: then a host died
    during the launch, and the next attempt leaves it out.  Inside a Slurm
    allocation (and no hostfile), the hosts are the allocation's nodes whose
    slurmd answers; a node lost once stays out for the rest of the job.
    """
    if n is None:
        if allocation is None:
            raise SuperviseError("supervise needs -n N (the number of ranks) outside a Slurm allocation")
        n = allocation.ranks(None, 0)
    if n < 1 or max_attempts < 1 or min_ranks < 1:
        raise SuperviseError("-n, --max-attempts and --min-ranks must be at least 1")
    if start_timeout is not None and start_timeout <= 0:
        raise SuperviseError(f"--start-timeout must be positive (got {start_timeout:g}); "
                             "it bounds how long a launch may take before training starts")
    if job.checkpoint.directory is None:
        raise SuperviseError("supervise relaunches from checkpoints: add --ckpt-dir DIR "
                             "(and --ckpt-every K or --ckpt-epoch) to the train command")
    kills: list[Kill] = parse_kills(job.kill_specs, n)
    out, ckpt = job.out, job.checkpoint.directory
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"ranks": n, "argv": job.to_argv(), "recovery": job.recovery, "relaunch": relaunch,
                              "max_attempts": max_attempts, "attempts": []}
    ranks = n
    if allocation is not None:
        port = slurm.slurmd_port(slurm.config())

        def is_up(host: str) -> bool:
            return slurm.node_is_up(host, port, probe_timeout)
    else:
        def is_up(host: str) -> bool:
            return host_is_up(host, probe_port, probe_timeout)
    excluded: set[str] = set()            # Slurm nodes lost so far: never used again by this job
    for attempt in range(1, max_attempts + 1):
        run_dir = out / f"attempt-{attempt}"
        resume = job.checkpoint.resume if attempt == 1 else has_checkpoint(ckpt)
        pointer = read_pointer(ckpt) if resume else None
        hosts, size = None, ranks
        live: list[str] = []              # the hosts this attempt runs on (with a hostfile)
        if allocation is not None:
            hosts = str(run_dir / "hostfile")
            live, dead = slurm.live_nodes(allocation, excluded, is_up)
            run_dir.mkdir(parents=True, exist_ok=True)
            Path(hosts).write_text(allocation.hostfile(exclude=excluded))
            slots = sum(k for node, k in zip(allocation.nodes, allocation.slots) if node in live)
        elif hostfile:
            hosts = str(run_dir / "hostfile")
            slots, live, dead = live_hostfile(hostfile, Path(hosts), probe_port, probe_timeout)
        if hosts is not None:
            if dead:
                print(f"{PROG}: hosts down, left out: {', '.join(dead)}", file=sys.stderr, flush=True)
            if slots < min_ranks:
                print(f"{PROG}: error: the live hosts hold {slots} slots, fewer than --min-ranks {min_ranks}",
                      file=sys.stderr, flush=True)
                return 1
            size = min(ranks, slots)      # a host of the hostfile that comes back is used again
        kills = [k for k in kills if k.rank < size]
        av = job.replace(out=run_dir, kill_specs=[str(k) for k in kills], checkpoint={"resume": resume}).to_argv()
        cmd = mpirun_command(size, av, hostfile=hosts, mpirun_args=mpirun_args, ft=job.recovery.fault_tolerant)
        try:
            claim(ckpt)                   # a rank of the attempt before that outlived its mpirun writes no more
        except OSError as exc:
            raise SuperviseError(f"checkpoint directory '{ckpt}' cannot be written ({exc.strerror}): "
                                 "pass a writable --ckpt-dir") from None
        print(f"{PROG}: attempt {attempt}/{max_attempts}: {size} ranks"
              + (f", resuming from {pointer['file']}" if pointer else ", from scratch" if not resume else ""),
              file=sys.stderr, flush=True)
        probe = functools.partial(down, list(live), is_up) if live else None
        res = run_attempt(cmd, timeout, run_dir, start_timeout, probe)
        logs = read_rank_logs(run_dir) if run_dir.exists() else {}
        fired = sorted({r["spec"] for r in select(logs, Event.KILL)})
        started = bool(select(logs, Event.START))
        summary_path = run_dir / "summary.json"
        summary: dict[str, Any] | None = json.loads(summary_path.read_text()) if summary_path.exists() else None
        done = summary is not None and summary.get("epochs") == job.config.epochs
        res.update(attempt=attempt, ranks=size, out=str(run_dir), argv=av, resume=resume, hostfile=hosts,
                   resumed_from=pointer["file"] if pointer else None, kills_fired=fired, completed=done)
        record["attempts"].append(res)
        record["completed"] = done
        write_json(out / "supervisor.json", record)
        if done and summary is not None:
            summary["attempts"] = len(record["attempts"])
            write_json(out / "summary.json", summary)
            print(f"{PROG}: training completed in attempt {attempt} "
                  f"({attempt - 1} relaunch{'es' if attempt != 2 else ''})", file=sys.stderr, flush=True)
            return 0
        why = ("timed out" if res["timed_out"] else
               f"host(s) {', '.join(res['lost_in_launch'])} down before any rank started"
               if res["lost_in_launch"] else
               f"no rank started within --start-timeout {start_timeout:g} s" if res["start_timed_out"] else
               f"kill {', '.join(fired)}" if fired else f"mpirun exit status {res['rc']}")
        lost = down(live, is_up) if not started else []
        if lost:                          # not the job's fault: a host died while it launched
            print(f"{PROG}: attempt {attempt} failed before training started ({why}); host(s) "
                  f"{', '.join(lost)} went down during its launch"
                  + (": relaunching without them" if attempt < max_attempts else ""), file=sys.stderr, flush=True)
            continue
        if not started and not fired:
            print(f"{PROG}: error: attempt {attempt} failed before training started ({why}): "
                  "fix the error above; not relaunching", file=sys.stderr, flush=True)
            return 2
        kills = [k for k in kills if str(k) not in fired]
        if relaunch == "fewer":
            ranks = max(min_ranks, ranks - max(1, len(fired)))
            dropped = [k for k in kills if k.rank >= ranks]
            if dropped:
                print(f"{PROG}: warning: dropping kill(s) {', '.join(map(str, dropped))}: "
                      f"those ranks do not exist with {ranks} ranks", file=sys.stderr, flush=True)
            kills = [k for k in kills if k.rank < ranks]
        if attempt < max_attempts:
            print(f"{PROG}: attempt {attempt} failed ({why})", file=sys.stderr, flush=True)
    print(f"{PROG}: error: giving up after {max_attempts} attempts (--max-attempts {max_attempts}); "
          f"see {out / 'supervisor.json'}", file=sys.stderr, flush=True)
    return 1


def main(n: int | None, job: TrainJob, **options: Any) -> int:
    """Entry point of `python -m ulfmtrain supervise` (options: supervise's keyword arguments); told to stop by
    a signal, it ends the attempt's whole job and returns 128 + its number (stopping.py)."""
    try:
        with stopping.stop_on_signals(PROG):
            return supervise(n, job, **options)
    except (SuperviseError, slurm.SlurmError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except stopping.Stopped as stop:
        return stop.status
