"""`python -m ulfmtrain compare`: the same job and kill under shrink, restart and reinit, and what a failure costs.

Every run trains the same model on the same data with the same seed and kill
schedule.  Lost time per failure is split into the same six parts for every
mode, from the timestamps the ranks (and the supervisor) log:

detection        the kill -> the first rank learns of it (restart: mpirun reports it)
mpi_recovery     revoke + shrink + agree (+ state sync); restart: tearing the job down
relaunch_init    restart: mpirun exit -> ranks up again (launch, imports, MPI_Init);
                 reinit: spawning and merging replacements, rebuilding the trainer
checkpoint_load  reading and verifying the checkpoint, broadcasting and applying it
data_reload      reading data again (shrink: the lost records only; others: every rank its whole shard)
replay           re-running the steps since the checkpoint (shrink: the interrupted allreduce)

Outputs in OUT: compare.json, compare.md (the tables), compare_timeline.png
(progress against wall time, kills marked) and compare_lost_time.png
(stacked bars of lost time per failure).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .checkpoint.checkpointer import STRATEGIES
from .faults import mid_run_kill
from .metrics import pyplot, save_figure

PROG = "ulfmtrain compare"
COMPONENTS = ("detection", "mpi_recovery", "relaunch_init", "checkpoint_load", "data_reload", "replay")
COMPONENT_LABELS = {"detection": "detection", "mpi_recovery": "MPI recovery", "relaunch_init": "relaunch/init",
                    "checkpoint_load": "checkpoint load", "data_reload": "data reload", "replay": "replayed steps"}
MODES = ("shrink", "restart", "reinit")


class CompareError(Exception):
    """A compare run that could not be carried out or measured."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The compare subcommand's flags."""
    p.add_argument("--out", default="ulfmtrain-compare", help="directory for the runs and the report")
    p.add_argument("--data", default=None, help="dataset directory (default: digits, created in OUT/data)")
    p.add_argument("--synthetic", type=float, default=None, metavar="MIB",
                   help="use a synthetic dataset of this many MiB instead of digits")
    p.add_argument("--features", type=int, default=1024, help="features per synthetic record")
    p.add_argument("--model", default=None, help="cnn, mlp or package.module:factory (default: cnn on digits, "
                                                  "mlp on synthetic data; ulfmtrain.compare:large_mlp is a "
                                                  "6.3 M-parameter MLP for synthetic data)")
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", action="append", default=None, metavar="RANK@STEP[:PHASE]",
                   help="kill schedule (repeatable; default: rank 1 about 60%% through, half-way between checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=20, metavar="K", help="checkpoint every K steps (restart, reinit)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of shrink,restart,reinit")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="checkpoint strategies to run restart and reinit with: blocking,overlapped")
    p.add_argument("--no-reference", action="store_true", help="skip the failure-free reference run")
    p.add_argument("--max-attempts", type=int, default=4, help="supervisor attempt limit of the restart runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")


def large_mlp() -> Any:
    """A 6.3 M-parameter MLP over 1024 features (50 MB checkpoints with momentum): `--model ulfmtrain.compare:large_mlp`."""
    from .models import MLP

    return MLP(1024, hidden=(2048, 2048), classes=10)


# --------------------------------------------------------------------------- running


def _train_argv(a: argparse.Namespace, data: Path, out: Path, kills: Sequence[str]) -> list[str]:
    return (["train", "--data", str(data), "--model", a.model, "--epochs", str(a.epochs), "--batch", str(a.batch),
             "--seed", str(a.seed), "--no-progress", "--out", str(out)]
            + [x for k in kills for x in ("--kill", k)])


def _run(label: str, cmd: list[str], shown: list[str], run_dir: Path, timeout: float) -> dict[str, float]:
    """Run one job with its output in RUN_DIR/console.log; return its launch and exit times."""
    print(f"{PROG}: {label}: {shlex.join(shown)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    with open(run_dir / "console.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"t_launch": t_launch, "t_exit": time.time(), "rc": rc}


def run_one(label: str, mode: str, strategy: str | None, a: argparse.Namespace, data: Path,
            kills: Sequence[str]) -> dict[str, Any]:
    """Run the job in one mode and return its measurements."""
    from .launch import mpirun_command

    run_dir = Path(a.out) / label
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = _train_argv(a, data, run_dir, kills) + ["--recovery", mode]
    if strategy:
        argv += ["--ckpt-dir", str(run_dir / "ckpt"), "--ckpt-every", str(a.ckpt_every),
                 "--ckpt-strategy", strategy]
    if mode == "restart":
        shown = ["supervise", "-n", str(a.ranks), "--max-attempts", str(a.max_attempts), "--", *argv]
        safe = ["-P"] if getattr(sys.flags, "safe_path", False) else []   # started like this process
        cmd = [sys.executable, *safe, "-m", "ulfmtrain", *shown]
    else:
        shown = ["launch", "-n", str(a.ranks), "--", *argv]
        cmd = mpirun_command(a.ranks, argv)
    times = _run(label, cmd, shown, run_dir, a.timeout)
    try:
        res = analyze(run_dir, mode, times)
    except CompareError as exc:
        res = {"ok": False, "error": str(exc)}
        print(f"{PROG}: warning: {label}: {exc}", file=sys.stderr, flush=True)
    res.update(label=label, mode=mode, strategy=strategy, command="python -m ulfmtrain " + shlex.join(shown))
    return res


# --------------------------------------------------------------------------- analysis


def _events(logs: dict[int, list[dict]], name: str) -> list[dict]:
    return sorted((r for recs in logs.values() for r in recs if r["event"] == name), key=lambda r: r["t"])


def _progress(logs_list: Sequence[dict[int, list[dict]]]) -> list[tuple[float, int, int]]:
    """(time, committed steps, world) of every step, as one rank saw it (the one that logged the most)."""
    out = []
    for logs in logs_list:
        if not logs:
            continue
        recs = max(logs.values(), key=lambda rs: sum(r["event"] == "step" for r in rs))
        out += [(r["t"], r["step"] + 1, r["world"]) for r in recs if r["event"] == "step"]
    return sorted(out)


def _committed_before(logs: dict[int, list[dict]], t: float) -> int:
    return max((r["step"] + 1 for recs in logs.values() for r in recs if r["event"] == "step" and r["t"] <= t),
               default=0)


def _rollback(logs: dict[int, list[dict]], after: float, target: int) -> dict[str, Any]:
    """Times of the rebuilt job: every rank ready (data read), checkpoint applied, target step recommitted."""
    ready = {}
    for rank, recs in logs.items():
        r = next((r for r in recs if r["event"] == "ready" and r["t"] >= after), None)
        if r is not None:
            ready[rank] = r
    rank0 = logs.get(min(ready)) if ready else None
    if not ready or rank0 is None:
        raise CompareError("no rank logged that it was ready again after the failure: the job did not resume")
    t_ready = ready[min(ready)]["t"]
    resume = next((r for r in rank0 if r["event"] == "resume" and r["t"] >= t_ready), None)
    if resume is None:
        raise CompareError("rank 0 did not resume from a checkpoint after the failure")
    redo = next((r for r in rank0 if r["event"] == "step" and r["t"] >= resume["t"] and r["step"] + 1 >= target),
                None)
    t_replayed = resume["t"] if resume["step"] >= target or redo is None else redo["t"]
    return {"t_ready": t_ready, "data_reload": max(r["load_ms"] for r in ready.values()) / 1e3,
            "t_resumed": resume["t"], "resumed_step": resume["step"], "t_replayed": t_replayed,
            "bytes_reread": sum(r["bytes_read"] for r in ready.values()),
            "steps_replayed": max(0, target - resume["step"])}


def _failure(t_kill: float, kill_step: int | None, parts: dict[str, float], **extra: Any) -> dict[str, Any]:
    parts = {k: max(0.0, parts.get(k, 0.0)) for k in COMPONENTS}
    return {"t_kill": t_kill, "kill_step": kill_step, **parts, "total_s": sum(parts.values()), **extra}


def _shrink_failures(logs: dict[int, list[dict]]) -> list[dict]:
    kills = _events(logs, "kill")
    per_rank = {rank: [r for r in recs if r["event"] == "recovery"] for rank, recs in logs.items()}
    out = []
    for i, k in enumerate(kills):
        evs = [rs[i] for rs in per_rank.values() if len(rs) > i]
        if not evs:
            raise CompareError(f"no survivor logged a recovery from kill {k['spec']}")
        out.append(_failure(k["t"], k["step"], {
            "detection": min(e["wall_error"] for e in evs) - k["t"],
            "mpi_recovery": max(e["commit_agree_ms"] + e["revoke_ms"] + e["shrink_ms"] + e["agree_ms"]
                                for e in evs) / 1e3,
            "data_reload": max(e.get("reload_ms", 0.0) for e in evs) / 1e3,
            "replay": max(e["redo_ms"] for e in evs) / 1e3},
            steps_replayed=0, bytes_reread=sum(e.get("bytes_read", 0) for e in evs)))
    return out


def _restart_failures(run_dir: Path, attempts: list[dict]) -> list[dict]:
    from .metrics import read_rank_logs

    out = []
    for att, nxt in zip(attempts, attempts[1:]):
        logs, nlogs = read_rank_logs(att["out"]), read_rank_logs(nxt["out"])
        kills = _events(logs, "kill")
        t_kill = kills[0]["t"] if kills else att["t_exit"]
        t_reported = att["t_failure_reported"] or att["t_exit"]
        target = _committed_before(logs, att["t_exit"])
        rb = _rollback(nlogs, nxt["t_launch"], target)
        out.append(_failure(t_kill, kills[0]["step"] if kills else None, {
            "detection": t_reported - t_kill,
            "mpi_recovery": att["t_exit"] - t_reported,
            "relaunch_init": rb["t_ready"] - att["t_exit"] - rb["data_reload"],
            "checkpoint_load": rb["t_resumed"] - rb["t_ready"],
            "data_reload": rb["data_reload"],
            "replay": rb["t_replayed"] - rb["t_resumed"]},
            resumed_step=rb["resumed_step"], committed_at_failure=target,
            steps_replayed=rb["steps_replayed"], bytes_reread=rb["bytes_reread"]))
    return out


def _reinit_failures(logs: dict[int, list[dict]]) -> list[dict]:
    kills = _events(logs, "kill")
    per_rank = {rank: [r for r in recs if r["event"] == "reinit"] for rank, recs in logs.items()}
    out = []
    for i, k in enumerate(kills):
        # The first rebuild after this kill: every rank's event of it started before any finished.
        evs = [e for rs in per_rank.values() for e in rs if e["t_spawn"] >= k["t"]]
        first = min((e["t_world"] for e in evs), default=0.0)
        evs = [e for e in evs if e["t_spawn"] <= first]
        surv = [e for e in evs if not e.get("replacement")]
        if not surv:
            raise CompareError(f"no survivor logged a rebuild after kill {k['spec']}")
        t_err, t_shrunk = min(e["wall_error"] for e in surv), max(e["t_shrunk"] for e in surv)
        target = _committed_before(logs, t_shrunk)
        rb = _rollback(logs, max(e["t_world"] for e in evs), target)
        out.append(_failure(k["t"], k["step"], {
            "detection": t_err - k["t"],
            "mpi_recovery": t_shrunk - t_err,
            "relaunch_init": rb["t_ready"] - t_shrunk - rb["data_reload"],
            "checkpoint_load": rb["t_resumed"] - rb["t_ready"],
            "data_reload": rb["data_reload"],
            "replay": rb["t_replayed"] - rb["t_resumed"]},
            resumed_step=rb["resumed_step"], committed_at_failure=target,
            steps_replayed=rb["steps_replayed"], bytes_reread=rb["bytes_reread"],
            spawn_s=max(e["t_spawned"] - e["t_spawn"] for e in surv), spawn_ok=all(e["spawn_ok"] for e in surv),
            spawned=max(e["spawned"] for e in surv)))
    return out


def _checkpoint_stats(logs_list: Sequence[dict[int, list[dict]]]) -> dict[str, Any] | None:
    saves, written = [], []
    for logs in logs_list:
        recs = logs.get(0, [])
        saves += [r for r in recs if r["event"] == "checkpoint" and not r.get("initial")]
        written += [r for r in recs if r["event"] == "checkpoint_written"]
    if not saves:
        return None
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    writes = [r["write_ms"] for r in saves if "write_ms" in r] or \
             [r["write_ms"] for r in written if r.get("strategy") == "overlapped"]
    return {"count": len(saves), "stall_ms": mean([r["stall_ms"] for r in saves]),
            "stall_ms_total": sum(r["stall_ms"] for r in saves),
            "snapshot_ms": mean([r["snapshot_ms"] for r in saves if "snapshot_ms" in r]),
            "write_ms": mean(writes), "bytes": saves[-1].get("bytes")}


def analyze(run_dir: Path, mode: str, times: dict[str, float]) -> dict[str, Any]:
    """Measure one finished run from what its ranks and supervisor wrote."""
    from .metrics import read_rank_logs

    if mode == "restart":
        sup_path = run_dir / "supervisor.json"
        if not sup_path.exists():
            raise CompareError(f"the supervisor wrote no {sup_path}: see {run_dir / 'console.log'}")
        sup = json.loads(sup_path.read_text())
        attempts = sup["attempts"]
        logs_list = [read_rank_logs(att["out"]) for att in attempts]
        failures = _restart_failures(run_dir, attempts)
        extra = {"attempts": len(attempts)}
    else:
        logs_list = [read_rank_logs(run_dir)]
        failures = _reinit_failures(logs_list[0]) if mode == "reinit" else _shrink_failures(logs_list[0])
        extra = {}
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise CompareError(f"the run wrote no {summary_path}: see {run_dir / 'console.log'}")
    summary = json.loads(summary_path.read_text())
    prog = _progress(logs_list)
    if not prog:
        raise CompareError(f"no steps logged in {run_dir}")
    t0 = times["t_launch"]
    committed: dict[int, int] = {}
    for _, step, world in prog:
        committed[step] = world
    batch = summary["config"]["batch"]
    samples = sum(committed.values()) * batch
    to_target = max(t for t, _, _ in prog) - t0
    lost = [f["total_s"] for f in failures]
    ckpt = _checkpoint_stats(logs_list)
    return {
        "ok": True, "wall_s": times["t_exit"] - t0, "time_to_target_s": to_target,
        "train_wall_s": summary["wall_s"], "steps": summary["steps"], "world_history": summary["world_history"],
        "test_acc": summary["test_acc"], "consistent": summary["consistent"], "checksum": summary["checksum"],
        "failures": [{**f, "t_kill": f["t_kill"] - t0} for f in failures],
        "lost_per_failure_s": sum(lost) / len(lost) if lost else 0.0,
        "lost_breakdown_s": {c: (sum(f[c] for f in failures) / len(failures) if failures else 0.0)
                             for c in COMPONENTS},
        "steps_replayed": sum(f.get("steps_replayed", 0) for f in failures),
        "bytes_reread": sum(f.get("bytes_reread", 0) for f in failures),
        "checkpoint": ckpt,
        "committed_samples": samples, "goodput_samples_per_s": samples / to_target if to_target > 0 else None,
        "progress": [[round(t - t0, 4), s] for t, s, _ in prog],
        "kill_times_s": [f["t_kill"] - t0 for f in failures],
        **extra,
    }


# --------------------------------------------------------------------------- report


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1.0 else f"{x:.2f} s"


def tables(report: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """The summary and lost-time tables as (header, rows) pairs."""
    h1 = ["run", "wall", "to target", "lost/failure", "vs shrink", "replayed", "re-read", "ckpt stall",
          "ckpt write", "goodput (samples/s)", "test acc"]
    h2 = ["run"] + [COMPONENT_LABELS[c] for c in COMPONENTS] + ["total"]
    r1, r2 = [], []
    for label, r in report["runs"].items():
        if not r.get("ok"):
            r1.append([label, "failed: " + r.get("error", "?")] + [""] * (len(h1) - 2))
            continue
        ck = r.get("checkpoint") or {}
        ratio = report["lost_ratio"].get(label)
        r1.append([label, f"{r['wall_s']:.2f} s", f"{r['time_to_target_s']:.2f} s",
                   _fmt_s(r["lost_per_failure_s"]) if r["failures"] else "-",
                   f"{ratio:.0f}x" if ratio else "-", str(r["steps_replayed"]),
                   f"{r['bytes_reread'] / 2**20:.2f} MiB" if r["failures"] else "-",
                   f"{ck['stall_ms']:.2f} ms" if ck else "-",
                   f"{ck['write_ms']:.2f} ms" if ck and ck.get("write_ms") is not None else "-",
                   f"{r['goodput_samples_per_s']:.0f}", f"{r['test_acc']:.4f}" if r["test_acc"] is not None else "-"])
        if r["failures"]:
            b = r["lost_breakdown_s"]
            r2.append([label] + [_fmt_s(b[c]) for c in COMPONENTS] + [_fmt_s(r["lost_per_failure_s"])])
    return h1, r1, h2, r2


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda xs: "  ".join(str(x).rjust(n) if i else str(x).ljust(n) for i, (x, n) in enumerate(zip(xs, w)))  # noqa: E731
    return "\n".join([line(header), line(["-" * n for n in w])] + [line(r) for r in rows])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def plot_timeline(report: dict[str, Any], path: Path) -> Path:
    """Committed steps against wall time since launch, one line per run, kills marked."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for label, r in report["runs"].items():
        if not r.get("ok"):
            continue
        t, s = zip(*r["progress"])
        line, = ax.plot(t, s, lw=1.2, label=label, drawstyle="steps-post")
        for tk in r["kill_times_s"]:
            ax.axvline(tk, color=line.get_color(), ls=":", lw=0.8)
            before = [st for tt, st in r["progress"] if tt <= tk]
            ax.plot([tk], [before[-1] if before else 0], "x", color="red", ms=8, mew=2)
    ax.plot([], [], "x", color="red", label="SIGKILL")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("committed steps")
    ax.set_title(f"progress: {report['job']['description']}")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_lost(report: dict[str, Any], path: Path) -> Path:
    """Stacked horizontal bars of the lost time per failure, by component."""
    runs = [(label, r) for label, r in report["runs"].items() if r.get("ok") and r["failures"]]
    fig, ax = pyplot().subplots(figsize=(8, 0.6 * len(runs) + 1.8))
    for i, (label, r) in enumerate(runs):
        left = 0.0
        for j, c in enumerate(COMPONENTS):
            v = r["lost_breakdown_s"][c]
            ax.barh(i, v, left=left, color=f"C{j}", label=COMPONENT_LABELS[c] if i == 0 else None)
            left += v
        ax.text(left, i, "  " + _fmt_s(left), va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.invert_yaxis()
    ax.set_xlabel("lost time per failure (s)")
    ax.set_xlim(0, max((r["lost_per_failure_s"] for _, r in runs), default=1) * 1.25)
    ax.set_title("where the time of a failure goes")
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


# --------------------------------------------------------------------------- command


def _dataset(a: argparse.Namespace) -> tuple[Path, int]:
    from .data.format import DatasetError, DatasetFile, dataset_paths, split_path
    from .data.sources import digits_to_dataset, records_for_bytes, synthetic_dataset

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


def run_compare(a: argparse.Namespace) -> dict[str, Any]:
    """Run every selected mode on the same job and write the report; return it."""
    from .faults import parse_kills

    modes = [m for m in a.modes.split(",") if m]
    strategies = [s for s in a.strategies.split(",") if s]
    bad = [m for m in modes if m not in MODES] + [s for s in strategies if s not in STRATEGIES]
    if bad or not modes:
        raise CompareError(f"unknown mode or strategy {bad[0] if bad else '(none)'}: "
                           "use --modes shrink,restart,reinit and --strategies blocking,overlapped")
    if ({"restart", "reinit"} & set(modes)) and (not strategies or a.ckpt_every < 0):
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
        plan.append(("failure-free", "shrink", None, []))
    for m in modes:
        if m == "shrink":
            plan.append(("shrink", "shrink", None, kills))
        else:
            plan += [(f"{m}-{s}", m, s, kills) for s in strategies]
    t_start = time.time()
    for label, mode, strategy, k in plan:
        report["runs"][label] = run_one(label, mode, strategy, a, data, k)
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
    report["checkpoint_stall_ms"] = {
        s: {label: r["checkpoint"]["stall_ms"] for label, r in report["runs"].items()
            if r.get("ok") and r.get("strategy") == s and r.get("checkpoint")} for s in strategies}

    h1, r1, h2, r2 = tables(report)
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    md = [f"Job: {desc}.", "", _md_table(h1, r1), "", "Lost time per failure:", "", _md_table(h2, r2), ""]
    (out / "compare.md").write_text("\n".join(md))
    pngs = [plot_timeline(report, out / "compare_timeline.png"), plot_lost(report, out / "compare_lost_time.png")]
    print(f"\n{PROG}: {desc}\n")
    print(_text_table(h1, r1))
    print("\nlost time per failure:\n")
    print(_text_table(h2, r2))
    if report["lost_ratio"]:
        print("\nlost time per failure relative to shrink: "
              + ", ".join(f"{k} {v:.0f}x" for k, v in report["lost_ratio"].items() if k != "shrink"))
    print(f"\nreport: {out / 'compare.json'}, {out / 'compare.md'}, " + ", ".join(map(str, pngs)))
    return report


def main(args: argparse.Namespace) -> int:
    """Entry point of `python -m ulfmtrain compare`."""
    try:
        report = run_compare(args)
    except CompareError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r.get("ok") for r in report["runs"].values()) else 1
