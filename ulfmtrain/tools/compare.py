"""`python -m ulfmtrain compare`: one job and kill under shrink, restart, reinit and respawn: what a failure costs.

Every run trains the same model on the same data with the same seed and kill
schedule; lost_time.py splits each failure's cost into the same six parts.
Outputs in OUT: compare.json, compare.md (the tables), compare_timeline.png
(progress against wall time, kills marked) and compare_lost_time.png
(stacked bars of lost time per failure).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.atomic import write_json
from ..core.modes import CheckpointStrategy, Device, Recovery, Replace, choices
from ..training.config import DEFAULT_BATCH, CheckpointOptions, TrainConfig, TrainJob
from ..transport.faults import mid_run_kill
from .lost_time import CompareError, analyze, md_table, tables, text_table

PROG = "ulfmtrain compare"
RESPAWN = "respawn"                    # a row beside the recovery modes: shrink with --replace respawn
MODES = [*choices(Recovery), RESPAWN]


@dataclass
class CompareOptions:
    """What `compare` runs (its flags, see cli.py)."""

    out: str = "ulfmtrain-compare"
    data: str | None = None
    synthetic: float | None = None     # MiB of synthetic data instead of digits
    features: int = 1024
    model: str | None = None           # default: cnn on digits, mlp on synthetic data
    device: str = "cpu"
    ranks: int = 4
    epochs: int = 5
    batch: int = DEFAULT_BATCH
    seed: int = 0
    kill: list[str] | None = None
    ckpt_every: int = 20
    modes: str = ",".join(MODES)
    strategies: str = ",".join(choices(CheckpointStrategy))
    no_reference: bool = False
    max_attempts: int = 4
    timeout: float = 600.0
    spares: int = 0                    # > 0: a shrink run with this many hot spares too


# --------------------------------------------------------------------------- running


def _job(a: CompareOptions, data: Path, out: Path, kills: Sequence[str], mode: str,
         strategy: str | None, spares: int = 0, replacement: Replace = Replace.NONE) -> TrainJob:
    ckpt = (CheckpointOptions(out / "ckpt", a.ckpt_every, strategy=CheckpointStrategy(strategy)) if strategy
            else CheckpointOptions())
    return TrainJob(data=data, model=a.model or "cnn", out=out, kill_specs=list(kills), recovery=Recovery(mode),
                    spares=spares, replacement=replacement, device=Device(a.device),
                    config=TrainConfig(epochs=a.epochs, batch=a.batch, seed=a.seed, progress=False), checkpoint=ckpt)


def _run(label: str, cmd: list[str], shown: list[str], run_dir: Path, timeout: float) -> dict[str, Any]:
    """Run one job with its output in RUN_DIR/console.log; return its launch and exit times."""
    print(f"{PROG}: {label}: {shlex.join(shown)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    with open(run_dir / "console.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"t_launch": t_launch, "t_exit": time.time(), "rc": rc}  # rc None: timed out


def run_one(label: str, mode: str, strategy: str | None, a: CompareOptions, data: Path,
            kills: Sequence[str], spares: int = 0, replacement: Replace = Replace.NONE) -> dict[str, Any]:
    """Run the job in one mode and return its measurements."""
    from ..launching.launch import mpirun_command

    run_dir = Path(a.out) / label
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = _job(a, data, run_dir, kills, mode, strategy, spares, replacement).to_argv()
    if mode == Recovery.RESTART:
        shown = ["supervise", "-n", str(a.ranks), "--max-attempts", str(a.max_attempts), "--", *argv]
        safe = ["-P"] if getattr(sys.flags, "safe_path", False) else []   # started like this process
        cmd = [sys.executable, *safe, "-m", "ulfmtrain", *shown]
    else:
        shown = ["launch", "-n", str(a.ranks), "--", *argv]
        cmd = mpirun_command(a.ranks + spares, argv)
    times = _run(label, cmd, shown, run_dir, a.timeout)
    try:
        res = analyze(run_dir, mode, times)
    except CompareError as exc:
        res = {"ok": False, "error": str(exc)}
        print(f"{PROG}: warning: {label}: {exc}", file=sys.stderr, flush=True)
    res.update(label=label, mode=mode, strategy=strategy, command="python -m ulfmtrain " + shlex.join(shown))
    return res


# --------------------------------------------------------------------------- command


def _dataset(a: CompareOptions) -> tuple[Path, int]:
    from ..data.format import DatasetError, DatasetFile, dataset_paths, split_path
    from ..data.sources import digits_to_dataset, records_for_bytes, synthetic_dataset

    if a.data:
        d = Path(a.data)
        try:
            dataset_paths(d)
        except DatasetError as exc:
            raise CompareError(str(exc)) from None
    elif a.synthetic:
        d = Path(a.out) / f"synthetic-{a.synthetic:g}MiB"
        if not split_path(d, "train").exists():
            synthetic_dataset(split_path(d, "train"), records_for_bytes(int(a.synthetic * 2**20), a.features),
                              features=a.features, seed=a.seed)
    else:
        d = Path(a.out) / "data"
        if not split_path(d, "train").exists():
            digits_to_dataset(d)
    with DatasetFile(split_path(d, "train")) as ds:
        return d, ds.count


def run_compare(a: CompareOptions) -> dict[str, Any]:
    """Run every selected mode on the same job and write the report; return it."""
    from ..transport.faults import parse_kills
    from . import plots

    modes = [m for m in a.modes.split(",") if m]
    strategies = [s for s in a.strategies.split(",") if s]
    bad = ([m for m in modes if m not in MODES]
           + [s for s in strategies if s not in choices(CheckpointStrategy)])
    if bad or not modes:
        raise CompareError(f"unknown mode or strategy {bad[0] if bad else '(none)'}: "
                           "use --modes shrink,restart,reinit,respawn and --strategies blocking,overlapped")
    if ({Recovery.RESTART, Recovery.REINIT} & set(modes)) and (not strategies or a.ckpt_every < 0):
        raise CompareError("restart and reinit need a checkpoint strategy and --ckpt-every K >= 0")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data, count = _dataset(a)
    a.model = a.model or ("mlp" if a.synthetic else "cnn")
    kills = a.kill or [mid_run_kill(count, a.ranks, a.batch, a.epochs, a.ckpt_every)]
    parse_kills(kills, a.ranks)
    desc = (f"{a.model} on {'synthetic' if a.synthetic else 'digits' if not a.data else data.name} "
            f"({count} records), {a.ranks} ranks, {a.epochs} epochs, kill {', '.join(kills)}")
    report: dict[str, Any] = {
        "job": {"description": desc, "model": a.model, "data": str(data), "train_records": count, "ranks": a.ranks,
                "epochs": a.epochs, "batch": a.batch, "seed": a.seed, "kills": kills, "ckpt_every": a.ckpt_every},
        "runs": {}}
    plan: list[tuple[str, str, str | None, list[str]]] = []
    if not a.no_reference:
        plan.append(("failure-free", Recovery.SHRINK, None, []))
    for m in modes:
        if m == Recovery.SHRINK:
            plan.append((Recovery.SHRINK, Recovery.SHRINK, None, kills))
            if a.spares:
                plan.append((f"spares-{a.spares}", Recovery.SHRINK, None, kills))
        elif m == RESPAWN:
            plan.append((RESPAWN, Recovery.SHRINK, None, kills))
        else:
            plan += [(f"{m}-{s}", m, s, kills) for s in strategies]
    t_start = time.time()
    for label, mode, strategy, k in plan:
        report["runs"][label] = run_one(label, mode, strategy, a, data, k,
                                        a.spares if label.startswith("spares") else 0,
                                        Replace.RESPAWN if label == RESPAWN else Replace.NONE)
    report["elapsed_s"] = time.time() - t_start
    base = report["runs"].get("shrink", {})
    report["lost_ratio"] = {
        label: r["lost_per_failure_s"] / base["lost_per_failure_s"]
        for label, r in report["runs"].items()
        if r.get("ok") and r["failures"] and base.get("ok") and base.get("lost_per_failure_s")}
    ref = report["runs"].get("failure-free", {})
    for r in report["runs"].values():
        if r.get("ok") and ref.get("ok"):
            r["extra_time_vs_failure_free_s"] = r["time_to_target_s"] - ref["time_to_target_s"]
            r["checksum_equals_failure_free"] = r["checksum"] == ref["checksum"]
    report["checkpoint_stall_ms"] = {
        s: {label: r["checkpoint"]["stall_ms"] for label, r in report["runs"].items()
            if r.get("ok") and r.get("strategy") == s and r.get("checkpoint")} for s in strategies}

    h1, r1, h2, r2 = tables(report)
    write_json(out / "compare.json", report)
    md = [f"Job: {desc}.", "", md_table(h1, r1), "", "Lost time per failure:", "", md_table(h2, r2), ""]
    (out / "compare.md").write_text("\n".join(md))
    pngs = [plots.plot_timeline(report, out / "compare_timeline.png"),
            plots.plot_lost(report, out / "compare_lost_time.png")]
    print(f"\n{PROG}: {desc}\n")
    print(text_table(h1, r1))
    print("\nlost time per failure:\n")
    print(text_table(h2, r2))
    if report["lost_ratio"]:
        print("\nlost time per failure relative to shrink: "
              + ", ".join(f"{k} {v:.0f}x" for k, v in report["lost_ratio"].items() if k != "shrink"))
    print(f"\nreport: {out / 'compare.json'}, {out / 'compare.md'}, " + ", ".join(map(str, pngs)))
    return report


def main(args: CompareOptions) -> int:
    """Entry point of `python -m ulfmtrain compare`."""
    try:
        report = run_compare(args)
    except CompareError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r.get("ok") for r in report["runs"].values()) else 1
