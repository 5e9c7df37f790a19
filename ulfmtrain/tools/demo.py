"""`python -m ulfmtrain demo`: the same job with and without a SIGKILL, side by side."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.atomic import write_json
from ..core.events import Event, loss_curve, read_rank_logs, select
from ..core.modes import Device
from ..launching.launch import mpirun_command
from ..training.config import DEFAULT_BATCH, TrainConfig, TrainJob
from ..transport.faults import mid_run_kill
from .plots import plot_loss


@dataclass
class DemoOptions:
    """What `demo` runs (its flags, see cli.py)."""

    out: str = "ulfmtrain-demo"
    ranks: int = 4
    epochs: int = 20
    kill: str | None = None      # default: rank 1, mid-epoch, about 60 % in
    model: str = "cnn"
    device: str = "cpu"
    timeout: float = 600.0
    spares: int = 0              # > 0: a third run with hot spares, to end where the failure-free run ends


RECOVERY_PARTS = ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms", "redo_ms", "reload_ms",
                  "handover_ms")


def _run(label: str, out: Path, data: Path, args: DemoOptions, kills: list[str], spares: int = 0) -> dict:
    import subprocess

    run_dir = out / label
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = TrainJob(data=data, out=run_dir, model=args.model, kill_specs=kills, spares=spares,
                    device=Device(args.device), config=TrainConfig(epochs=args.epochs)).to_argv()
    print(f"== {label}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(mpirun_command(args.ranks + spares, argv), timeout=args.timeout, check=False)
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


def _row(name: str, *cells: str) -> str:
    return f"  {name:<28}" + "".join(f"{c:>22}" for c in cells)


def run_demo(args: DemoOptions) -> int:
    from ..data.format import DatasetFile, split_path
    from ..data.sources import digits_to_dataset

    out = Path(args.out)
    data_dir = out / "data"
    if not split_path(data_dir, "train").exists():
        digits_to_dataset(data_dir)
    with DatasetFile(split_path(data_dir, "train")) as ds:
        n_train = ds.count
    kill = args.kill or mid_run_kill(n_train, args.ranks, DEFAULT_BATCH, args.epochs)

    runs = {"failure-free": _run("failure-free", out, data_dir, args, []),
            f"SIGKILL {kill}": _run("sigkill", out, data_dir, args, [kill])}
    if args.spares:
        runs[f"+{args.spares} spare, SIGKILL"] = _run("spares", out, data_dir, args, [kill], args.spares)
    clean, faulty = runs["failure-free"], runs[f"SIGKILL {kill}"]

    print()
    print(f"ulfmtrain demo: {args.ranks} ranks, digits ({n_train} training records), {args.epochs} epochs, "
          f"kill {kill}")
    rs = list(runs.values())
    print(_row("", *runs))
    print(_row("final test accuracy", *(f"{r['test_acc']:.4f}" for r in rs)))
    print(_row("wall time (training)", *(f"{r['wall_s']:.2f} s" for r in rs)))
    print(_row("steps", *(str(r["steps"]) for r in rs)))
    print(_row("world sizes", *(str(r["world_history"]) for r in rs)))
    print(_row("replicas identical at end", *(str(r["consistent"]) for r in rs)))
    print(_row("final checksum", *(f"{r['checksum']:08x}" for r in rs)))
    recs = [r["recoveries"][0] if r["recoveries"] else {} for r in rs]
    if any(recs):
        print("  recovery on the lowest survivor:")
        for k in RECOVERY_PARTS:
            print(_row(f"    {k[:-3]}", *(f"{rec[k]:.3f} ms" if k in rec else "" for rec in recs)))
        print(_row("    total", *(f"{sum(rec.get(k, 0.0) for k in RECOVERY_PARTS):.3f} ms" if rec else ""
                                  for rec in recs)))
        for label, key in (("lost records", "lost_records"), ("bytes reread (partial)", "bytes_read"),
                           ("a full reload would read", "full_reload_bytes")):
            print(_row(f"    {label}", *(str(rec[key]) if key in rec else "" for rec in recs)))
    gap = (clean["test_acc"] - faulty["test_acc"]) * 100
    print(f"  accuracy gap: {gap:+.2f} points")
    if args.spares:
        same = runs[f"+{args.spares} spare, SIGKILL"]["checksum"] == clean["checksum"]
        print(f"  with a spare the run ends {'bit-identical to' if same else 'DIFFERENT from'} the failure-free run")

    report = {"kill": kill, "ranks": args.ranks, "epochs": args.epochs, "runs": runs,
              "accuracy_gap_points": gap}
    write_json(out / "demo_report.json", report)
    png = plot_loss({"SGD (failure-free)": clean["loss_curve"], f"FT-SGD (kill {kill})": faulty["loss_curve"]},
                    out / "demo_loss.png", {"kill": faulty["kill_steps"]},
                    title=f"digits, {args.ranks} ranks: SGD vs FT-SGD")
    print(f"  report: {out / 'demo_report.json'}  plot: {png}")
    return 0
