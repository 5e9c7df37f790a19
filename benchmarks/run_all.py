"""Run the benchmarks one after the other and print their key figures (what `make bench` runs).

At the default sizes this takes about 15 minutes on a 2-core machine, plus bench_peers (about 23 minutes on the
shared 2-core box, and a one-time install of torchft into benchmarks/.venv-peers; `--only` leaves it out).
`--quick` runs each at its smallest size instead (the smoke tests use the same
settings), which takes about a minute.

Usage: python benchmarks/run_all.py [--results DIR] [--quick] [--only shrink reload ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SCRIPTS = {
    "shrink": "bench_shrink.py",
    "detect": "bench_detect.py",
    "reload": "bench_reload.py",
    "convergence": "bench_convergence.py",
    "overhead": "bench_overhead.py",
    "gpu": "bench_gpu.py",          # says so and measures nothing where there is no GPU
    "spawn_link": "bench_spawn_link.py",
    "startup": "bench_startup.py",
    "hang": "bench_hang.py",        # hang -> next commit at the default bound (60 s a run) and a short one
    "peers": "bench_peers.py",      # DDP+torchrun and torchft (its own virtualenv, made once) beside ulfmtrain
    "scale": "bench_scale.py",      # the fault path from 2 to 64 ranks (the C path; its long run: README)
}
# Left out of the default run (its full size takes an hour on 2 cores: benchmarks/README.md); --only runs it.
LONG = ("scale",)
# The smallest run of each benchmark that still exercises all of its code.
QUICK_ARGS = {
    "shrink": ["--ranks", "2", "--repeats", "1", "--iters", "3", "--warmup", "3"],
    "detect": ["--ranks", "2", "--repeats", "1", "--warmup", "3"],
    "reload": ["--mib", "1", "--ranks", "2", "--repeats", "1"],
    "convergence": ["--ranks", "2", "--steps", "20", "--kill-step", "12", "--phases", "backward=0.5"],
    "overhead": ["--ranks", "2", "--max-bytes", "16KiB", "--rounds", "2", "--target-s", "0.005",
                 "--models", "cnn", "--steps", "3", "--step-rounds", "2"],
    "gpu": ["--ranks", "2", "--batch", "16", "--steps", "2", "--rounds", "2"],
    "spawn_link": ["--sizes", "4096", "--reps", "5", "--rounds", "1"],
    "startup": ["--ranks", "2", "--spawns", "1", "--rounds", "1"],
    "hang": ["--repeats", "1", "--no-default", "--short", "3", "--kinds", "kill", "stop", "--epochs", "2",
             "--kill-step", "20", "--parts", "hang"],
    "peers": ["--repeats", "1", "--epochs", "3", "--kill-step", "12", "--ckpt-every", "8", "--phases", "between",
              "--configs", "ddp+torchrun", "ulfmtrain shrink", "--no-torchft",
              "--no-failure-free"],
    "scale": ["--ranks", "2", "--repeats", "1", "--iters", "3", "--held-comms", "3"],
}


def headline(results: Path, name: str) -> str:
    """One line per key figure, from the benchmark's JSON."""
    if not (results / f"{name}.json").exists():
        return "nothing measured (see its output)"
    d = json.loads((results / f"{name}.json").read_text())
    h = d["headline"]
    if name == "shrink":
        return "shrink ms (median survivor): " + ", ".join(
            f"{k} {v['shrink_ms']:.2f} (whole recovery {v['recovery_ms']:.2f})" for k, v in h.items())
    if name == "detect":
        return "kill -> first error / kill -> next commit, ms (median survivor): " + ", ".join(
            f"{k} {v['kill_to_error_ms']:.1f} / {v['kill_to_commit_ms']:.1f} (kernel {v['kernel_ms']:.1f})"
            for k, v in h.items())
    if name == "reload":
        return "partial/full reload time (slowest survivor): " + ", ".join(
            f"{k} {v['partial_over_full_time']:.3f}" for k, v in h.items())
    if name == "convergence":
        return "final accuracy gap, points (failure-free minus FT-SGD): " + "; ".join(
            f"{n}: " + ", ".join(f"{k} {g:+.2f}" for k, g in gaps.items())
            for n, gaps in h["accuracy_gap_points"].items())
    if name == "gpu":
        return ("FT-SGD overlapped / DDP-gloo step throughput: "
                + ", ".join(f"n={k} {v:.3f}" for k, v in h["ftsgd_overlap_over_ddp_gloo"].items())
                + "; overlapped step / max(compute, allreduce): "
                + ", ".join(f"n={k} {v:.3f}" for k, v in h["overlap_over_max_compute_allreduce"].items()))
    if name == "spawn_link":
        return (f"{h['bytes']} B allreduce with a spawned process / two ranks of one job: "
                f"{h['spawned_over_same_job']:.2f} (over TCP as it is: {h['spawned_over_tcp']:.2f})")
    if name == "startup":
        return (f"Open MPI's default BTLs / the launcher's: MPI_Init {h['init_s_default_over_launcher']:.1f}x, "
                f"MPI_Comm_spawn {h['spawn_s_default_over_launcher']:.1f}x, "
                f"whole job {h['job_s_default_over_launcher']:.1f}x")
    if name == "hang":
        return "failure -> next committed step, s: " + ", ".join(
            f"{k} {v:.3g}" for k, v in h["next_commit_s"].items()) + (
            f"; a straggler evicted / kept: {h['straggler_evicted_over_kept']:.2f}x the training time"
            if "straggler_evicted_over_kept" in h else "")
    if name == "scale":
        return "kill -> step committed / respawn join, ms (slowest rank): " + ", ".join(
            f"{k} {v['kill_to_commit_ms']:.1f} / {v['join_ms']:.1f}" for k, v in h.items())
    if name == "peers":
        return ("failure-free step / DDP: " + ", ".join(f"{k} {v:.2f}" for k, v in h["step_over_ddp"].items())
                + "\n    kill -> next committed step, s: "
                + ", ".join(f"{k} {v:.3g}" for k, v in h["kill_to_next_commit_s"].items()))
    ratios = h["ft_over_mpi_throughput"]
    return ("FT/plain MPI allreduce throughput: " + "; ".join(
        f"{n}: " + ", ".join(f"{b} {r:.3f}" for b, r in rs.items()) for n, rs in ratios.items())
        + "\n    FT-SGD/DDP-gloo step throughput: "
        + ", ".join(f"{k} {v:.3f}" for k, v in h["ftsgd_over_ddp"].items()))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=common.DEFAULT_RESULTS)
    p.add_argument("--quick", action="store_true", help="smallest sizes (a smoke run, not a measurement)")
    p.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=[k for k in SCRIPTS if k not in LONG])
    args = p.parse_args(argv)

    t_all = time.perf_counter()
    failed = []
    for name in args.only:
        cmd = [sys.executable, str(common.HERE / SCRIPTS[name]), "--results", str(args.results)]
        cmd += QUICK_ARGS[name] if args.quick else []
        print(f"\n=== {name}: {common.portable(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        print(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)

    print(f"\nAll benchmarks: {time.perf_counter() - t_all:.0f} s; results in {args.results}")
    for name in args.only:
        if name not in failed:
            print(f"  {name}: {headline(args.results, name)}")
    if failed:
        print(f"  FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
