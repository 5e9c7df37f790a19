"""How long does one rank failure stop the job, and how does that grow with the rank count?

Reproduces paper 001, Fig. 9 (cumulative MPI_Comm_shrink overhead against the
number of nodes) on ulfmtrain's fault path.  For each n, one mpirun per repeat:

1. failure-free reference, as the ULFM authors' benchagree/benchshrink report it
   ("BEFORE_FAILURE"): the mean time of one MPIX_Comm_agree and of one
   MPIX_Comm_shrink on the healthy communicator;
2. a few warm-up FaultTolerantComm.allreduce calls, then one rank SIGKILLs
   itself while the others are blocked in the next allreduce;
3. every survivor reports what FaultTolerantComm.events saw: detection (kill to
   the first error), revoke, shrink, agree, the tag exchange, the first
   successful allreduce on the shrunk communicator, and the whole recovery as
   the trainer sees it (first error to the allreduce returning);
4. the same agree/shrink reference again on the shrunk communicator
   ("AFTER_FAILURE").

Usage: python benchmarks/bench_shrink.py [--ranks 2 4 8 16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "shrink"
# Per-survivor quantities, in ms, in the order they happen.
PHASES = ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms", "redo_ms", "recovery_ms", "total_ms")
REFERENCE = ("agree_ff_us", "shrink_ff_us", "agree_after_us", "shrink_after_us")


# --------------------------------------------------------------------------- worker (one rank)


def _time_ops(op, iters: int) -> dict[str, float]:
    """Time `iters` calls of op() one by one, as benchagree/benchshrink do (µs)."""
    from mpi4py import MPI

    samples = []
    for _ in range(iters):
        t = MPI.Wtime()
        op()
        samples.append((MPI.Wtime() - t) * 1e6)
    return common.summarize(samples)


def _references(comm, iters: int) -> tuple[dict, dict]:
    """Failure-free agree and shrink on comm: mean, stdev and median per op (µs)."""
    comm.Barrier()
    agree = _time_ops(lambda: comm.Agree(1), iters)
    comm.Barrier()
    made = []
    shrink = _time_ops(lambda: made.append(comm.Shrink()), iters)
    for c in made:
        c.Free()
    return agree, shrink


def worker(argv: list[str]) -> None:
    """Measure one failure on this rank and write out/rank<world rank>.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--count", type=int, default=1024)
    p.add_argument("--kill-delay", type=float, default=0.05)
    a = p.parse_args(argv)

    import numpy as np

    from ulfmtrain.transport.comm import FaultTolerantComm

    ft = FaultTolerantComm()
    me, n = ft.world_rank, ft.size
    rec: dict[str, Any] = {"world_rank": me, "n": n, "victim": a.victim}
    agree_ff, shrink_ff = _references(ft.comm, a.iters)
    rec.update(agree_ff=agree_ff, shrink_ff=shrink_ff)

    send = np.ones(a.count, dtype=np.float32)
    recv = np.empty_like(send)
    for _ in range(a.warmup):
        common.ft_step(ft, send, recv)

    if me == a.victim:
        # Sleep first so the survivors are already blocked in the next allreduce:
        # detection is then measured in steady state, and no survivor is still
        # leaving the last one (a plain Barrier here would meet the revoke).
        time.sleep(a.kill_delay)
        common.write_json(a.out / "kill.json", {"world_rank": me, "t_kill": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)

    t_call = time.time()
    common.ft_step(ft, send, recv)
    t_back = time.time()
    if not ft.events:
        raise RuntimeError(f"rank {me}: the allreduce after the kill completed without a recovery")
    ev = ft.events[0]
    kill = json.loads((a.out / "kill.json").read_text())
    rec.update(
        committed=ev.committed, size_after=ev.size_after, removed=ev.removed,
        rounds=ev.shrinks, correct=bool(np.all(recv == ft.size)),
        # Wall clocks of one host agree; across hosts this is only as good as their clock sync.
        detect_ms=(ev.wall_error - kill["t_kill"]) * 1e3,
        detect_in_call_ms=ev.detect_ms, revoke_ms=ev.revoke_ms, shrink_ms=ev.shrink_ms,
        agree_ms=ev.agree_ms, commit_agree_ms=ev.commit_agree_ms, redo_ms=ev.redo_ms,
        recovery_ms=(t_back - ev.wall_error) * 1e3, total_ms=(t_back - kill["t_kill"]) * 1e3,
        call_ms=(t_back - t_call) * 1e3,
    )
    agree_after, shrink_after = _references(ft.comm, a.iters)
    rec.update(agree_after=agree_after, shrink_after=shrink_after)
    common.write_json(a.out / f"rank{me}.json", rec)
    common.finalize_rank()


# --------------------------------------------------------------------------- driver


def run_once(n: int, repeat: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One mpirun with n ranks and one kill; return the survivors' records."""
    out = work / f"n{n}_r{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    victim = (n - 1 - repeat) % n       # vary who dies, rank 0 (the tag-exchange root on ties) included
    argv = ["--out", str(out), "--victim", str(victim), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--count", str(args.count)]
    launch = common.run_mpi(common.worker_command(n, __file__, argv, args), args.timeout, out / "mpirun.log",
                            done=lambda: len(list(out.glob("rank*.json"))) >= n - 1)
    survivors = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(survivors) != n - 1:
        raise RuntimeError(f"n={n} repeat {repeat}: {len(survivors)} of {n - 1} survivors reported "
                           f"(mpirun rc {launch.returncode}, {launch.wall_s:.0f} s); log tail:\n"
                           + common.log_tail(launch.log))
    return {"repeat": repeat, "victim": victim, "mpirun_s": launch.wall_s,
            "command": common.portable(launch.command, [(work, "$WORK")]), "survivors": survivors}


def summarize_n(runs: list[dict]) -> dict[str, Any]:
    """Median and spread over every (repeat, survivor); the slowest survivor per repeat, then its median."""
    out: dict[str, Any] = {}
    for key in PHASES:
        out[key] = common.summarize(s[key] for r in runs for s in r["survivors"])
        out[key]["slowest_median"] = common.median(max(s[key] for s in r["survivors"]) for r in runs)
    for key in ("agree_ff", "shrink_ff", "agree_after", "shrink_after"):
        # benchagree/benchshrink report each rank's mean per op; summarize those means.
        out[key + "_us"] = common.summarize(s[key]["mean"] for r in runs for s in r["survivors"])
    out["committed"] = sorted({s["committed"] for r in runs for s in r["survivors"]})
    out["all_correct"] = all(s["correct"] for r in runs for s in r["survivors"])
    return out


def plot(by_n: dict[int, dict], path: Path) -> None:
    """Time against n: recovery phases (median, quartile bars) and the failure-free references."""
    plt = pyplot()
    ns = sorted(by_n)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    series = [("total_ms", "kill → allreduce done", "k", 1.0),
              ("recovery_ms", "first error → allreduce done", "C0", 1.0),
              ("detect_ms", "detection (kill → first error)", "C1", 1.0), ("shrink_ms", "MPIX_Comm_shrink", "C2", 1.0),
              ("redo_ms", "step redone on new comm", "C4", 1.0), ("agree_ms", "agree (after shrink)", "C3", 1.0),
              ("shrink_ff_us", "shrink, no failure (benchshrink)", "C2", 1e-3),
              ("agree_ff_us", "agree, no failure (benchagree)", "C3", 1e-3)]
    for key, label, color, scale in series:
        med = [by_n[n][key]["median"] * scale for n in ns]
        lo = [(by_n[n][key]["median"] - by_n[n][key]["p25"]) * scale for n in ns]
        hi = [(by_n[n][key]["p75"] - by_n[n][key]["median"]) * scale for n in ns]
        style = ":" if key.endswith("_us") else "-"
        ax.errorbar(ns, med, yerr=[lo, hi], label=label, color=color, ls=style, marker="o", ms=3, capsize=2)
    ax.plot(ns, [by_n[n]["total_ms"]["slowest_median"] for n in ns], "k--", lw=0.8,
            label="kill → done, slowest survivor")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yscale("log")
    ax.set_xlabel("ranks before the failure (n)")
    ax.set_ylabel("time per survivor (ms)")
    ax.set_title("one SIGKILL: recovery cost against n (median, quartiles)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16], help="values of n (each >= 2)")
    p.add_argument("--repeats", type=int, default=5, help="mpirun launches (one kill each) per n")
    p.add_argument("--iters", type=int, default=20, help="failure-free agrees and shrinks timed per rank")
    p.add_argument("--warmup", type=int, default=20, help="allreduces before the kill")
    p.add_argument("--count", type=int, default=1024, help="float32 elements in the allreduce")
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=180)
    args = p.parse_args(argv)
    if min(args.ranks) < 2:
        p.error("every n must be >= 2: one rank dies and at least one survives")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_shrink."))
    runs: dict[int, list[dict]] = {}
    t0 = time.perf_counter()
    for n in args.ranks:
        runs[n] = []
        for r in range(args.repeats):
            runs[n].append(run_once(n, r, work, args))
            print(f"  n={n:<3} repeat {r + 1}/{args.repeats}: total "
                  f"{common.fmt(common.median(s['total_ms'] for s in runs[n][-1]['survivors']))} ms "
                  f"(median survivor)", flush=True)
    by_n = {n: summarize_n(runs[n]) for n in args.ranks}

    print(f"\nRecovery after one SIGKILL, per survivor: median [p25-p75] over {args.repeats} repeats x survivors (ms)")
    print(common.table(
        ["n", "detect", "commit agree", "revoke", "shrink", "agree", "redo", "recovery", "kill→done",
         "slowest kill→done"],
        [[n, *(common.spread(by_n[n][k]) for k in PHASES), common.fmt(by_n[n]["total_ms"]["slowest_median"])]
         for n in args.ranks]))
    print("\nFailure-free reference (benchagree/benchshrink): per-rank mean of one op, median [p25-p75] (µs)")
    print(common.table(["n", "agree", "shrink", "agree after (n-1)", "shrink after (n-1)"],
                       [[n, *(common.spread(by_n[n][k]) for k in REFERENCE)] for n in args.ranks]))

    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(by_n, png)
    headline = {f"n={n}": {"shrink_ms": by_n[n]["shrink_ms"]["median"],
                           "recovery_ms": by_n[n]["recovery_ms"]["median"],
                           "total_ms": by_n[n]["total_ms"]["median"]} for n in args.ranks}
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {k: v for k, v in vars(args).items() if k in ("ranks", "repeats", "iters", "warmup", "count")},
        "units": {"*_ms": "milliseconds per survivor", "*_us": "microseconds per operation"},
        "headline": headline, "by_n": {str(n): by_n[n] for n in args.ranks},
        "runs": {str(n): runs[n] for n in args.ranks}, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t0})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main, worker)
