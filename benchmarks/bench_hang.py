"""How long from a hung rank to the survivors' next committed step, at the default bound and at a short one, next
to a SIGKILL's; and what evicting a straggler saves.

Part 1, hang -> next commit: `train` on 4 ranks (digits, the MLP); rank VICTIM fails in its forward of step K by
SIGKILL (`kill`), SIGSTOP for good (`stop`) or a deadlock in its step (`hang`), with the default bound (no
--step-timeout: 60 s, or 10 agreed steps) and a short one (--step-timeout SHORT).  Measured: from the victim's
kill record (written right before it fails) to the survivors' commit of step K (median survivor), and the bound
the hang watch applied (its line).  Every configuration once per repeat, interleaved: they see the same load.

Part 2, stragglers: `train` on 4 ranks (the CNN, batches of 64: a step's own work, forward and backward, outweighs
its reductions) where rank 3 is slowed from its start by a CPU quota (a cgroup: QUOTA % of one core, in 10 ms
periods), kept (the default) or evicted (--straggler F); and the same job with no slowed rank.  Measured: the wall
time of training (rank 0's start to its end), and which rank was evicted.  (With the MLP a step's own work is
0.1 ms of CPU: the slowed rank spent its quota polling inside the reductions, so its own work stayed its peers'
and it slowed every step there, where the straggler rule does not look: hangs.py.)

Usage: python benchmarks/bench_hang.py [--repeats 2] [--short 5] [--kinds kill stop hang] [--parts hang straggler]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.core.events import read_rank_logs, select  # noqa: E402
from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "hang"
KINDS = ("kill", "stop", "hang")
TRAIN = ["--model", "mlp", "--no-progress", "--batch", "16"]
STRAGGLER_TRAIN = ["--model", "cnn", "--no-progress", "--batch", "64"]
RANKS, VICTIM = 4, 2


# --------------------------------------------------------------------------- part 1: hang -> next commit


def hang_once(kind: str, bound: float | None, repeat: int, work: Path, data: Path, args: argparse.Namespace) -> dict:
    """One job with one failure of `kind`; bound None is the default.  Returns the measurements."""
    out = work / f"{kind}_{bound or 'default'}_r{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    step = args.kill_step
    argv = ["train", "--data", str(data), "--out", str(out), "--epochs", str(args.epochs), *TRAIN,
            "--kill", f"{VICTIM}@{step}" + ("" if kind == "kill" else f"/{kind}")]
    if bound is not None:
        argv += ["--step-timeout", str(bound)]
    launch = common.run_mpi(common.train_command(RANKS, argv, args), args.timeout, out.parent / f"{out.name}.log")
    logs = read_rank_logs(out) if out.exists() else {}
    kill = select(logs.get(VICTIM, []), "kill")
    commits = [next((x["t"] for x in select(recs, "step") if x["step"] >= step), None)
               for r, recs in logs.items() if r != VICTIM]
    if not kill or None in commits or len(commits) != RANKS - 1:
        raise RuntimeError(f"{kind} bound {bound}: the failure did not fire or a survivor never committed step "
                           f"{step} (mpirun rc {launch.returncode}); log tail:\n" + common.log_tail(launch.log))
    text = launch.log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if "SIGKILLed so that" in x or "leaves as a failed rank" in x]
    used = [float(x.split("bound ")[1].split(" s")[0]) for x in lines if "bound " in x]
    t_kill = kill[0]["t"]
    return {"kind": kind, "bound": bound, "repeat": repeat, "next_commit_s": common.median(c - t_kill for c in commits),
            "bound_used_s": used[0] if used else None, "lines": lines, "mpirun_rc": launch.returncode,
            "mpirun_s": launch.wall_s, "steps": max(x["step"] for x in select(logs[0], "step")) + 1}


# --------------------------------------------------------------------------- part 2: stragglers


class Quota:
    """A CPU cgroup that caps its processes at `percent` % of one core (cgroup v2 cpu.max, or v1's CFS quota).

    The period is 10 ms, not the default 100 ms: a rank's MPI wait polls the CPU, and with a long period it
    spends its quota there and is throttled inside the collective, which slows every rank alike; a short one
    throttles its own work in proportion, as a slower device or a noisy neighbour does."""

    def __init__(self, percent: float) -> None:
        self.dir: Path | None = None
        period = 10_000
        for base, files in ((Path("/sys/fs/cgroup"), {"cpu.max": f"{int(period * percent / 100)} {period}"}),
                            (Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": str(period),
                                                          "cpu.cfs_quota_us": str(int(period * percent / 100))})):
            name = next(iter(files))
            if not (base / name).exists() and not (base / "cgroup.procs").exists():
                continue
            d = base / f"ulfmtrain-bench-{os.getpid()}"
            try:
                d.mkdir(exist_ok=True)
                if not (d / name).exists():
                    d.rmdir()
                    continue
                for f, v in files.items():
                    (d / f).write_text(v)
            except OSError:
                continue
            self.dir = d
            return

    def add(self, pid: int) -> None:
        assert self.dir is not None
        (self.dir / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if self.dir is not None:
            try:
                self.dir.rmdir()
            except OSError:
                pass


def straggler_once(config: str, repeat: int, work: Path, data: Path, quota: Quota,
                   args: argparse.Namespace) -> dict:
    """`train` with rank 3 slowed (config slowed or evicted) or not (free); the wall time of training."""
    import threading

    out = work / f"straggler_{config}_r{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--data", str(data), "--out", str(out), "--epochs", str(args.straggler_epochs),
            *STRAGGLER_TRAIN]
    if config == "evicted":
        argv += ["--straggler", str(args.straggler)]
    stop = threading.Event()

    def slow_rank_3() -> None:      # into the quota as soon as it has started (its start record has its pid)
        while not stop.is_set():
            start = select(read_rank_logs(out).get(3, []), "start") if out.exists() else []
            if start:
                quota.add(start[0]["pid"])
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=slow_rank_3, daemon=True)
    if config != "free":
        watcher.start()
    launch = common.run_mpi(common.train_command(RANKS, argv, args), args.timeout, out.parent / f"{out.name}.log")
    stop.set()
    logs = read_rank_logs(out)
    end, start = select(logs[0], "end"), select(logs[0], "start")
    if not end:
        raise RuntimeError(f"straggler {config}: rank 0 never ended (mpirun rc {launch.returncode}):\n"
                           + common.log_tail(launch.log))
    evicted = [x for x in launch.log.read_text(errors="replace").splitlines() if "is a straggler" in x]
    removed = [x["step"] for x in select(logs[0], "recovery")]
    return {"config": config, "repeat": repeat, "train_s": end[0]["t"] - start[0]["t"],
            "world_history": end[0]["world_history"], "evicted_at_step": removed[0] if removed else None,
            "line": evicted[0] if evicted else None, "mpirun_rc": launch.returncode}


# --------------------------------------------------------------------------- driver


def plot(hang: dict[str, dict], straggle: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if hang:
        labels = list(hang)
        axes[0].bar(range(len(labels)), [hang[k]["next_commit_s"]["median"] for k in labels], color="C0")
        axes[0].set_xticks(range(len(labels)), [k.replace(" ", "\n") for k in labels], fontsize=8)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("failure -> next committed step, s (median)")
        axes[0].set_title(f"{RANKS} ranks: a SIGKILL, a SIGSTOP, a deadlock")
    if straggle:
        labels = list(straggle)
        axes[1].bar(range(len(labels)), [straggle[k]["train_s"]["median"] for k in labels], color="C1")
        axes[1].set_xticks(range(len(labels)), labels)
        axes[1].set_ylabel("training wall time, s (median)")
        axes[1].set_title("one rank slowed by a CPU quota")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=("hang", "straggler"), default=["hang", "straggler"])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--short", type=float, default=5.0, help="the short bound, s (--step-timeout)")
    p.add_argument("--no-default", action="store_true", help="only the short bound (the default's is 60 s a run)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=40, help="the victim fails in its forward of this step")
    p.add_argument("--straggler", type=float, default=3.0, help="train --straggler F in the evicted runs")
    p.add_argument("--quota", type=float, default=10.0, help="the slowed rank's CPU quota, % of one core")
    p.add_argument("--straggler-epochs", type=int, default=16)
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=300)
    args = p.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_hang."))
    data = work / "digits"
    if not data.exists():
        from ulfmtrain.data.sources import digits_to_dataset
        data.mkdir(parents=True)
        digits_to_dataset(data)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    bounds: list[float | None] = [args.short] + ([] if args.no_default else [None])
    hang_runs: list[dict] = []
    if "hang" in args.parts:
        for r in range(args.repeats):
            for bound in bounds:
                for kind in args.kinds:
                    if kind == "kill" and bound != bounds[0]:
                        continue        # a SIGKILL does not wait for any bound
                    run = hang_once(kind, bound, r, work, data, args)
                    hang_runs.append(run)
                    print(f"  {kind:4} bound {bound or 'default'}: next commit {run['next_commit_s']:.2f} s after "
                          f"the failure (bound used {run['bound_used_s']}), repeat {r + 1}/{args.repeats}",
                          flush=True)
    straggle_runs: list[dict] = []
    skipped = None
    if "straggler" in args.parts:
        quota = Quota(args.quota)
        if quota.dir is None:
            skipped = "no writable CPU cgroup (v2 cpu.max or v1 cpu.cfs_quota_us) to slow a rank with: part 2 skipped"
            print(skipped)
        else:
            try:
                for r in range(args.repeats):
                    for config in ("free", "slowed", "evicted"):
                        run = straggler_once(config, r, work, data, quota, args)
                        straggle_runs.append(run)
                        print(f"  straggler {config:7}: trained in {run['train_s']:.1f} s, world "
                              f"{run['world_history']}, repeat {r + 1}/{args.repeats}", flush=True)
            finally:
                quota.close()

    def key(run: dict) -> str:
        bound = "default" if run["bound"] is None else f"{run['bound']:g} s"
        return run["kind"] if run["kind"] == "kill" else f"{run['kind']} bound {bound}"

    hang = {k: {"next_commit_s": common.summarize(r["next_commit_s"] for r in hang_runs if key(r) == k),
                "bound_used_s": [r["bound_used_s"] for r in hang_runs if key(r) == k]}
            for k in dict.fromkeys(key(r) for r in hang_runs)}
    straggle = {c: {"train_s": common.summarize(r["train_s"] for r in straggle_runs if r["config"] == c),
                    "world_history": [r["world_history"] for r in straggle_runs if r["config"] == c]}
                for c in ("free", "slowed", "evicted") if any(r["config"] == c for r in straggle_runs)}
    load_after = os.getloadavg()
    print(f"\n{os.cpu_count()} cores, load {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    if hang:
        print(f"\nFailure -> the survivors' next committed step, {RANKS} ranks (median [p25-p75] over repeats, s):")
        print(common.table(["failure", "next commit", "bound used"],
                           [[k, common.spread(v["next_commit_s"]), ", ".join(f"{b:g}" for b in v["bound_used_s"]
                                                                              if b is not None) or "-"]
                            for k, v in hang.items()]))
    if straggle:
        print(f"\nOne rank of {RANKS} slowed to {args.quota:g} % of a core (training wall time, s):")
        print(common.table(["job", "train", "world"], [[c, common.spread(v["train_s"]), v["world_history"][0]]
                                                        for c, v in straggle.items()]))
    headline: dict[str, Any] = {"next_commit_s": {k: v["next_commit_s"]["median"] for k, v in hang.items()}}
    if {"slowed", "evicted"} <= set(straggle):
        headline["straggler_evicted_over_kept"] = straggle["evicted"]["train_s"]["median"] / \
            straggle["slowed"]["train_s"]["median"]
    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(hang, straggle, png)
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {k: v for k, v in vars(args).items() if k in ("parts", "kinds", "short", "no_default", "repeats",
                                                                "epochs", "kill_step", "straggler", "quota",
                                                                "straggler_epochs")},
        "load": {"cores": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after},
        "headline": headline, "by_n": {str(RANKS): {"hang": hang, "straggler": straggle}},
        "runs": {"hang": hang_runs, "straggler": straggle_runs}, "skipped": skipped, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t0})
    return common.finish(args, work, path, png)


if __name__ == "__main__":
    common.entry(main)
