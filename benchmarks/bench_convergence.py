"""Does losing a rank mid-training change where FT-SGD converges, compared with failure-free SGD?

Reproduces paper 001, Fig. 6 (loss curves of SGD and FT-SGD with exactly one
SIGKILL after 300 batches) on the digits set with the real trainer
(`python -m ulfmtrain train`).  For each rank count:

- SGD: a failure-free run (the same code path; with no failure FT-SGD's
  arithmetic is plain data-parallel SGD);
- FT-SGD: one rank SIGKILLed at step --kill-step (or the nearest step the data
  allows) in the forward pass, at 25 %, 50 % and 75 % of its backward pass
  (the failure points of paper 000), and in the update, after the step's
  allreduce.

It plots loss per step and test accuracy per epoch of every run together and
reports the final test-accuracy gap to the failure-free run.

Usage: python benchmarks/bench_convergence.py [--ranks 4 8] [--steps 480] [--kill-step 300]
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "convergence"
# Forward and 25/50/75 % of backward: the issue's and paper 000's failure points; update: after the
# step's allreduce has completed everywhere, the one point where the dead rank's gradients count.
DEFAULT_PHASES = ("forward", "backward=0.25", "backward=0.5", "backward=0.75", "update")


def plan_epochs(records: int, n: int, batch: int, steps: int, kill_step: int) -> tuple[int, int, int]:
    """Return (epochs, steps per epoch, kill step) so a failure-free run takes about `steps` steps.

    The trainer counts epochs; steps per epoch follow from the largest shard.
    The kill moves earlier when the run is too short for it: it must leave at
    least one epoch after it, or there is nothing to see.
    """
    spe = math.ceil(math.ceil(records / n) / batch)
    epochs = max(2, math.ceil(steps / spe))
    total = epochs * spe
    return epochs, spe, max(1, min(kill_step, total - spe - 1))


def run_training(n: int, label: str, kill: str | None, data: Path, epochs: int, work: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Train once under mpirun; return the summary, curves and recovery event."""
    from ulfmtrain.core.events import loss_curve, read_rank_logs

    out = work / f"n{n}_{label}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--data", str(data), "--out", str(out), "--epochs", str(epochs), "--batch", str(args.batch),
            "--model", args.model, "--lr", str(args.lr), "--seed", str(args.seed), "--no-progress",
            "--finalize-timeout", "3"]
    if kill:
        argv += ["--kill", kill]
    launch = common.run_mpi(common.train_command(n, argv, args), args.timeout, work / f"n{n}_{label}.log",
                            done=lambda: (out / "summary.json").exists())
    if not (out / "summary.json").exists():
        raise RuntimeError(f"n={n} {label}: no summary.json (mpirun rc {launch.returncode}); log tail:\n"
                           + common.log_tail(launch.log))
    summary = json.loads((out / "summary.json").read_text())
    logs = read_rank_logs(out)
    lowest = min(summary["alive"])          # world rank 0 unless it was the victim
    epochs_rec = [r for r in logs[lowest] if r["event"] == "epoch" and r.get("test_acc") is not None]
    rec = summary["recoveries"][0] if summary["recoveries"] else None
    return {
        "label": label, "kill": kill, "test_acc": summary["test_acc"], "steps": summary["steps"],
        "world_history": summary["world_history"], "consistent": summary["consistent"],
        "train_wall_s": summary["wall_s"], "mpirun_s": launch.wall_s,
        "killed_at": [r["step"] for recs in logs.values() for r in recs if r["event"] == "kill"],
        "loss": loss_curve(logs[lowest]),
        "test_acc_per_epoch": [(r["step"], r["epoch"], r["test_acc"]) for r in epochs_rec],
        "recovery": {k: rec[k] for k in ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms",
                                         "redo_ms", "reload_ms", "bytes_read", "committed", "step")
                     if k in rec} if rec else None,
        "command": common.portable(launch.command, [(work, "$WORK")]),
    }


def smooth(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    """Trailing moving average of the loss: one rank's per-batch loss is noisy."""
    steps = [s for s, _ in points]
    vals = [v for _, v in points]
    out, acc = [], 0.0
    for i, v in enumerate(vals):
        acc += v
        if i >= window:
            acc -= vals[i - window]
        out.append(acc / min(i + 1, window))
    return steps, out


def plot(runs: dict[int, dict[str, dict]], plans: dict[int, tuple], path: Path) -> None:
    """Per rank count: loss (moving average) and test accuracy against step, every run together."""
    plt = pyplot()
    ns = sorted(runs)
    fig, axes = plt.subplots(len(ns), 2, figsize=(10, 3.4 * len(ns)), squeeze=False)
    for row, n in zip(axes, ns):
        _, spe, kill_step = plans[n]
        for i, (_label, r) in enumerate(runs[n].items()):
            # Distinct dashes: kills before the allreduce leave identical survivors, so those curves coincide.
            style = (dict(color="k", lw=1.4) if r["kill"] is None
                     else dict(color=f"C{i}", lw=1.0, ls=("-", "--", ":", "-.")[i % 4]))
            name = "SGD (failure-free)" if r["kill"] is None else f"FT-SGD, kill {r['kill']}"
            row[0].plot(*smooth(r["loss"], spe), label=name, **style)
            pts = r["test_acc_per_epoch"]
            # Per epoch, not per step: after a shrink an epoch takes more steps (same batch per rank).
            row[1].plot([p[1] + 1 for p in pts], [p[2] for p in pts], marker=".", label=name, **style)
        row[0].axvline(kill_step, color="red", ls="--", lw=0.8)
        row[1].axvline(kill_step / spe, color="red", ls="--", lw=0.8)
        row[0].set_xlabel("step")
        row[1].set_xlabel("epochs completed")
        for ax in row:
            ax.grid(True, alpha=0.3)
        row[0].set_yscale("log")
        row[0].set_ylabel(f"train loss, rank 0 (mean of {spe} steps)")
        row[0].set_title(f"{n} ranks: loss (kill at step {kill_step}, red)", fontsize=9)
        row[1].set_ylabel("test accuracy")
        row[1].set_title(f"{n} ranks: test accuracy per epoch", fontsize=9)
        lo = min(p[2] for r in runs[n].values() for p in r["test_acc_per_epoch"][len(r["test_acc_per_epoch"]) // 3:])
        row[1].set_ylim(max(0.0, lo - 0.02), 1.0)
        row[1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=480,
                   help="about how many steps a failure-free run takes (sets the epochs per rank count)")
    p.add_argument("--kill-step", type=int, default=300, help="global step of the SIGKILL (paper 001: 300)")
    p.add_argument("--phases", nargs="+", default=list(DEFAULT_PHASES),
                   help="where in the step the victim dies: forward, backward=FRAC, allreduce, update")
    p.add_argument("--victim", type=int, default=1, help="world rank that is killed")
    p.add_argument("--batch", type=int, default=16, help="batch per rank")
    p.add_argument("--model", default="cnn")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="where runs write (default: a temporary dir)")
    common.add_common_args(p, timeout=600)
    args = p.parse_args(argv)
    if min(args.ranks) <= args.victim:
        p.error(f"every rank count must be > the victim's rank {args.victim}")

    from ulfmtrain.data.format import DatasetFile, split_path
    from ulfmtrain.data.sources import digits_to_dataset

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convergence."))
    data = work / "digits"
    if not split_path(data, "train").exists():
        digits_to_dataset(data)
    with DatasetFile(split_path(data, "train")) as ds:
        records = ds.count

    runs: dict[int, dict[str, dict]] = {}
    plans: dict[int, tuple] = {}
    for n in args.ranks:
        epochs, spe, kill_step = plans[n] = plan_epochs(records, n, args.batch, args.steps, args.kill_step)
        runs[n] = {}
        variants = [("sgd", None)] + [(f"kill_{ph.replace('=', '')}", f"{args.victim}@{kill_step}:{ph}")
                                      for ph in args.phases]
        for label, kill in variants:
            r = runs[n][label] = run_training(n, label, kill, data, epochs, work, args)
            print(f"  n={n} {label:<18} {r['steps']:>4} steps, world {r['world_history']}, "
                  f"test acc {r['test_acc']:.4f}, {r['mpirun_s']:.0f} s", flush=True)
        base = runs[n]["sgd"]["test_acc"]
        for r in runs[n].values():
            r["gap_points"] = (base - r["test_acc"]) * 100

    print(f"\nFinal test accuracy on digits ({records} training records, batch {args.batch}/rank, model {args.model}); "
          "gap = failure-free minus FT-SGD, in points")
    rows = []
    for n in args.ranks:
        epochs, spe, kill_step = plans[n]
        for r in runs[n].values():
            rec = r["recovery"] or {}
            rows.append([n, "SGD (failure-free)" if r["kill"] is None else f"FT-SGD {r['kill']}", epochs,
                         r["steps"], "→".join(map(str, r["world_history"])), f"{r['test_acc']:.4f}",
                         f"{r['gap_points']:+.2f}" if r["kill"] else "", str(r["consistent"]),
                         common.fmt(rec.get("shrink_ms")), common.fmt(rec.get("reload_ms"))])
    print(common.table(["n", "run", "epochs", "steps", "world", "test acc", "gap (pts)", "replicas equal",
                        "shrink ms", "reload ms"], rows))

    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(runs, plans, png)
    gaps = {f"n={n}": {label: r["gap_points"] for label, r in runs[n].items() if r["kill"]} for n in args.ranks}
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {"ranks": args.ranks, "steps": args.steps, "kill_step": args.kill_step, "phases": args.phases,
                   "victim": args.victim, "batch": args.batch, "model": args.model, "lr": args.lr,
                   "seed": args.seed, "train_records": records},
        "plans": {str(n): {"epochs": e, "steps_per_epoch": s, "kill_step": k} for n, (e, s, k) in plans.items()},
        "headline": {"accuracy_gap_points": gaps,
                     "max_abs_gap_points": max(abs(g) for d in gaps.values() for g in d.values())},
        "by_n": {str(n): runs[n] for n in args.ranks}, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t_start})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main)
