"""Where does the time from a rank's SIGKILL to the survivors' next committed step go?

One mpirun per repeat; a rank (a training process: torch imported, ulfmtrain's FaultTolerantComm) SIGKILLs
itself while the others are blocked in the next step's allreduce.  The chain, each link timed on its own:

1. kernel: the kill to the moment the dead process is reaped, seen by this driver polling /proc/PID.  Its
   parent, the PRRTE daemon, gets SIGCHLD only once the kernel has ended every thread and freed the address
   space (a torch process has many threads and a large one); `leader_exit_ms`, the main thread's end, comes first.
2. PRRTE + PMIx: gone to the survivor's MPI library knowing (`MPIX_Comm_get_failed` non-empty while it polls):
   the daemon's waitpid, its state machine, the PMIx event to every rank's PMIx client, Open MPI's handler.
3. ULFM's error: known to the pending collective failing (`MPI_ERR_PROC_FAILED`, or `MPI_ERR_REVOKED` where a
   peer saw it first and revoked).
4. ULFM's repair (the commit agree, revoke, shrink, agree) and ours (the step redone on the repaired
   communicator, the rest of FaultTolerantComm's bookkeeping), to the next committed step.

Two modes: `poll` (survivors poll a raw Iallreduce, so links 2 and 3 are seen apart; then FaultTolerantComm's
step repairs) and `block` (survivors block in FaultTolerantComm's allreduce, as training does: kill to error and
kill to next commit as a user sees them).  Times are wall clocks of one host.

Usage: python benchmarks/bench_detect.py [--ranks 4 8] [--repeats 5] [--modes poll block]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "detect"
MODES = ("poll", "block")
# Per-survivor links, in ms, in the order they happen (poll mode has all; block mode has no known_ms).
LINKS = ("leader_exit_ms", "kernel_ms", "pmix_ms", "ulfm_error_ms", "commit_agree_ms", "revoke_ms", "shrink_ms",
         "agree_ms", "redo_ms", "ours_ms")
TOTALS = ("kill_to_known_ms", "kill_to_error_ms", "error_to_commit_ms", "kill_to_commit_ms")


# --------------------------------------------------------------------------- worker (one rank)


def _poll_until_error(raw: Any, send: Any, recv: Any) -> tuple[float | None, float, int]:
    """Post an Iallreduce the victim never joins and poll it: (when the library knew of a failure, when the
    operation failed, its error class).  Whoever fails first revokes, as a ULFM program does."""
    from mpi4py import MPI

    req = raw.Iallreduce(send, recv)
    t_known = None
    while True:
        try:
            if req.Test():
                raise RuntimeError("the allreduce completed without the victim")
        except MPI.Exception as exc:
            t_error, err = time.time(), exc.Get_error_class()
            break
        if t_known is None:
            failed = raw.Get_failed()
            if failed.Get_size() > 0:
                t_known = time.time()
            failed.Free()
    raw.Revoke()
    return t_known, t_error, err


def worker(argv: list[str]) -> None:
    """Measure one failure on this rank and write out/rank<world rank>.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--count", type=int, default=1024)
    p.add_argument("--kill-delay", type=float, default=0.2)
    a = p.parse_args(argv)

    import numpy as np
    import torch  # noqa: F401  (the victim is a training process: its teardown is part of detection)
    from mpi4py import MPI

    from ulfmtrain.transport.comm import FaultTolerantComm

    ft = FaultTolerantComm()
    me = ft.world_rank
    raw = ft.comm.Dup()
    raw.Set_errhandler(MPI.ERRORS_RETURN)
    send = np.ones(a.count, dtype=np.float32)
    recv = np.empty_like(send)
    for _ in range(a.warmup):
        common.ft_step(ft, send, recv)
    raw.Barrier()
    if me == a.victim:
        common.write_json(a.out / "victim.json", {"pid": os.getpid()})
        # Sleep first so the survivors are already waiting in the next step and the driver watches this pid.
        time.sleep(a.kill_delay)
        common.write_json(a.out / "kill.json", {"world_rank": me, "t_kill": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)

    rec: dict[str, Any] = {"world_rank": me, "n": ft.size, "victim": a.victim, "mode": a.mode}
    if a.mode == "poll":
        t_known, t_error, err = _poll_until_error(raw, send, recv)
        rec.update(t_known=t_known, error=MPI.Get_error_string(err), proc_failed=err == MPI.ERR_PROC_FAILED)
    t_step = time.time()
    common.ft_step(ft, send, recv)          # the next step: FaultTolerantComm repairs and commits it
    t_back = time.time()
    if not ft.events:
        raise RuntimeError(f"rank {me}: the step after the kill completed without a repair")
    ev = ft.events[0]
    if a.mode == "block":
        t_error = ev.wall_error
    parts = ev.commit_agree_ms + ev.revoke_ms + ev.shrink_ms + ev.agree_ms + ev.redo_ms
    rec.update(t_error=t_error, t_step=t_step, t_back=t_back, removed=ev.removed, size_after=ev.size_after,
               correct=bool(np.all(recv == ft.size)), commit_agree_ms=ev.commit_agree_ms,
               revoke_ms=ev.revoke_ms, shrink_ms=ev.shrink_ms, agree_ms=ev.agree_ms, redo_ms=ev.redo_ms,
               # FaultTolerantComm's own time outside those: its bookkeeping, the failed attempt in poll mode
               ours_ms=(t_back - max(t_error, t_step)) * 1e3 - parts)
    common.write_json(a.out / f"rank{me}.json", rec)
    common.finalize_rank()


# --------------------------------------------------------------------------- driver


def _watch(out: Path, found: dict[str, float], stop: threading.Event) -> None:
    """Wait for the victim's pid, then poll /proc/PID: `t_leader` when its main thread is a zombie (its other
    threads may still be exiting, and the last one frees the address space), `t_reaped` when PID is gone: every
    thread ended, the daemon got SIGCHLD and reaped it.  Also the victim's thread count, seen alive."""
    pid = None
    while not stop.is_set() and pid is None:
        try:
            pid = json.loads((out / "victim.json").read_text())["pid"]
        except (OSError, ValueError):
            time.sleep(0.005)
    while not stop.is_set() and pid is not None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            found.setdefault("t_leader", time.time())
            found["t_reaped"] = time.time()
            return
        if fields[0] in ("Z", "X"):
            found.setdefault("t_leader", time.time())
        else:
            found["threads"] = int(fields[17])
        time.sleep(0.0002)          # 0.2 ms resolution, without taking a core from the ranks


def run_once(n: int, mode: str, repeat: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One mpirun with n ranks and one kill; the survivors' records and the victim's end."""
    out = work / f"{mode}_n{n}_r{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    victim = (n - 1 - repeat) % n       # vary who dies, rank 0 included
    argv = ["--out", str(out), "--victim", str(victim), "--mode", mode, "--warmup", str(args.warmup),
            "--count", str(args.count)]
    found: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(out, found, stop), daemon=True)
    watcher.start()
    launch = common.run_mpi(common.worker_command(n, __file__, argv, args), args.timeout, out / "mpirun.log",
                            done=lambda: len(list(out.glob("rank*.json"))) >= n - 1)
    stop.set()
    watcher.join()
    survivors = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(survivors) != n - 1 or "t_reaped" not in found:
        raise RuntimeError(f"{mode} n={n} repeat {repeat}: {len(survivors)} of {n - 1} survivors reported, "
                           f"victim's end seen: {'t_reaped' in found} (mpirun rc {launch.returncode}, "
                           f"{launch.wall_s:.0f} s); log tail:\n" + common.log_tail(launch.log))
    t_kill, t_gone = json.loads((out / "kill.json").read_text())["t_kill"], found["t_reaped"]
    for s in survivors:
        ms = {k: (s[k] - t_kill) * 1e3 for k in ("t_error", "t_back") if s.get(k) is not None}
        s["kernel_ms"] = (t_gone - t_kill) * 1e3
        s["leader_exit_ms"] = (found["t_leader"] - t_kill) * 1e3
        s["kill_to_error_ms"] = ms["t_error"]
        s["kill_to_commit_ms"] = ms["t_back"]
        s["error_to_commit_ms"] = ms["t_back"] - ms["t_error"]
        if s.get("t_known") is not None:      # poll mode, and this survivor knew before a revoke reached it
            s["kill_to_known_ms"] = (s["t_known"] - t_kill) * 1e3
            s["pmix_ms"] = (s["t_known"] - t_gone) * 1e3
            s["ulfm_error_ms"] = (s["t_error"] - s["t_known"]) * 1e3
    return {"repeat": repeat, "victim": victim, "victim_threads": found.get("threads"),
            "mpirun_s": launch.wall_s, "mpirun_rc": launch.returncode,
            "command": common.portable(launch.command, [(work, "$WORK")]), "survivors": survivors}


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Median and spread over every (repeat, survivor) that has the figure; the first survivor to know."""
    out: dict[str, Any] = {}
    for key in (*LINKS, *TOTALS):
        values = [s[key] for r in runs for s in r["survivors"] if key in s]
        if values:
            out[key] = common.summarize(values)
    firsts = [min(s["kill_to_error_ms"] for s in r["survivors"]) for r in runs]
    out["first_error_ms"] = common.summarize(firsts)
    out["revoked_first"] = sum(1 for r in runs for s in r["survivors"] if s.get("proc_failed") is False)
    out["all_correct"] = all(s["correct"] for r in runs for s in r["survivors"])
    return out


def plot(by: dict[str, dict[int, dict]], path: Path) -> None:
    """Stacked medians of the chain, one bar per mode and n."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    bars = [(mode, n) for mode in by for n in sorted(by[mode])]
    stack = [("kernel_ms", "kernel: process teardown"), ("pmix_ms", "PRRTE + PMIx event"),
             ("ulfm_error_ms", "ULFM: error in the pending op"), ("commit_agree_ms", "commit agree"),
             ("revoke_ms", "revoke"), ("shrink_ms", "shrink"), ("agree_ms", "agree"), ("redo_ms", "step redone"),
             ("ours_ms", "ulfmtrain's other")]
    for i, (mode, n) in enumerate(bars):
        s = by[mode][n]
        bottom = 0.0
        if mode == "block":      # no separate known time: the kernel, then kill -> error as one link
            parts = [("kernel_ms", s["kernel_ms"]["median"]),
                     ("pmix_ms", s["kill_to_error_ms"]["median"] - s["kernel_ms"]["median"])]
            parts += [(k, s[k]["median"]) for k, _ in stack[3:] if k in s]
        else:
            parts = [(k, s[k]["median"]) for k, _ in stack if k in s]
        for key, value in parts:
            label = dict(stack)[key] if i == 0 or (mode == "poll" and key == "ulfm_error_ms") else None
            ax.bar(i, value, bottom=bottom, color=f"C{[k for k, _ in stack].index(key)}", label=label)
            bottom += value
    ax.set_xticks(range(len(bars)), [f"{m}\nn={n}" for m, n in bars])
    ax.set_ylabel("ms from the SIGKILL (median)")
    ax.set_title("SIGKILL -> next committed step (block: kill -> error drawn as one link)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="values of n (each >= 2)")
    p.add_argument("--repeats", type=int, default=5, help="mpirun launches (one kill each) per n and mode")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--warmup", type=int, default=10, help="steps before the kill")
    p.add_argument("--count", type=int, default=1024, help="float32 elements in the allreduce")
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=180)
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error("every n must be >= 2: one rank dies and at least one survives")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_detect."))
    load_before = os.getloadavg()
    runs: dict[str, dict[int, list[dict]]] = {m: {} for m in args.modes}
    t0 = time.perf_counter()
    for n in args.ranks:
        for r in range(args.repeats):
            for mode in args.modes:        # interleaved, so both modes see the same load
                run = run_once(n, mode, r, work, args)
                runs[mode].setdefault(n, []).append(run)
                print(f"  {mode} n={n:<3} repeat {r + 1}/{args.repeats}: kill -> error "
                      f"{common.fmt(min(s['kill_to_error_ms'] for s in run['survivors']))} ms (first survivor), "
                      f"kill -> commit {common.fmt(common.median(s['kill_to_commit_ms'] for s in run['survivors']))}"
                      " ms (median survivor)", flush=True)
    by = {m: {n: summarize(runs[m][n]) for n in args.ranks} for m in args.modes}
    load_after = os.getloadavg()
    cores = os.cpu_count() or 1

    print(f"\nSIGKILL -> next committed step, per survivor: median [p25-p75] over {args.repeats} repeats x "
          f"survivors (ms); {cores} cores, load {load_before[0]:.1f} before, {load_after[0]:.1f} after"
          + ("; oversubscribed" if max(args.ranks) > cores else ""))
    heads = ["mode", "n", "leader exit", "kernel (reaped)", "PRRTE+PMIx", "ULFM error", "commit agree", "revoke",
             "shrink", "agree", "redo", "ours", "kill->error", "first error", "kill->commit"]
    rows = []
    for m in args.modes:
        for n in args.ranks:
            s = by[m][n]
            rows.append([m, n, *(common.spread(s[k]) if k in s else "-" for k in LINKS),
                         common.spread(s["kill_to_error_ms"]), common.fmt(s["first_error_ms"]["median"]),
                         common.spread(s["kill_to_commit_ms"])])
    print(common.table(heads, rows))

    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(by, png)
    headline = {f"{m} n={n}": {"kernel_ms": by[m][n]["kernel_ms"]["median"],
                               "kill_to_error_ms": by[m][n]["kill_to_error_ms"]["median"],
                               "kill_to_commit_ms": by[m][n]["kill_to_commit_ms"]["median"]}
                for m in args.modes for n in args.ranks}
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {k: v for k, v in vars(args).items() if k in ("ranks", "repeats", "modes", "warmup", "count")},
        "units": {"*_ms": "milliseconds per survivor, from wall clocks of one host"},
        "load": {"cores": cores, "loadavg_before": load_before, "loadavg_after": load_after,
                 "oversubscribed": max(args.ranks) > cores},
        "headline": headline, "by_n": {m: {str(n): by[m][n] for n in args.ranks} for m in args.modes},
        "runs": {m: {str(n): runs[m][n] for n in args.ranks} for m in args.modes}, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t0})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main, worker)
