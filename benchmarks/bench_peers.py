"""ulfmtrain beside the peers a user would pick instead: torch DDP restarted by torchrun, and torchft.

The same job for every system: the digits CNN (ulfmtrain/training/models.py) on
scikit-learn's digits (1664 training records, a multiple of 4 x 32, so no
sampler pads or drops a record), 4 ranks or replica groups, batch 32 per rank,
SGD (lr 0.05, momentum 0.9, weight decay 1e-4), EPOCHS epochs.  Each system
runs once without a failure (its step time, as a ratio to DDP's), then once per
phase with an external SIGKILL of rank (replica group) 1 after KILL_STEP
committed steps (peers_model.py: the victim stops at the same program point in
every system and the driver kills it):

  ddp+torchrun      DDP over gloo under `torchrun --max-restarts 3`; rank 0
                    checkpoints every CKPT_EVERY steps; the restarted job
                    resumes from the latest checkpoint.
  torchft default   torchft's Manager, DistributedDataParallel and
                    ProcessGroupGloo, its own lighthouse, each replica group
                    under its own `torchrun --max-restarts 3`; every timeout at
                    torchft's default (lighthouse heartbeat 5 s, join 60 s;
                    Manager, quorum, connect and gloo 60 s).
  torchft tuned     the same with the timeouts of TUNED.
  ulfmtrain shrink / spare / respawn
                    `python -m ulfmtrain launch -n 4 [--spares 1] -- train
                    [--replace respawn] --audit`.

Every rank writes the record ids it trained on in each committed step (the
workers' logs; ulfmtrain's audit lines), and one function (account) turns
any system's logs into: kill -> next committed step, time until 4 ranks
commit a step again, wall time lost (the run's time minus its committed
samples at its own pace before the kill), whether the replicas end
identical, and records lost or repeated over the run (each of the 1664
records should be trained EPOCHS times).  torchft and its lighthouse come from
the package registry into their own virtualenv (--venv), never into
ulfmtrain's; where they cannot be installed, torchft is skipped with one line.

Usage: python benchmarks/bench_peers.py [--repeats 1] [--epochs 50] [--kill-step 100] [--phases between allreduce]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.core.events import Event, read_rank_logs, select  # noqa: E402
from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "peers"
RANKS, BATCH, RECORDS = 4, 32, 1664
TORCHFT_PIN = ["torch==2.13.0", "torchft-nightly==2026.10.26", "numpy"]
# Tuned down from torchft's defaults, as far as this loaded 2-core machine allows without false alarms.
TUNED = {"heartbeat_ms": 500, "join_ms": 1000, "gloo_s": 2.0, "manager_s": 5.0, "quorum_s": 5.0, "connect_s": 5.0}
CONFIGS = ["ddp+torchrun", "torchft default", "torchft tuned", "ulfmtrain shrink", "ulfmtrain spare",
           "ulfmtrain respawn"]
FAILURE_FREE = {"ddp": "ddp+torchrun", "torchft": "torchft default", "ulfmtrain": "ulfmtrain shrink"}
# What each peer promises about data, quoted from its own documentation (README section and JSON).
PROMISES = {
    "torchft": "torchft.data.DistributedSampler: \"This sampler is inherently lossy when used with torchft. "
               "torchft occasionally drops batches on rejoining and if a replica group is down that group "
               "examples will never be used.\"",
    "ddp": "torchrun's train-script docs: \"When any number of workers fail we restart all the workers with the "
           "same program arguments so you will lose progress up to the most recent checkpoint.\"",
    "ulfmtrain": "train --data-policy exactly-once (default): \"a dead rank's uncommitted records of this "
                 "epoch go to the survivors\".",
}


@dataclass
class Run:
    """One job's logs, as every system's are read: (slot, step, t, ids) per committed step and rank."""

    config: str
    phase: str | None
    rows: list[tuple[int, int, float, list[int]]] = field(default_factory=list)
    checksums: dict[int, int] = field(default_factory=dict)
    t_kill: float | None = None
    wall_s: float = 0.0
    error: str | None = None


# --------------------------------------------------------------------------- the virtualenv for torchft


def torchft_python(venv: Path) -> tuple[Path | None, str]:
    """Make (once) the virtualenv with torchft and its lighthouse; return its python, or None and why not."""
    py, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.exists() and stamp.read_text() == " ".join(TORCHFT_PIN):
        return py, f"torchft from {common.portable([str(venv)])}"
    print(f"torchft: installing {' '.join(TORCHFT_PIN)} from the package registry into "
          f"{common.portable([str(venv)])} (not a dependency of ulfmtrain)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True,
                       timeout=300)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *TORCHFT_PIN], capture_output=True, text=True,
                           timeout=1200)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"torchft skipped: its virtualenv could not be made ({exc})"
    if r.returncode != 0 or not (venv / "bin" / "torchft_lighthouse").exists():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"torchft skipped: pip could not install {' '.join(TORCHFT_PIN)} ({last})"
    stamp.write_text(" ".join(TORCHFT_PIN))
    return py, f"torchft from {common.portable([str(venv)])}"


# --------------------------------------------------------------------------- running one job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(procs: list[subprocess.Popen], marker: Path | None, timeout: float) -> tuple[float | None, bool]:
    """Wait for procs[0] (rank 0 or replica group 0, never the victim); SIGKILL the victim the moment its marker
    appears. Returns (kill time, timed out).  A torchft group still restarting when group 0 has finished would
    train alone from step 0: the job is over when group 0 is, and the driver stops the rest."""
    t0, t_kill = time.monotonic(), None
    while procs[0].poll() is None:
        if marker is not None and t_kill is None and marker.exists():
            pid = int(marker.read_text())
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
        if time.monotonic() - t0 > timeout:
            return t_kill, True
        time.sleep(0.002)
    t_end = time.monotonic()
    while any(p.poll() is None for p in procs) and time.monotonic() - t_end < 3.0:   # the others' last lines
        time.sleep(0.05)
    return t_kill, False


def descendants(pids: list[int]) -> set[int]:
    """The processes below these (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                children[int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d.name))
        except (OSError, IndexError, ValueError):
            pass
    found, todo = set(), list(pids)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process we started: each Popen's session and everything below it."""
    pids = {q for p in procs for q in common._session_pids(p.pid)} | {p.pid for p in procs}
    for pid in pids | descendants(list(pids)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return common.start_job(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115


def run_job(config: str, phase: str | None, args: argparse.Namespace, work: Path, data: dict[str, Path],
            ft_py: Path | None) -> Run:
    out = work / f"{config.replace(' ', '_').replace('+', '_')}.{phase or 'ff'}.{time.monotonic_ns()}"
    out.mkdir(parents=True)
    marker = out / "victim.pid" if phase else None
    env = {**os.environ, "PYTHONPATH": str(common.HERE), "OMP_NUM_THREADS": "1"}
    if marker is not None:
        env["PEERS_KILL"] = f"{phase}:{args.kill_step}:{marker}"
    cfg = {"out": str(out), "data": str(data["pt"]), "seed": args.seed, "batch": BATCH, "epochs": args.epochs,
           "ckpt_every": args.ckpt_every, "timeouts": None}
    worker = str(common.HERE / "peers_worker.py")
    procs: list[subprocess.Popen] = []
    helpers: list[subprocess.Popen] = []
    t0 = time.monotonic()
    if config == "ddp+torchrun":
        # --standalone: a c10d rendezvous whose every restart is a new round (with a static one, the restarted
        # ranks read the first round's gloo addresses and fail to connect).
        procs.append(spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(RANKS), "--max-restarts", "3", worker, "ddp",
                            json.dumps(cfg)], out / "torchrun.log", env))
    elif config.startswith("torchft"):
        assert ft_py is not None
        tuned = config.endswith("tuned")
        cfg["timeouts"] = TUNED if tuned else None
        port = free_port()
        lh = [str(ft_py.parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
        if tuned:
            lh += ["--heartbeat_timeout_ms", str(TUNED["heartbeat_ms"]), "--join_timeout_ms", str(TUNED["join_ms"])]
        helpers.append(spawn(lh, out / "lighthouse.log", env))
        for g in range(RANKS):
            genv = {**env, "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(RANKS),
                    "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
            procs.append(spawn([str(ft_py), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1",
                                "--max-restarts", "3", "--master_port", str(free_port()), worker, "torchft",
                                json.dumps(cfg)], out / f"torchrun.{g}.log", genv))
    else:
        mode = config.split()[1]
        launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", str(RANKS)]
        if mode in ("spare", "respawn"):
            launch += ["--spares", "1"] if mode == "spare" else []
        train = ["--", "train", "--data", str(data["dir"]), "--out", str(out), "--epochs", str(args.epochs),
                 "--batch", str(BATCH), "--model", "peers_model:digits_cnn", "--audit", "--no-progress",
                 "--seed", str(args.seed)]
        if mode == "respawn":
            train += ["--replace", "respawn"]
        procs.append(spawn(launch + train, out / "launch.log", env))
    try:
        t_kill, timed_out = supervise(procs, marker, args.timeout)
    finally:                    # also when the driver is interrupted: leave no rank behind
        stop(procs + helpers)
    run = Run(config, phase, t_kill=t_kill, wall_s=time.monotonic() - t0)
    if timed_out:
        run.error = f"did not finish in {args.timeout:g} s"
    elif marker is not None and t_kill is None:
        run.error = "the victim never reached its kill point"
    read_logs(run, out)
    if not run.rows and run.error is None:
        run.error = "no committed step logged: " + common.log_tail(next(iter(sorted(out.glob("*.log")))), 5)
    return run


def read_logs(run: Run, out: Path) -> None:
    """Fill run.rows and run.checksums from the workers' logs or from ulfmtrain's rank logs."""
    if run.config.startswith("ulfmtrain"):
        logs = read_rank_logs(out)
        for slot, recs in logs.items():
            last: dict[int, dict] = {}
            for a in select(recs, Event.AUDIT):      # an aborted attempt is redone: the last one committed
                if a["step"] not in last or a["attempt"] >= last[a["step"]]["attempt"]:
                    last[a["step"]] = a
            steps = {s["step"]: s["t"] for s in select(recs, Event.STEP)}
            for step, a in last.items():
                # A rank killed after contributing to a step that committed has its audit line but no step line.
                t = steps.get(step) or max((s["t"] for r in logs.values() for s in select(r, Event.STEP)
                                            if s["step"] == step), default=None)
                if t is not None:
                    run.rows.append((slot, step, t, a["ids"]))
            for e in select(recs, Event.END):
                run.checksums[slot] = e["checksum"]
        return
    for p in sorted(out.glob("log.*.jsonl")):
        slot = int(p.name.split(".")[1])
        for line in p.read_text().splitlines():
            if not line.endswith("}"):
                continue
            rec = json.loads(line)
            if rec["event"] == "step":
                run.rows.append((slot, rec["step"], rec["t"], rec["ids"]))
            elif rec["event"] == "end":
                run.checksums[slot] = rec["checksum"]


# --------------------------------------------------------------------------- one counting function for all


def account(run: Run, epochs: int) -> dict[str, Any]:
    """What a run committed, from its rows alone: the same arithmetic for every system."""
    # Rank 0 is never the victim: the job is over when it is (a torchft group that restarts later trains alone).
    t_end = max((r[2] for r in run.rows if r[0] == 0), default=0.0)
    rows = sorted((r for r in run.rows if r[2] <= t_end + 1.0), key=lambda r: r[2])
    lineage: dict[tuple[int, int], tuple[int, int, float, list[int]]] = {}
    again: list[bool] = []               # row i commits a step its slot had committed before (a rollback)
    for r in rows:                       # a step done again after a restart replaces the rolled-back one
        again.append((r[0], r[1]) in lineage)
        lineage[(r[0], r[1])] = r
    redone = {r[1] for r, a in zip(rows, again) if a}
    by_step: dict[int, list] = defaultdict(list)
    for r in lineage.values():
        by_step[r[1]].append(r)
    steps = sorted(by_step)
    commit_t = {s: max(r[2] for r in by_step[s]) for s in steps}
    samples = {s: sum(len(r[3]) for r in by_step[s]) for s in steps}
    contributors = {s: sum(1 for r in by_step[s] if r[3]) for s in steps}
    cum, total = {}, 0
    for s in steps:
        total += samples[s]
        cum[s] = total
    seen = Counter(i for r in lineage.values() for i in r[3])
    lost = sum(max(0, epochs - seen.get(i, 0)) for i in range(RECORDS))
    repeated = sum(max(0, c - epochs) for c in seen.values())
    # The progress a user sees, as rank 0 (never the victim) committed it, rolled-back steps included.
    timeline = [(r[2], cum[r[1]]) for r in rows if r[0] == 0]
    t_first, t_last = (timeline[0][0], timeline[-1][0]) if timeline else (0.0, 0.0)
    gaps = [b - a for a, b in zip([commit_t[s] for s in steps[3:]], [commit_t[s] for s in steps[4:]])]
    res: dict[str, Any] = {
        "steps": len(steps), "samples": total, "records_lost": lost, "records_repeated": repeated,
        "steps_redone": len(redone), "identical": len(set(run.checksums.values())) == 1 and len(run.checksums) >= 1,
        "checksums": {str(k): v for k, v in sorted(run.checksums.items())},
        "replicas_at_end": len(run.checksums), "step_s": common.median(gaps) if gaps else None,
        "run_s": t_last - t_first, "timeline": [(round(t - (run.t_kill or t_first), 4), c) for t, c in timeline],
    }
    if run.t_kill is not None:
        tk = run.t_kill
        # After the kill: steps beyond the victim's last commit, and steps committed again (a rollback); a slow
        # rank's line for the victim's last step can come after the kill, and is not recovery.
        v_last = max((r[1] for r in rows if r[0] == 1 and r[2] <= tk), default=-1)
        after = [r for r, a in zip(rows, again) if r[2] > tk and (r[1] > v_last or a)]
        after_steps = sorted({r[1] for r in after})
        full = [commit_t[s] for s in after_steps if contributors[s] >= RANKS]
        res["victim_last_step"] = v_last
        res["kill_to_next_commit_s"] = min(r[2] for r in after) - tk if after else None
        res["kill_to_full_world_s"] = min(full) - tk if full else None
        res["min_world_after_kill"] = min((contributors[s] for s in after_steps), default=None)
        # Wall time lost: the run's time minus what its committed samples take at its own pace before the kill
        # (from rank 0's 4th step, past the warm-up), so each system is measured against itself on this shared
        # machine.
        before = [(t, c) for t, c in timeline if t <= tk]
        if len(before) > 5 and before[-1][0] > before[3][0]:
            pace = (before[-1][1] - before[3][1]) / (before[-1][0] - before[3][0])
            res["wall_lost_s"] = (t_last - t_first) - (total - timeline[0][1]) / pace
    return res


# --------------------------------------------------------------------------- the benchmark


def make_data(work: Path) -> dict[str, Path]:
    """The digits split every system reads: ulfmtrain's files, and the same records as tensors for the workers."""
    import numpy as np
    import torch

    from ulfmtrain.data.format import DatasetFile
    from ulfmtrain.data.sources import digits_to_dataset

    d = work / "digits"
    # sklearn takes ceil(fraction x 1797) test records: 133, which leaves 1664 = 13 x 4 x 32 for training.
    train, _ = digits_to_dataset(d, test_fraction=132.5 / 1797, seed=0)
    with DatasetFile(train) as f:
        recs = f.read(0, f.count)
    assert len(recs["y"]) == RECORDS, len(recs["y"])
    pt = work / "digits.pt"
    torch.save((torch.from_numpy(np.ascontiguousarray(recs["x"])), torch.from_numpy(recs["y"])), pt)
    return {"dir": d, "pt": pt}


def summarize_config(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return common.summarize(vals) if vals else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(p, timeout=300.0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per system and phase (default 1: about 16 minutes on this shared 2-core box)")
    p.add_argument("--epochs", type=int, default=50,
                   help="epochs of 13 steps at 4 ranks (default 50: long enough for a restarted process to rejoin)")
    p.add_argument("--kill-step", type=int, default=100, help="rank 1 is killed once this many steps committed")
    p.add_argument("--ckpt-every", type=int, default=40, help="DDP's checkpoint interval in steps (default 40)")
    p.add_argument("--phases", nargs="+", choices=["between", "allreduce"], default=["between", "allreduce"])
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    p.add_argument("--venv", type=Path, default=common.HERE / ".venv-peers",
                   help="the virtualenv for torchft (made once; default benchmarks/.venv-peers)")
    p.add_argument("--no-torchft", action="store_true", help="leave torchft out")
    p.add_argument("--no-failure-free", action="store_true",
                   help="only the kill runs (no step-time ratio; the smoke test's shortcut)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the logs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # so that run_job's cleanup runs
    if args.kill_step + 2 >= args.epochs * 13:
        p.error(f"--kill-step {args.kill_step} must leave steps after it: give fewer than {args.epochs * 13 - 2}")

    configs = list(args.configs)
    ft_py, ft_note = (None, "torchft skipped: --no-torchft") if args.no_torchft else (None, "")
    if any(c.startswith("torchft") for c in configs) and not args.no_torchft:
        ft_py, ft_note = torchft_python(args.venv)
    if ft_py is None:
        configs = [c for c in configs if not c.startswith("torchft")]
    if ft_note:
        print(ft_note, flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_peers."))
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work)
    systems = sorted({k for k, c in FAILURE_FREE.items() if any(x.split()[0].split("+")[0] == k for x in configs)})
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    t_all = time.perf_counter()
    for rep in range(args.repeats):
        # Failure-free first, then the kills, interleaved so that the machine's drift hits every system alike.
        jobs = [(FAILURE_FREE[s], None) for s in systems if not args.no_failure_free]
        jobs += [(c, ph) for ph in args.phases for c in configs]
        for config, phase in jobs:
            name = f"{FAILURE_FREE_NAME.get(config, config) if phase is None else config}"
            run = run_job(config, phase, args, work, data, ft_py)
            acc = account(run, args.epochs)
            key = f"{name} | {phase or 'failure-free'}"
            runs[key].append({"repeat": rep, "error": run.error, "wall_s": run.wall_s, **acc})
            print(f"[{rep + 1}/{args.repeats}] {key}: " + (f"ERROR {run.error}; " if run.error else "")
                  + f"next commit {common.fmt(acc.get('kill_to_next_commit_s'))} s, full world "
                  f"{common.fmt(acc.get('kill_to_full_world_s'))} s, lost {common.fmt(acc.get('wall_lost_s'))} s, "
                  f"records lost/repeated {acc['records_lost']}/{acc['records_repeated']}, identical "
                  f"{acc['identical']}, step {common.fmt(acc['step_s'])} s", flush=True)
    total_s = time.perf_counter() - t_all

    ddp_step = summarize_config(runs.get("ddp | failure-free", []), "step_s")
    summary: dict[str, dict[str, Any]] = {}
    for key, rs in runs.items():
        s = {k: summarize_config(rs, k) for k in ("step_s", "kill_to_next_commit_s", "kill_to_full_world_s",
                                                  "wall_lost_s", "min_world_after_kill", "records_lost",
                                                  "records_repeated", "steps_redone")}
        s["identical_all"] = all(r["identical"] for r in rs)
        s["errors"] = [r["error"] for r in rs if r["error"]]
        s["never_full_again"] = sum(1 for r in rs if r.get("kill_to_next_commit_s") is not None
                                    and r.get("kill_to_full_world_s") is None)
        if key.endswith("failure-free") and ddp_step and s["step_s"]:
            s["step_over_ddp"] = s["step_s"]["median"] / ddp_step["median"]
        summary[key] = s
    tab = render(summary)
    print("\n" + tab + f"\n\n(medians of {args.repeats} runs; all jobs {total_s:.0f} s)")

    args.results.mkdir(parents=True, exist_ok=True)
    png = args.results / f"{NAME}.png"
    plot(runs, args, png)
    headline = {
        "step_over_ddp": {k.split(" |")[0]: s["step_over_ddp"] for k, s in summary.items() if "step_over_ddp" in s},
        "kill_to_next_commit_s": {k: s["kill_to_next_commit_s"]["median"] for k, s in summary.items()
                                  if s.get("kill_to_next_commit_s")},
        "records_lost_repeated": {k: [s["records_lost"]["median"], s["records_repeated"]["median"]]
                                  for k, s in summary.items() if s.get("records_lost")},
    }
    path = common.write_result(args.results, NAME, {
        "question": "What does one external SIGKILL of rank 1 cost under DDP+torchrun, torchft and ulfmtrain, "
                    "on the same model, data, ranks and optimizer?",
        "params": {"ranks": RANKS, "batch": BATCH, "records": RECORDS, "epochs": args.epochs,
                   "kill_step": args.kill_step, "ckpt_every": args.ckpt_every, "phases": args.phases,
                   "repeats": args.repeats, "configs": configs, "torchft": ft_note or "not asked for",
                   "torchft_pin": TORCHFT_PIN, "torchft_tuned": TUNED, "seed": args.seed},
        "promises": PROMISES, "headline": headline, "table": tab, "by_n": {str(RANKS): summary},
        "runs": runs, "total_s": total_s, "plot": png.name})
    return common.finish(args, work, path, png)


FAILURE_FREE_NAME = {"ddp+torchrun": "ddp", "torchft default": "torchft", "ulfmtrain shrink": "ulfmtrain"}


def render(summary: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of the medians (system and phase in two columns)."""
    rows = []
    for key, s in summary.items():
        med = lambda k: common.fmt(s[k]["median"]) if s.get(k) else "-"  # noqa: E731
        full = med("kill_to_full_world_s") if not s["never_full_again"] else "never (shrunk)"
        if key.endswith("failure-free"):
            full = "-"
        rows.append([*key.split(" | "), common.fmt(s.get("step_over_ddp")), med("kill_to_next_commit_s"), full,
                     med("min_world_after_kill"), med("wall_lost_s"),
                     f"{med('records_lost')} / {med('records_repeated')}", med("steps_redone"),
                     "yes" if s["identical_all"] else "NO"])
    return common.table(["system", "phase", "step / DDP", "kill -> next commit s", "back to 4 ranks s",
                         "min ranks", "wall lost s", "records lost / repeated", "steps redone", "identical"], rows)


def plot(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, png: Path) -> None:
    """Committed samples over time around the kill, one line per system (first repeat), one panel per phase."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.phases), figsize=(6.5 * len(args.phases), 4.8), squeeze=False)
    colors = {"ddp+torchrun": "tab:gray", "torchft default": "tab:orange", "torchft tuned": "tab:red",
              "ulfmtrain shrink": "tab:blue", "ulfmtrain spare": "tab:green", "ulfmtrain respawn": "tab:purple"}
    for ax, phase in zip(axes[0], args.phases):
        for config, color in colors.items():
            rs = runs.get(f"{config} | {phase}")
            if not rs or not rs[0]["timeline"]:
                continue
            t, c = zip(*rs[0]["timeline"])
            ax.plot(t, c, color=color, label=config, lw=1.6, drawstyle="steps-post")
        ax.axvline(0, color="black", ls="--", lw=1)
        ax.annotate("SIGKILL of rank 1", (0, 0.02), xycoords=("data", "axes fraction"), xytext=(4, 0),
                    textcoords="offset points", fontsize=8)
        ax.set_xlabel("seconds since the kill")
        ax.set_ylabel("samples committed (the model's lineage)")
        ax.set_title(f"kill {'between steps' if phase == 'between' else 'inside the allreduce'}, "
                     f"after step {args.kill_step}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Digits CNN, {RANKS} ranks x batch {BATCH}, one external SIGKILL (this machine, one run each)",
                 fontsize=10)
    save_figure(fig, png)


if __name__ == "__main__":
    common.entry(main)
