"""`python -m ulfmtrain demo`: the same job with and without a SIGKILL, side by side."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .events import Event, loss_curve, read_rank_logs, select
from .faults import mid_run_kill
from .job import DEFAULT_BATCH, TrainConfig, TrainJob
from .launch import mpirun_command
from .plots import plot_loss


@dataclass
class DemoOptions:
    """What `demo` runs (its flags, see cli.py)."""

    out: str = "ulfmtrain-demo"
    ranks: int = 4
    epochs: int = 20
    kill: str | None = None      # default: rank 1, mid-epoch, about 60 % in
    model: str = "cnn"
    timeout: float = 600.0


RECOVERY_PARTS = ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms", "redo_ms", "reload_ms")


def _run(label: str, out: Path, data: Path, args: DemoOptions, kills: list[str]) -> dict:
    import subprocess

    run_dir = out / label
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = TrainJob(data=data, out=run_dir, model=args.model, kill_specs=kills,
                    config=TrainConfig(epochs=args.epochs)).to_argv()
    print(f"== {label}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(mpirun_command(args.ranks, argv), timeout=args.timeout, check=False)
    wall = time.perf_counter() - t0
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the {label} run wrote no summary.json: see {run_dir}/rank*.jsonl")
    summary = json.loads(summary_path.read_text())
    summary["launch_wall_s"] = wall
    logs = read_rank_logs(run_dir)
    survivor = min(summary["alive"])
    summary["loss_curve"] = loss_curve(logs[survivor])
    summary["kill_steps"] = [r["step"] for r in select(logs, Event.KILL)]
    return summary


def _row(name: str, a: str, b: str) -> str:
    return f"  {name:<28}{a:>18}{b:>22}"


def run_demo(args: DemoOptions) -> int:
    from .data.format import DatasetFile, split_path
    from .data.sources import digits_to_dataset

    out = Path(args.out)
    data_dir = out / "data"
    if not split_path(data_dir, "train").exists():
        digits_to_dataset(data_dir)
    with DatasetFile(split_path(data_dir, "train")) as ds:
        n_train = ds.count
    kill = args.kill or mid_run_kill(n_train, args.ranks, DEFAULT_BATCH, args.epochs)

    clean = _run("failure-free", out, data_dir, args, [])
    faulty = _run("sigkill", out, data_dir, args, [kill])

    rec = faulty["recoveries"][0] if faulty["recoveries"] else {}
    print()
    print(f"ulfmtrain demo: {args.ranks} ranks, digits ({n_train} training records), {args.epochs} epochs, "
          f"kill {kill}")
    print(_row("", "failure-free", f"SIGKILL {kill}"))
    print(_row("final test accuracy", f"{clean['test_acc']:.4f}", f"{faulty['test_acc']:.4f}"))
    print(_row("wall time (training)", f"{clean['wall_s']:.2f} s", f"{faulty['wall_s']:.2f} s"))
    print(_row("steps", str(clean["steps"]), str(faulty["steps"])))
    print(_row("world sizes", str(clean["world_history"]), str(faulty["world_history"])))
    print(_row("replicas identical at end", str(clean["consistent"]), str(faulty["consistent"])))
    if rec:
        print("  recovery on the lowest survivor:")
        for k in RECOVERY_PARTS:
            print(_row(f"    {k[:-3]}", "", f"{rec.get(k, 0.0):.3f} ms"))
        total = sum(rec.get(k, 0.0) for k in RECOVERY_PARTS)
        print(_row("    total", "", f"{total:.3f} ms"))
        print(_row("    lost records", "", str(rec.get("lost_records", 0))))
        print(_row("    bytes reread (partial)", "", f"{rec.get('bytes_read', 0)} B"))
        print(_row("    a full reload would read", "", f"{rec.get('full_reload_bytes', 0)} B"))
    gap = (clean["test_acc"] - faulty["test_acc"]) * 100
    print(f"  accuracy gap: {gap:+.2f} points")

    report = {"kill": kill, "ranks": args.ranks, "epochs": args.epochs, "failure_free": clean, "sigkill": faulty,
              "accuracy_gap_points": gap}
    (out / "demo_report.json").write_text(json.dumps(report, indent=1))
    png = plot_loss({"SGD (failure-free)": clean["loss_curve"], f"FT-SGD (kill {kill})": faulty["loss_curve"]},
                    out / "demo_loss.png", {"kill": faulty["kill_steps"]},
                    title=f"digits, {args.ranks} ranks: SGD vs FT-SGD")
    print(f"  report: {out / 'demo_report.json'}  plot: {png}")
    return 0
