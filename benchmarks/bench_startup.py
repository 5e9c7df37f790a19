"""How long do MPI_Init and MPI_Comm_spawn take with the launcher's flags, against Open MPI's default transports?

Open MPI 5.0.x's btl/ofi sleeps 1 s whenever it is closed
(`mca_btl_ofi_component_close`), and MPI_Init closes it wherever libfabric
offers it nothing, as on this machine.  So on one host the launcher leaves it
out (`--mca btl ^ofi`, launch.py).  This starts the same N-rank job both ways,
alternately, and times each rank's start (importing ulfmtrain runs MPI_Init) and rank 0's MPI_Comm_spawn of one
process (the first step of a respawn, and of reinit's recovery).

Usage: python benchmarks/bench_startup.py [--ranks 4] [--spawns 3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
T_IMPORT = time.time()
import common  # noqa: E402  (it imports ulfmtrain, which runs MPI_Init in a rank that mpirun started)

INIT_S = time.time() - T_IMPORT

from ulfmtrain.launching.launch import NO_OFI  # noqa: E402
from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "startup"
CHILD = "_child"          # first argument of a spawned process
VARIANTS = {"launcher": "launcher (--mca btl ^ofi)", "default": "Open MPI's default BTLs"}


def worker(argv: list[str]) -> None:
    """Every rank: report its MPI_Init (INIT_S); rank 0 then times `spawns` spawns of one process each."""
    from mpi4py import MPI

    out, spawns = Path(argv[0]), int(argv[1])
    world = MPI.COMM_WORLD
    inits = world.gather(INIT_S, root=0)
    if world.Get_rank() == 0:
        spawn_s = []
        for _ in range(spawns):
            t0 = time.perf_counter()
            inter = MPI.COMM_SELF.Spawn(sys.executable, ["-P", __file__, CHILD], maxprocs=1)
            spawn_s.append(time.perf_counter() - t0)
            inter.Barrier()
            inter.Disconnect()
        common.write_json(out, {"init_s": inits, "spawn_s": spawn_s})
    world.Barrier()
    common.finalize_rank()


def child() -> None:
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    parent.Barrier()
    parent.Disconnect()
    common.finalize_rank()


def without_flags(cmd: list[str]) -> list[str]:
    """The command with the launcher's `--mca btl ^ofi` taken out: Open MPI's default transports."""
    n = len(NO_OFI)
    for i in range(len(cmd) - n + 1):
        if tuple(cmd[i:i + n]) == NO_OFI:
            return cmd[:i] + cmd[i + n:]
    raise SystemExit("the launcher's command has no `--mca btl ^ofi` (a hostfile or a btl choice of yours?)")


def plot(found: dict[str, dict[str, list[float]]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = [("init_s", "import ulfmtrain + MPI_Init\n(slowest rank)"), ("spawn_s", "MPI_Comm_spawn of 1 process")]
    width = 0.38
    for j, (variant, label) in enumerate(VARIANTS.items()):
        ax.bar([i + j * width for i in range(len(keys))],
               [common.median(found[variant][k]) for k, _ in keys], width, label=label)
    ax.set_xticks([i + width / 2 for i in range(len(keys))], [k[1] for k in keys])
    ax.set_ylabel("seconds (median)")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks of the job (default 4)")
    p.add_argument("--spawns", type=int, default=3, help="spawns timed per job (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="jobs per variant, alternating (default 3)")
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=120)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.spawns < 1 or args.rounds < 1:
        p.error("need --ranks, --spawns and --rounds of at least 1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_startup."))
    # --oversubscribe: the spawned process needs a slot beyond the ranks.
    args.mpirun_arg = [*args.mpirun_arg, "--oversubscribe"]
    found: dict[str, dict[str, list[float]]] = {v: {"init_s": [], "spawn_s": [], "job_s": []} for v in VARIANTS}
    commands = {}
    for r in range(args.rounds):
        for variant in VARIANTS:
            out = work / f"{variant}{r}.json"
            cmd = common.worker_command(args.ranks, __file__, [str(out), str(args.spawns)], args)
            cmd = cmd if variant == "launcher" else without_flags(cmd)
            commands[variant] = common.portable(cmd)
            launch = common.run_mpi(cmd, args.timeout, work / f"{variant}{r}.log", done=out.exists)
            if not out.exists():
                print(f"the {variant} run wrote no result (exit {launch.returncode}):\n{common.log_tail(launch.log)}",
                      file=sys.stderr)
                return 1
            res = json.loads(out.read_text())
            found[variant]["init_s"].append(max(res["init_s"]))
            found[variant]["spawn_s"] += res["spawn_s"]
            found[variant]["job_s"].append(launch.wall_s)
    med = {v: {k: common.median(x) for k, x in d.items()} for v, d in found.items()}
    print(common.table(["", "import + MPI_Init (s)", "MPI_Comm_spawn (s)", "whole job (s)"],
                       [[VARIANTS[v], *(common.fmt(med[v][k]) for k in ("init_s", "spawn_s", "job_s"))]
                        for v in VARIANTS]))
    headline = {f"{k}_default_over_launcher": med["default"][k] / med["launcher"][k]
                for k in ("init_s", "spawn_s", "job_s")}
    headline.update({f"{k}_{v}": med[v][k] for v in VARIANTS for k in ("init_s", "spawn_s")})
    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(found, png)
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {"ranks": args.ranks, "spawns": args.spawns, "rounds": args.rounds},
        "headline": headline, "by_n": {str(args.ranks): found}, "commands": commands, "plot": png.name,
        "units": "seconds; MPI_Init of the slowest rank of each job, each spawn, each whole mpirun"})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        child()
    else:
        common.entry(main, worker)
