"""How many failures does one job survive, and what do they cost, with spares and respawn refilling the world?

One digits job, `launch -n N --spares K -- train --replace respawn --audit`,
without failures (the reference) before and after the soak (the machine's own
pace drifts), once more with every link on TCP (as when every rank is a
respawned process: a spawned job does not share Open MPI's shared-memory
transport), and in between with seeded SIGKILLs from outside (as a crashing
node would) of a random training rank, one every
INTERVAL seconds on average (uniform in [0.5, 1.5] x INTERVAL), until FAILURES
ranks have been killed.  A kill is only sent while at least two training ranks
are alive, so a survivor is always left.  It reports failures survived, steps
committed, goodput against the reference (the same records trained on, so the
ratio of the two training times; and while the kills came: the steps committed
up to one interval after the last kill against the reference's pace), time lost
per failure and where it went (lost_parts), the same against the soak's own
pace between failures (lost_at_own_pace, free of the drift), whether the replicas
stayed identical (the checksum every rank logs after each recovery, and at the
end) and the audit exact, and whether the world size was back to N before the
next failure.

Usage: python benchmarks/bench_soak.py [--failures 100] [--interval 10] [--ranks 4] [--spares 1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.core import atomic  # noqa: E402
from ulfmtrain.core.events import read_rank_logs, select  # noqa: E402
from ulfmtrain.tools.audit import audit_logs  # noqa: E402
from ulfmtrain.tools.demo import RECOVERY_PARTS  # noqa: E402
from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "soak"
SLOW_DETECT_MS = 1000.0


def train_argv(args: argparse.Namespace, data: Path, out: Path, epochs: int) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--epochs", str(epochs), "--model", args.model,
            "--replace", "respawn", "--spares", str(args.spares), "--audit", "--no-progress", "--seed", str(args.seed)]


class TrainingPids:
    """slot -> pid of the process that trains it now (its latest start line), for slots that have not ended.

    Reads only what the rank logs gained since the last call, and parses only their start and end lines: the
    logs grow by two lines per rank and step, and parsing them whole before each kill took seconds of CPU from
    the ranks (6 s at the end of a 30-failure soak), which the first soak figures counted as lost goodput.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.read: dict[Path, int] = {}                 # bytes consumed, up to the last whole line
        self.latest: dict[int, tuple[int, bool]] = {}   # slot -> (pid of its latest start, ended since)

    def __call__(self) -> dict[int, int]:
        for path in sorted(self.out.glob("rank*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.read.get(path, 0))
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]    # a line without its newline is still being written
            self.read[path] = self.read.get(path, 0) + len(whole)
            slot = int(path.stem[4:])
            for line in whole.splitlines():
                if line.startswith(b'{"event": "start"'):
                    self.latest[slot] = (json.loads(line)["pid"], False)
                elif line.startswith(b'{"event": "end"') and slot in self.latest:
                    self.latest[slot] = (self.latest[slot][0], True)
        return {s: pid for s, (pid, ended) in self.latest.items() if not ended and _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def run_job(args: argparse.Namespace, data: Path, out: Path, epochs: int, failures: int) -> dict[str, Any]:
    """One job; with failures > 0, SIGKILL that many training ranks at the mean interval. Returns the kills."""
    cmd = common.train_command(args.ranks + args.spares, train_argv(args, data, out, epochs), args)
    rng = np.random.default_rng(args.seed)
    log = out.parent / f"{out.name}.console.log"
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with open(log, "wb") as console:
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        training_pids = TrainingPids(out)
        # Kills start once every slot trains (start-up is not what this measures).
        while failures and proc.poll() is None and len(training_pids()) < args.ranks:
            time.sleep(0.1)
        next_at = time.monotonic() + rng.uniform(0.5, 1.5) * args.interval
        while proc.poll() is None and time.monotonic() - t0 < args.timeout:
            time.sleep(0.05)
            if time.monotonic() < next_at:
                continue
            if len(kills) >= failures:
                continue
            pids = training_pids()
            if len(pids) >= 2:
                slot = int(rng.choice(sorted(pids)))
                try:
                    os.kill(pids[slot], signal.SIGKILL)
                    kills.append({"t": time.time(), "slot": slot, "pid": pids[slot]})
                    atomic.write_json(out.parent / f"{out.name}.kills.json", kills)   # kept if the driver dies
                except ProcessLookupError:
                    pass
            next_at = time.monotonic() + rng.uniform(0.5, 1.5) * args.interval
        if proc.poll() is None:
            common._stop(proc)
    return {"kills": kills, "launch_wall_s": time.monotonic() - t0, "console": str(log),
            "rc": proc.returncode}


def measure(out: Path, ranks: int, kills: list[dict[str, Any]], ref_step_s: float = 0.0,
            interval: float = 0.0) -> dict[str, Any]:
    """What one job's rank logs say: steps, training time, consistency, audit, world restored; with kills, where
    the time lost went (lost_parts, against a reference step of ref_step_s), and the steps committed while the
    kills came (from the start to one interval after the last kill)."""
    logs = read_rank_logs(out)
    ends = select(logs, "end")
    starts = select(logs, "start")
    res: dict[str, Any] = {"ended": bool(ends)}
    if not ends:
        return res
    # After each recovery every rank logs its checksum with that step: equal, or the replicas diverged.
    by_step: dict[int, set[int]] = defaultdict(set)
    for r in select(logs, "step"):
        if "checksum" in r:
            by_step[r["step"]].add(r["checksum"])
    rows = audit_logs(logs)
    steps = sorted((r["t"], r["world"]) for r in select(logs, "step"))
    restored, restore_s = [], []
    for i, k in enumerate(kills):
        nxt = kills[i + 1]["t"] if i + 1 < len(kills) else math.inf
        after = [(t, w) for t, w in steps if k["t"] < t < nxt]
        dropped = [t for t, w in after if w < ranks]
        back = [t for t, w in after if w == ranks and (not dropped or t > dropped[0])]
        restored.append(bool(after) and after[-1][1] == ranks)
        if dropped and back:
            restore_s.append(back[0] - dropped[0])
    respawns = select(logs, "respawn")
    # Every training rank logs each respawn record: count them once.
    joins = {(r["step"], r["t_spawn"]) for r in respawns if r["status"] == "joined"}
    failed = {(r["step"], r["reason"]) for r in respawns if r["status"] == "failed"}
    newcomers = {r["t_start"]: r.get("forked", False) for r in respawns if r["status"] == "newcomer"}
    recs = select(logs, "recovery")
    # Per recovery, its slowest survivor: detection to the end of the hand-over (the parts demo prints).
    per_step: dict[int, float] = defaultdict(float)
    for r in recs:
        per_step[r["step"]] = max(per_step[r["step"]], sum(r.get(k, 0.0) for k in RECOVERY_PARTS))
    train_s = max(e["t"] for e in ends) - min(s["t"] for s in starts)
    res.update(
        steps=max(e["steps"] for e in ends), train_s=train_s,
        final_world=ends[0]["world_history"][-1], world_history_len=len(ends[0]["world_history"]),
        checksum=ends[0]["checksum"], consistent=all(e["consistent"] for e in ends)
        and len({e["checksum"] for e in ends}) == 1,
        replicas_identical_after_every_recovery=all(len(v) == 1 for v in by_step.values()),
        checked_steps=len(by_step), audit_exact=bool(rows) and all(r.exact and r.finished for r in rows),
        epochs_audited=len(rows), restored_before_next=sum(restored), restore_s=common.summarize(restore_s),
        spare_takeovers=len({(r["step"], r["size_before"]) for r in recs if r.get("replaced")}),
        shrinks=len({(r["step"], r["size_after"]) for r in recs if r["removed"]}),
        respawn_joins=len(joins), respawn_failed=len(failed), newcomers=len(newcomers),
        newcomers_forked=sum(newcomers.values()), recovery_ms=common.summarize(list(per_step.values())),
        # An MPI error with no rank dead, redone on a rebuilt communicator; a failure that took over a second to
        # be noticed (a kill is noticed in tens of ms: longer means the ranks were stuck when it came).
        errors_with_nobody_dead=len({r["step"] for r in recs if r.get("cause")}),
        slow_detections=len({r["step"] for r in recs if r["detect_ms"] > SLOW_DETECT_MS}),
        world=[(t, w) for t, w in steps[:: max(1, len(steps) // 2000)]])
    t = step_times(logs)      # once: the rank logs hold millions of step records after a long soak
    # (seconds since the first step, committed steps): the figure's curve, at most 2000 points.
    every = max(1, t.size // 2000)
    res["progress"] = [(round(float(x - t[0]), 3), i + 1) for i, x in enumerate(t)][every - 1:: every]
    res["t_first_step"] = float(t[0])
    if kills:
        res["lost_s_per_failure_by_part"] = lost_parts(logs, t, kills, ref_step_s)
        res["lost_s_per_failure_at_own_pace"] = lost_at_own_pace(t, kills)
        res["stalls"] = stalls(t, kills)
        t_start, t_end = min(s["t"] for s in starts), kills[-1]["t"] + interval
        res["while_failing"] = {"window_s": t_end - t_start, "steps": int(np.searchsorted(t, t_end, side="right"))}
    return res


def stalls(t: np.ndarray, kills: list[dict[str, Any]]) -> list[float]:
    """Seconds from a kill to the next committed step, where over a second: every rank was stuck.

    detect_ms misses such a stall when the failure's error surfaced only with a later event (once, the next
    kill): the repair that followed then found its error at once.
    """
    at = np.array([k["t"] for k in kills])
    i = np.searchsorted(t, at)
    gaps = np.where(i < len(t), t[np.minimum(i, len(t) - 1)] - at, math.inf)
    return [round(float(g), 3) for g in gaps if g > SLOW_DETECT_MS / 1e3]


def step_times(logs: dict[int, list[dict]]) -> np.ndarray:
    """When each step was first committed (by its fastest rank), in order."""
    first: dict[int, float] = {}
    for r in select(logs, "step"):
        first[r["step"]] = min(first.get(r["step"], math.inf), r["t"])
    return np.array(sorted(first.values()))


def lost_parts(logs: dict[int, list[dict]], t: np.ndarray, kills: list[dict[str, Any]],
               ref_step_s: float) -> dict[str, float]:
    """Where the time above the reference's pace went, in seconds per failure: each step's time past the
    reference's mean step, summed by what the job was doing.  From a kill to the start of the spawn that
    refills it: detection, repair, hand-over to the spare.  From a spawn's start to its join: a newcomer
    starting (on one machine its imports take CPU from the training ranks).  The rest: training between
    failures, on a world whose newcomers talk to the others over TCP.  t: step_times(logs)."""
    excess, at = np.diff(t) - ref_step_s, t[1:]
    respawns = select(logs, "respawn")
    spawns = sorted({r["t_spawn"] for r in respawns if r["status"] == "spawning"})
    joined = {r["t_spawn"]: r["t"] for r in sorted(respawns, key=lambda r: -r["t"]) if r["status"] == "joined"}
    part = np.full(at.size, 2)                        # 0: kill to spawn, 1: spawn to join, 2: the rest
    for ts in spawns:
        part[(at > ts) & (at <= joined.get(ts, ts))] = 1
    for k in kills:
        nxt = next((ts for ts in spawns if ts > k["t"]), k["t"])
        part[(at > k["t"]) & (at <= nxt) & (part == 2)] = 0
    n = max(1, len(kills))
    return {name: float(excess[part == i].sum()) / n
            for i, name in enumerate(("kill_to_spawn", "newcomer_start_up", "between_failures"))}


def lost_at_own_pace(t: np.ndarray, kills: list[dict[str, Any]]) -> float:
    """Seconds lost per failure against the soak's own pace: in each interval from a kill to the next, every
    step's time past the mean step of the interval's last third (by then the world is whole again).

    Free of the drift between a reference run and the soak (this machine's pace moved by up to 54 % within
    one soak), but blind to a slower steady state (newcomers on TCP), which the goodput ratios count.
    t: step_times(logs)."""
    lost = 0.0
    ends = [k["t"] for k in kills[1:]] + [float(t[-1])]
    for k, end in zip(kills, ends):
        dt = np.diff(t[(t > k["t"]) & (t <= end)])
        if dt.size >= 6:
            lost += float(np.sum(dt - np.mean(dt[-(dt.size // 3):])))
    return lost / max(1, len(kills))


def plot(free: dict, soak: dict, kills: list[dict], goodput: float | None, path: Path) -> None:
    """Committed steps against time, soak beside the failure-free reference, kills marked (goodput is the ratio
    of the two slopes); below it, the training ranks over time."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (ax, world) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True, height_ratios=(3, 1))
    for label, r in (("failure-free reference", free), ("soak", soak)):
        prog = r.get("progress") or []
        if prog:
            ax.plot(*zip(*prog), label=label, lw=1.2)
        if r.get("world") and r.get("t_first_step") is not None:
            world.step([t - r["t_first_step"] for t, _ in r["world"]], [w for _, w in r["world"]],
                       where="post", lw=0.8)
    if soak.get("t_first_step") is not None:
        for i, k in enumerate(kills):
            for a in (ax, world):
                a.axvline(k["t"] - soak["t_first_step"], color="red", lw=0.4, alpha=0.5,
                          label="SIGKILL" if a is ax and i == 0 else None)
    ax.set_ylabel("committed steps")
    title = f"{len(kills)} SIGKILLs"
    if goodput is not None:
        title += f": goodput {goodput:.2f} of the failure-free pace"
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    world.set_ylabel("training ranks")
    world.set_ylim(0, max((w for r in (free, soak) for _, w in r.get("world") or []), default=1) + 0.5)
    world.yaxis.set_major_locator(MaxNLocator(integer=True))
    world.set_xlabel("seconds since the first committed step")
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--failures", type=int, default=100, help="SIGKILLs to deliver")
    p.add_argument("--interval", type=float, default=10.0, help="mean seconds between two SIGKILLs")
    p.add_argument("--ranks", type=int, default=4, help="training ranks (N)")
    p.add_argument("--spares", type=int, default=1, help="hot spares (K); respawn refills them")
    p.add_argument("--model", default="cnn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs of the soak job (default: FAILURES x INTERVAL x 1.2 s at the reference's pace)")
    p.add_argument("--reference-epochs", type=int, default=None,
                   help="epochs of the failure-free reference (default: --epochs, else 100); with fewer epochs "
                        "than the soak, goodput is compared per epoch and the checksums are not compared")
    p.add_argument("--workdir", type=Path, default=None, help="where ranks write (default: a temporary dir)")
    common.add_common_args(p, timeout=3600)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.failures < 1 or args.interval <= 0 or args.spares < 0:
        p.error("need --ranks >= 2, --failures >= 1, --interval > 0 and --spares >= 0")
    from ulfmtrain.data.sources import digits_to_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_soak."))
    data = work / "data"
    if not (data / "train.ulfmds").exists():
        digits_to_dataset(data)
    t0 = time.perf_counter()
    ref_epochs = args.reference_epochs or args.epochs or 100
    tcp = argparse.Namespace(**{**vars(args), "mpirun_arg": [*args.mpirun_arg, "--mca", "btl", "tcp,self"]})
    refs: dict[str, dict[str, Any]] = {}

    def reference(name: str, a: argparse.Namespace) -> bool:
        print(f"failure-free reference ({name}): {args.ranks} ranks + {args.spares} spares, {ref_epochs} epochs",
              flush=True)
        run = run_job(a, data, work / name, ref_epochs, 0)
        refs[name] = measure(work / name, args.ranks, [])
        if not refs[name].get("ended"):
            print(f"the failure-free run did not end: see {run['console']}", file=sys.stderr)
        return bool(refs[name].get("ended"))

    if not (reference("free", args) and reference("free_tcp", tcp)):
        return 1
    free = refs["free"]
    # Long enough for every kill at the reference's pace, with room for the recoveries.
    epochs = args.epochs or max(2, math.ceil(args.failures * args.interval * 1.2 / (free["train_s"] / ref_epochs)))
    print(f"soak: {epochs} epochs, {args.failures} SIGKILLs, one every {args.interval:g} s on average", flush=True)
    soak_run = run_job(args, data, work / "soak", epochs, args.failures)
    kills = soak_run["kills"]
    soak = measure(work / "soak", args.ranks, kills, free["train_s"] / free["steps"], args.interval)
    reference("free_after", args)
    ok = free.get("ended") and soak.get("ended")
    headline: dict[str, Any] = {"failures_delivered": len(kills), "job_ended": bool(soak.get("ended"))}
    if ok:
        # Goodput: the soak's training time against the reference's for the same epochs.
        per_epoch = {k: r["train_s"] / ref_epochs for k, r in refs.items() if r.get("ended")}
        if "free_after" in per_epoch:
            per_epoch["free_mean"] = (per_epoch["free"] + per_epoch["free_after"]) / 2
        goodput = {k: v * epochs / soak["train_s"] for k, v in per_epoch.items()}
        # The same while the kills came: the job trains on after the last one, failure-free.
        per_step = {k: v * ref_epochs / refs["free"]["steps"] for k, v in per_epoch.items()}
        window = soak.get("while_failing", {"steps": 0, "window_s": 1.0})
        while_failing = {k: v * window["steps"] / window["window_s"] for k, v in per_step.items()}
        headline.update(
            failures_survived=len(kills) if soak["consistent"] else 0,
            steps_committed=soak["steps"], goodput_ratio=goodput["free"], goodput_against=goodput,
            goodput_while_failing=while_failing,
            lost_s_per_failure=(soak["train_s"] - free["train_s"] * epochs / ref_epochs) / max(1, len(kills)),
            lost_s_per_failure_by_part=soak["lost_s_per_failure_by_part"],
            lost_s_per_failure_at_own_pace=soak["lost_s_per_failure_at_own_pace"],
            recovery_ms_per_failure=soak["recovery_ms"],
            replicas_identical=soak["consistent"] and soak["replicas_identical_after_every_recovery"],
            audit_exact=soak["audit_exact"],
            checksum_equals_failure_free=soak["checksum"] == free["checksum"] if ref_epochs == epochs else None,
            world_restored_before_next_failure=f"{soak['restored_before_next']}/{len(kills)}",
            spare_takeovers=soak["spare_takeovers"], respawn_joins=soak["respawn_joins"],
            respawn_failed=soak["respawn_failed"], shrinks=soak["shrinks"],
            errors_with_nobody_dead=soak["errors_with_nobody_dead"], slow_detections=soak["slow_detections"],
            stalls=soak["stalls"], newcomers_forked=f"{soak['newcomers_forked']}/{soak['newcomers']}")
    print(json.dumps(headline, indent=1))
    png = args.results / f"{NAME}.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(free, soak, kills, headline.get("goodput_ratio"), png)
    for r in (*refs.values(), soak):
        r.pop("world", None)     # drawn; the progress curve stays, so the figure can be drawn again
    path = common.write_result(args.results, NAME, {
        "question": __doc__.split("\n\n")[0],
        "params": {"failures": args.failures, "interval_s": args.interval, "ranks": args.ranks,
                   "spares": args.spares, "model": args.model, "seed": args.seed, "epochs": epochs,
                   "reference_epochs": ref_epochs},
        "command": common.portable(cmd_of(args, epochs)),
        "headline": headline, "failure_free": free, "failure_free_tcp": refs["free_tcp"],
        "failure_free_after": refs.get("free_after"),
        "soak": soak, "kills": kills, "plot": png.name,
        "bench_wall_s": time.perf_counter() - t0})
    common.finish(args, work, path, png)
    return 0 if ok else 1


def cmd_of(args: argparse.Namespace, epochs: int) -> list[str]:
    argv = train_argv(args, Path("DATA"), Path("OUT"), epochs)
    i = argv.index("--spares")
    return ["python", "-m", "ulfmtrain", "launch", "-n", str(args.ranks), "--spares", str(args.spares), "--",
            *argv[:i], *argv[i + 2:]]


if __name__ == "__main__":
    common.entry(main)
