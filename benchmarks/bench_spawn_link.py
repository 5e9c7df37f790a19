"""How fast does a respawned process talk to the ranks it joins, against two ranks of the launched job?

Open MPI's shared-memory transport (btl/sm) connects only the processes of
one job (`sm_add_procs` skips a peer whose job id differs), and every respawned
process is a job of its own (respawn.py).  So on one host a newcomer reaches
the survivors over TCP loopback.  This times a 2-process allreduce at several
sizes three ways, in two mpirun runs: two ranks of the launched job (shared
memory); the same two forced onto TCP (`--mca btl self,tcp`); and a rank with a
process it spawned.  Only the two processes measured run; the third waits by
test-and-sleep.

Usage: python benchmarks/bench_spawn_link.py [--sizes 4096 65536 1048576] [--reps 200] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "spawn_link"
CHILD = "_child"        # first argument of the spawned process
PAIRS = {"same_job_sm": "same job (shared memory)", "same_job_tcp": "same job, --mca btl self,tcp",
         "spawned": "with a spawned process"}


def _time_allreduce(comm: Any, sizes: list[int], reps: int, rounds: int) -> dict[int, float]:
    """Median microseconds of one float32 allreduce of each size (in bytes) between the members of comm."""
    import numpy as np

    out = {}
    for size in sizes:
        a = np.ones(size // 4, np.float32)
        b = np.empty_like(a)
        for _ in range(10):
            comm.Allreduce(a, b)
        per_round = []
        for _ in range(rounds):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(a, b)
            per_round.append((time.perf_counter() - t0) / reps * 1e6)
        out[size] = common.median(per_round)
    return out


def _idle_until(req: Any) -> None:
    while not req.Test():       # a waiting rank must not take a core from the two measured
        time.sleep(0.01)


def worker(argv: list[str]) -> None:
    """Rank 0 and 1: time their pair; then rank 0 spawns a process and times that pair (unless --no-spawn)."""
    from mpi4py import MPI

    out, sizes, reps, rounds, spawn = Path(argv[0]), [int(s) for s in argv[1].split(",")], int(argv[2]), \
        int(argv[3]), argv[4] == "spawn"
    world = MPI.COMM_WORLD
    res = {"same_job": _time_allreduce(world, sizes, reps, rounds)}
    if spawn:
        if world.Get_rank() == 0:
            inter = MPI.COMM_SELF.Spawn(sys.executable, [__file__, CHILD, *argv[1:4]], maxprocs=1)
            pair = inter.Merge(high=False)
            res["spawned"] = _time_allreduce(pair, sizes, reps, rounds)
            pair.Free()
            inter.Disconnect()
        _idle_until(world.Ibarrier())
    if world.Get_rank() == 0:
        common.write_json(out, res)
    common.finalize_rank()


def child(argv: list[str]) -> None:
    """The spawned process: take part in rank 0's timings, then leave."""
    from mpi4py import MPI

    inter = MPI.Comm.Get_parent()
    pair = inter.Merge(high=True)
    _time_allreduce(pair, [int(s) for s in argv[0].split(",")], int(argv[1]), int(argv[2]))
    pair.Free()
    inter.Disconnect()
    common.finalize_rank()


def plot(by_size: dict[int, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = sorted(by_size)
    for key, label in PAIRS.items():
        ax.plot(sizes, [by_size[s][key] for s in sizes], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("allreduce size (bytes), 2 processes on one host")
    ax.set_ylabel("µs per allreduce (median)")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20], help="bytes per allreduce")
    p.add_argument("--reps", type=int, default=200, help="allreduces per timed round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per size (the median is reported)")
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=300)
    args = p.parse_args(argv)
    if args.reps < 1 or args.rounds < 1 or min(args.sizes) < 4:
        p.error("need --reps >= 1, --rounds >= 1 and sizes of at least 4 bytes")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_spawn_link."))
    sizes = ",".join(str(s) for s in args.sizes)
    found: dict[str, dict[str, dict[str, float]]] = {}
    # --oversubscribe: the spawned process needs a slot beyond the two ranks.
    for run, extra, spawn in (("sm", ["--oversubscribe"], "spawn"), ("tcp", ["--mca", "btl", "self,tcp"], "no-spawn")):
        out = work / f"{run}.json"
        args_run = argparse.Namespace(**{**vars(args), "mpirun_arg": [*args.mpirun_arg, *extra]})
        cmd = common.worker_command(2, __file__, [str(out), sizes, str(args.reps), str(args.rounds), spawn],
                                    args_run)
        launch = common.run_mpi(cmd, args.timeout, work / f"{run}.log", done=out.exists)
        if not out.exists():
            print(f"the {run} run wrote no result (exit {launch.returncode}):\n{common.log_tail(launch.log)}",
                  file=sys.stderr)
            return 1
        found[run] = json.loads(out.read_text())
    by_size = {s: {"same_job_sm": found["sm"]["same_job"][str(s)], "same_job_tcp": found["tcp"]["same_job"][str(s)],
                   "spawned": found["sm"]["spawned"][str(s)]} for s in args.sizes}
    print(common.table(["bytes", *PAIRS.values(), "spawned / sm", "spawned / tcp"],
                       [[s, *(common.fmt(v[k], 4) for k in PAIRS), common.fmt(v["spawned"] / v["same_job_sm"]),
                         common.fmt(v["spawned"] / v["same_job_tcp"])] for s, v in by_size.items()]))
    big = max(args.sizes)
    headline = {"bytes": big, "spawned_over_same_job": by_size[big]["spawned"] / by_size[big]["same_job_sm"],
                "spawned_over_tcp": by_size[big]["spawned"] / by_size[big]["same_job_tcp"]}
    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(by_size, png)
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {"sizes": args.sizes, "reps": args.reps, "rounds": args.rounds},
        "headline": headline, "by_n": {"2": {str(s): v for s, v in by_size.items()}}, "plot": png.name,
        "units": "microseconds per allreduce, median of the rounds"})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        child(sys.argv[2:])
    else:
        common.entry(main, worker)
