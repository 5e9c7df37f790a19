"""The membership fuzzer: a seed draws a failure schedule, real `mpirun --with-ft ulfm` runs it, the logs judge it.

A schedule is 1 to 3 failures of random kinds at random program points (start-up, the initial broadcast, every
step phase, a checkpoint write, a resume's restore, a spare's hand-over, a newcomer's join, the repair itself, the
final check) under shrink, spares or respawn, with several gradient buckets.  A run is right when, by what the
ranks wrote: it ended within BOUND_S; every slot that was not killed ended; every end holds one replica (same
checksum, consistent); the audit is exact for every epoch trained from scratch; mpirun's status is 0 (`exit_ok`);
and where the world never shrank (spares covered every death) it ends on
the failure-free checksum.  A death inside MPI_Intercomm_merge is not survivable in place on Open MPI 5.0.x
(docs/recovery-modes.md): there the job must end, bounded, saying so.

With --hangs every run has a short hang bound (--step-timeout HANG_BOUND_S) and at least one failure of a hang
kind (HANG_KINDS: SIGSTOP for good, SIGSTOP then SIGCONT, a deadlock in the step), the others of any kind; a
run is right when, besides the above, every hung rank was removed within the bound (the survivors' next repair
at most HANG_SLACK_S past it) and the hang watch removed no rank that was not hung.

    python -P tests/faults/fuzz_membership.py --seeds 0-299 [--hangs] [--out DIR] [--keep]
    python -P tests/faults/fuzz_membership.py --summary DIR/results.jsonl

prints one line per seed, then the runs by failure kind x program point and every run that was not ok with the
seed that reproduces it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ulfmtrain.core.events import read_rank_logs, select
from ulfmtrain.launching.launch import mpirun_command, warm_server
from ulfmtrain.tools.audit import audit_logs

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 150                  # a run of 2 epochs takes 10-40 s on a shared 2-core box; a hang is any run past this
EPOCHS, CKPT_EVERY, RESUME_STEP = 2, 5, 8
# In the default suite: respawn (SIGINT, a death in the repair) and spares (SIGTERM, exit 3, a death in the repair),
# both on 3 slots (one failure-free run); and 323, respawn whose newcomers fail before they are ready, one of them
# still starting when training ends (the revoke toward it hung the spawning rank at its end).
DEFAULT_SEEDS = [6, 7, 323]
# With --hangs: 7, spares (3 slots, 2 spares) where slot 0 is SIGSTOPped for good in its update and slot 2 is
# SIGKILLed: the spares take both slots and the run ends on the failure-free checksum.
HANG_SEEDS = [7]
TRAIN = ["--model", "cnn-bn", "--bucket-bytes", "20000", "--audit", "--no-progress"]
# Failure kinds, as the kill spec's /KIND suffix says them (faults.py): one more kind is one more line.
KINDS = (
    "kill",         # SIGKILL
    "raise",        # an uncaught exception
    "exit",         # sys.exit(1)
    "exit=3",       # sys.exit(3)
    "term",         # SIGTERM
    "int",          # SIGINT (KeyboardInterrupt)
)
# With --hangs: SIGSTOP for good, SIGSTOP then SIGCONT before (stop=2) or after (stop=8) the bound, a deadlock.
HANG_KINDS = ("stop", "stop=2", "stop=8", "hang")
HANG_BOUND_S = 4.0     # --step-timeout of a --hangs run (10 agreed steps where those are longer)
HANG_SLACK_S = 15.0    # a hung rank's removal may come this much after the bound on a loaded 2-core box
EVICTED, STUCK = "SIGKILLed so that the others go on", "leaves as a failed rank"   # the hang watch's lines
KILL_ONLY = ("ready", "newcomer", "recovery", "merge")   # another process or the C path fails: SIGKILL only
SIGNAL_ONLY = ("checkpoint",)        # a checkpoint write that raises is reported, not a rank failure
STEP_PHASES = ("forward", "backward", "allreduce", "commit", "update")
# Program points, and the modes where they can fire.  "restore" is the init point of a --resume run.
POINTS = {
    "init": ("shrink", "spares", "respawn"), **{p: ("shrink", "spares", "respawn") for p in STEP_PHASES},
    "checkpoint": ("shrink", "spares", "respawn"), "restore": ("shrink", "spares"),
    "recovery": ("shrink", "spares", "respawn"), "final": ("shrink", "spares", "respawn"),
    "handover": ("spares", "respawn"), "join": ("respawn",), "ready": ("respawn",), "newcomer": ("respawn",),
    "merge": ("respawn",),
}
MERGE_ENDS = "MPI_Intercomm_merge"      # the watchdog's line when a death inside the merge ends the job
HOLDERS_DIED = "every rank that held the state to hand over has died"   # spares.py / comm.py: status 1


@dataclass
class Case:
    slots: int
    spares: int = 0
    respawn: bool = False
    kills: list[str] = field(default_factory=list)
    resume: bool = False
    ckpt: bool = False
    epochs: int = EPOCHS
    points: list[str] = field(default_factory=list)     # what the schedule was drawn as (kind:point per kill)
    hang_bound: float | None = None                     # --step-timeout (the hang kinds' runs)

    @property
    def mode(self) -> str:
        return "respawn" if self.respawn else "spares" if self.spares else "shrink"


def spec(rank: int, step: int, phase: str, kind: str) -> str:
    """One kill spec: RANK@STEP:PHASE, with /KIND for a kind other than SIGKILL."""
    return f"{rank}@{step}:{phase}" + ("" if kind == "kill" else f"/{kind}")


def _kind_ok(kind: str, point: str) -> bool:
    """Whether a failure of `kind` can be scheduled at `point` (faults.parse_kill's rules)."""
    if kind == "stop" and point == "recovery":
        return True          # frozen for good inside the repair: the C fault path raises SIGSTOP there
    return (point not in KILL_ONLY or kind == "kill") and (point not in SIGNAL_ONLY
                                                           or kind.split("=")[0] not in ("raise", "exit"))


def draw(seed: int, hangs: bool = False) -> Case:
    """A schedule from a seed (hangs: one failure at least of a hang kind, and the short hang bound; the draws
    without it are those of the runs before the hang kinds existed)."""
    rng = random.Random(seed)
    mode = rng.choice(("shrink", "spares", "respawn"))
    slots = rng.choice((3, 4))
    spares = rng.choice((1, 2)) if mode == "spares" else rng.choice((0, 0, 1)) if mode == "respawn" else 0
    steps = EPOCHS * -(-(1437 // slots) // 16)     # about: the digits training split, 16 records a rank and step
    n = rng.randint(1, 3 if mode != "shrink" else min(3, slots - 1))
    ranks = rng.sample(range(slots), n)
    case = Case(slots=slots, spares=spares, respawn=mode == "respawn")
    for rank in ranks:
        point = rng.choice([p for p, modes in POINTS.items() if mode in modes])
        if point == "merge" and rng.random() < 0.7:   # not survivable in place: drawn less often
            point = rng.choice(STEP_PHASES)
        kinds = KINDS + HANG_KINDS if hangs else KINDS
        if hangs and not any(p.split(":")[0] in HANG_KINDS for p in case.points) and any(
                _kind_ok(k, point) for k in HANG_KINDS):
            kinds = HANG_KINDS        # the first failure that can hang does
        kind = rng.choice([k for k in kinds if _kind_ok(k, point)])
        if point == "restore":
            case.resume = True
            case.kills.append(spec(rank, 0, "init", kind))
        elif point == "init":
            case.kills.append(spec(rank, 0, "init", kind))
        elif point == "checkpoint":
            case.ckpt = True
            case.kills.append(spec(0, CKPT_EVERY * rng.randint(1, (steps - 2) // CKPT_EVERY), "checkpoint", kind))
            rank = 0          # rank 0 writes
        elif point == "final":
            case.kills.append(spec(rank, 0, "final", kind))
        else:
            case.kills.append(spec(rank, rng.randint(1, steps - 2), point, kind))
        case.points.append(f"{kind}:{point}")
    # One kill per rank at most (a checkpoint kill is always rank 0's).
    seen: dict[str, str] = {}
    for k in case.kills:
        seen.setdefault(k.split("@")[0], k)
    case.points = [p for k, p in zip(case.kills, case.points) if seen[k.split("@")[0]] == k]
    case.kills = list(seen.values())
    # A schedule that kills every rank is refused as bad input (one line, status 2): leave a survivor.
    while sum(1 for p in case.points if p.split(":")[1] not in ("ready", "newcomer")) >= slots + spares:
        case.kills, case.points = case.kills[:-1], case.points[:-1]
    if case.resume:
        case.respawn, case.ckpt = False, True
    if hangs:
        case.hang_bound = HANG_BOUND_S
    return case


# Open MPI's runtime failing before any rank ran (as tests/conftest.py): not the code under test; launched again.
RUNTIME_START_FAILURE = "The PMIx server's listener thread failed to start"


def _run(argv: list[str], ranks: int, out: Path, bound: float) -> tuple[int | None, str, float]:
    """mpirun ARGV on `ranks` ranks; (status or None on a hang, its output, seconds)."""
    status, tail, secs = _run_once(argv, ranks, out, bound)
    if RUNTIME_START_FAILURE in tail and not out.exists():
        print(f"(Open MPI's runtime did not start: {RUNTIME_START_FAILURE}; launching once more)", flush=True)
        status, tail, secs = _run_once(argv, ranks, out, bound)
    return status, tail, secs


def _run_once(argv: list[str], ranks: int, out: Path, bound: float) -> tuple[int | None, str, float]:
    cmd = mpirun_command(ranks, [*argv, "--out", str(out)])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=bound)
        return proc.returncode, text, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        _dump_stacks(proc.pid, out.parent / "hang_stacks.txt")
        os.killpg(proc.pid, signal.SIGKILL)        # mpirun, its daemons and every rank it started
        text, _ = proc.communicate()
        return None, text, time.monotonic() - t0


def _dump_stacks(sid: int, path: Path) -> None:
    """Every rank's C stacks (gdb, where installed) before a hung run is killed: where each one waits."""
    gdb = shutil.which("gdb")
    pids = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    # A rank or a respawned process that is a fork of a fork server (the job's, or the fuzzer's warm one) runs in
    # the server's session: the servers' children too (the fuzzer runs one job at a time).
    servers = subprocess.run(["pgrep", "-f", "ulfmtrain.membership.forkserver "], capture_output=True,
                             text=True).stdout.split()
    for server in servers:
        pids += subprocess.run(["pgrep", "-P", server], capture_output=True, text=True).stdout.split()
    if gdb is None or not pids:
        return
    with open(path, "w") as f:
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            if "ulfmtrain" not in cmd:
                continue
            f.write(f"=== pid {pid}: {cmd[:300]}\n")
            f.flush()
            try:
                subprocess.run([gdb, "-p", pid, "-batch", "-ex", "thread apply all bt 30"], stdout=f,
                               stderr=subprocess.STDOUT, timeout=30)
            except subprocess.TimeoutExpired:
                f.write("(gdb did not answer in 30 s)\n")


def train_argv(digits_dir: Path, case: Case, ckpt: Path | None) -> list[str]:
    argv = ["train", "--data", str(digits_dir), "--epochs", str(case.epochs), "--spares", str(case.spares), *TRAIN]
    if case.respawn:
        argv += ["--replace", "respawn"]
    if ckpt is not None:
        argv += ["--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY if not case.resume else RESUME_STEP)]
    if case.resume:
        argv.append("--resume")
    for k in case.kills:
        argv += ["--kill", k]
    if case.hang_bound is not None:
        argv += ["--step-timeout", str(case.hang_bound)]
    return argv


class FailureFree:
    """Failure-free runs, once per number of slots: the end checksum, and a checkpoint to resume from."""

    def __init__(self, digits_dir: Path, work: Path) -> None:
        self.digits_dir, self.work = digits_dir, work
        self._sums: dict[int, int] = {}

    def checksum(self, slots: int) -> int:
        if slots not in self._sums:
            out = self.work / f"free{slots}"
            rc, text, _ = _run(train_argv(self.digits_dir, Case(slots), None), slots, out, BOUND_S)
            ends = [select(r, "end") for r in read_rank_logs(out).values()]
            assert rc is not None and all(ends), f"the failure-free run of {slots} slots failed:\n{text}"
            self._sums[slots] = ends[0][-1]["checksum"]
        return self._sums[slots]

    def checkpoints(self, slots: int) -> Path:
        """A checkpoint directory whose latest good checkpoint is step RESUME_STEP of epoch 0."""
        ckpt = self.work / f"ckpt{slots}"
        if not ckpt.exists():
            case = Case(slots, epochs=1)
            argv = train_argv(self.digits_dir, case, ckpt)
            argv[argv.index("--ckpt-every") + 1] = str(RESUME_STEP)
            rc, text, _ = _run(argv, slots, self.work / f"ckptrun{slots}", BOUND_S)
            assert rc is not None and (ckpt / "latest.json").exists() or any(ckpt.iterdir()), text
        return ckpt


@dataclass
class Verdict:
    case: Case
    seconds: float
    status: int | None
    problems: list[str]
    outcome: str
    tail: str = ""
    logs: dict[int, list[dict]] = field(default_factory=dict)
    end: dict[str, Any] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)      # the scheduled failures that happened (kind:phase)

    def report(self) -> str:
        c = self.case
        head = (f"{c.mode} slots={c.slots} spares={c.spares} kills={' '.join(c.kills)} resume={c.resume} "
                f"-> {self.outcome} in {self.seconds:.0f} s, status {self.status}, fired {' '.join(self.fired) or '-'}")
        return head + ("".join(f"\n  PROBLEM: {p}" for p in self.problems)
                       + f"\n  --- output tail ---\n{self.tail[-3000:]}" if self.problems else "")


def exit_ok(status: int | None, tail: str) -> bool:
    """Training completed and its results are written: status 0, whatever failed on the way.  The ranks leave
    without MPI_Finalize (exits.py), so the bounded finalize's 124 (ompi #11404) is a failure here too."""
    return status == 0 and "MPI_Finalize did not complete" not in tail


def run_case(case: Case, digits_dir: Path, out: Path, free: FailureFree | None = None) -> Verdict:
    """Run one schedule and judge it by what the ranks wrote."""
    for old in ("run", "ckpt"):        # a seed run again (an interrupted fuzzer) starts from nothing
        shutil.rmtree(out / old, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if case.resume:
        assert free is not None, "a resume case needs FailureFree's checkpoint"
        ckpt = out / "ckpt"
        shutil.copytree(free.checkpoints(case.slots), ckpt)
    elif case.ckpt:
        ckpt = out / "ckpt"
    run_dir = out / "run"
    status, text, secs = _run(train_argv(digits_dir, case, ckpt), case.slots + case.spares, run_dir, BOUND_S)
    tail = text[-6000:]
    logs = read_rank_logs(run_dir) if run_dir.exists() else {}
    v = Verdict(case, secs, status, [], "ok", tail, logs)
    v.fired = [f"{x.get('kind', 'kill')}:{x['phase']}" for recs in logs.values() for x in recs
               if x["event"] in ("kill", "kill_armed")]
    if status is None:
        v.problems.append(f"hang: no end within {BOUND_S} s (the ranks' C stacks: {out / 'hang_stacks.txt'})")
        v.outcome = "hang"
        return v
    # (kill_armed: the recovery phase, where the C fault path kills the rank inside its next repair)
    killed = {r for r, recs in logs.items() if any(x["event"] in ("kill", "kill_armed") for x in recs)}
    # (ready: the spawning rank kills a newcomer right before merging with it, and may then wait in that merge)
    merge = any(x.get("phase") in ("merge", "ready") for recs in logs.values() for x in select(recs, "kill"))
    ends = {r: select(recs, "end")[-1] for r, recs in logs.items() if r < case.slots and select(recs, "end")}
    if merge and MERGE_ENDS in tail and not ends:
        # Documented: a death inside the merge ends the job (bounded), to be resumed from the checkpoint taken
        # before the join (where others train on, the spawning rank alone ends).  Not with status 0.
        v.outcome = "merge-ended"
        if status == 0:
            v.problems.append("a death inside the merge ended the job with status 0")
        return v
    must = set(range(case.slots)) - killed
    if not ends and not must and HOLDERS_DIED in tail:
        # Every slot's failure fired, and together: no rank holding the replica was left to hand it to the
        # spares (they hold none), so the job must end with status 1 and say why (seed 64: two raised in
        # the hand-over that the third's SIGINT started).
        v.outcome = "holders-died"
        if status != 1:
            v.problems.append(f"every holder of the state died, but the status is {status}, not 1")
        return v
    if not ends or not must <= set(ends):
        v.problems.append(f"slots {sorted(must - set(ends))} never ended (ended: {sorted(ends)}; killed: "
                          f"{sorted(killed)})")
        v.outcome = "failed"
        return v
    v.end = ends[min(ends)]
    if len({e["checksum"] for e in ends.values()}) != 1 or not all(e["consistent"] for e in ends.values()):
        v.problems.append(f"replicas differ: { {r: (e['checksum'], e['consistent']) for r, e in ends.items()} }")
    resumed = [x["epoch"] for x in select(logs.get(min(ends), []), "resume")]
    rows = [r for r in audit_logs(logs) if not resumed or r.epoch > resumed[0]]
    if len(rows) != case.epochs - (resumed[0] + 1 if resumed else 0) or not all(r.exact and r.finished for r in rows):
        v.problems.append(f"audit not exact: {rows}")
    if not exit_ok(status, tail):
        v.problems.append(f"exit status {status} after training completed")
    if free is not None and not case.resume and set(v.end["world_history"]) == {case.slots}:
        if v.end["checksum"] != free.checksum(case.slots):
            v.problems.append(f"the world never shrank but the run ends on checksum {v.end['checksum']}, "
                              f"not the failure-free {free.checksum(case.slots)}")
    _judge_hangs(v, text)
    if v.problems:
        v.outcome = "failed"
    return v


def _judge_hangs(v: Verdict, text: str) -> None:
    """The hang watch removed every rank hung for good within the bound, and no rank that did not hang (a --hangs
    run; a rank stopped for a while may be removed or not, as the bound and its SIGCONT fall)."""
    if v.case.hang_bound is None:
        return
    # (kill_armed: the recovery phase, where the C fault path stops the rank inside its next repair; when, the
    # log cannot say, so such a rank is not timed)
    kills = [(r, x) for r, recs in v.logs.items() for x in recs if x["event"] in ("kill", "kill_armed")]
    hung = {r: x for r, x in kills if x["event"] == "kill" and (x.get("kind") == "hang" or x["spec"].endswith("/stop"))}
    may = {r for r, x in kills if x["spec"].rsplit("/", 1)[-1].split("=")[0] in ("hang", "stop")}
    lines = [x for x in text.splitlines() if EVICTED in x or STUCK in x]
    removed = {int(m[1]) for x in lines if (m := re.search(r"world rank (\d+)", x))}
    if removed - may:
        v.problems.append(f"the hang watch removed ranks that did not hang: {sorted(removed - may)}: {lines}")
    bound = max([float(x.split("bound ")[1].split(" s")[0]) for x in lines if "bound " in x] or [v.case.hang_bound])
    repairs = sorted(x["wall_error"] + x["commit_agree_ms"] / 1e3 for recs in v.logs.values() for x in recs
                     if x["event"] == "recovery")
    for r, kill in hung.items():
        after = [t for t in repairs if t >= kill["t"] - 0.5]
        if v.outcome == "ok" and (not after or after[0] - kill["t"] > bound + HANG_SLACK_S):
            v.problems.append(f"rank {r} hung ({kill['spec']}) at {kill['t']:.1f}: no repair within the bound "
                              f"{bound:g} s + {HANG_SLACK_S:g} s (next: {after[:1]})")


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        seeds += list(range(int(a), int(b or a) + 1))
    return seeds


def summary(results: list[dict]) -> str:
    """Counts of runs by failure kind x program point (ok/runs; a seed counts under each failure it drew), by
    mode, seconds a seed, and every run that was not ok with the seed that reproduces it."""
    from statistics import median
    results = list({r["seed"]: r for r in results}.values())     # a seed run again: its last run counts
    outcomes = Counter(r["outcome"] for r in results)
    lines = [f"{len(results)} seeds: " + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items()))
             + (f"; {median(r['seconds'] for r in results):.0f} s a seed (median)" if results else "")]
    modes = ("shrink", "spares", "respawn")
    mode = [("respawn" if r["respawn"] else "spares" if r["spares"] else "shrink", r["outcome"]) for r in results]
    lines.append("by mode: " + ", ".join(f"{m} {sum(1 for x, o in mode if x == m and o in GOOD)}/"
                                        f"{sum(1 for x, _ in mode if x == m)} ok" for m in modes))
    cell: dict[tuple[str, str], list[int]] = {}
    for r in results:
        for pt in r["points"]:
            kind, _, point = pt.partition(":")
            c = cell.setdefault((point, kind), [0, 0])
            c[0] += r["outcome"] in GOOD
            c[1] += 1
    kinds = [k for k in KINDS + HANG_KINDS if any(kk == k for _, kk in cell)]
    lines.append(f"{'point / kind (ok/runs)':24}" + "".join(f"{k:>9}" for k in kinds))
    for point in POINTS:
        if any(pp == point for pp, _ in cell):
            lines.append(f"{point:24}" + "".join(
                f"{'{}/{}'.format(*cell[point, k]) if (point, k) in cell else '-':>9}" for k in kinds))
    fired = Counter(f for r in results for f in r.get("fired", []))
    lines.append("fired (kind:phase): " + ", ".join(f"{k} {n}" for k, n in sorted(fired.items())))
    for r in results:
        if r["outcome"] not in GOOD:
            lines.append(f"NOT OK seed {r['seed']} ({r['outcome']}, status {r['status']}, kills "
                         f"{' '.join(r['kills'])}): {'; '.join(p[:300] for p in r['problems'])}\n"
                         f"  reproduce: python -P tests/faults/fuzz_membership.py --seeds {r['seed']} --keep"
                         + (" --hangs" if r.get("hangs") else ""))
    return "\n".join(lines)


GOOD = ("ok", "merge-ended", "holders-died")  # the documented bounded end of a death inside the merge; every
# holder of the replica died at once (status 1, said)


def main() -> int:
    global BOUND_S
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-9", help="e.g. 0-299 or 1,5,9-12")
    p.add_argument("--out", default=None, help="where runs and results.jsonl go (default: a temporary dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories of passing seeds too")
    p.add_argument("--bound", type=float, default=BOUND_S, help="seconds before a run counts as a hang")
    p.add_argument("--hangs", action="store_true",
                   help=f"every run has a failure of a hang kind ({', '.join(HANG_KINDS)}) and --step-timeout "
                        f"{HANG_BOUND_S:g}")
    p.add_argument("--summary", metavar="RESULTS", default=None,
                   help="only print the counts of a results.jsonl (e.g. of a run stopped part-way)")
    ns = p.parse_args()
    if ns.summary:
        results = [json.loads(line) for line in Path(ns.summary).read_text().splitlines() if line.strip()]
        print(summary(results))
        return 0 if all(r["outcome"] in GOOD for r in results) else 1
    BOUND_S = ns.bound
    with warm_server():
        return fuzz(_seeds(ns.seeds), Path(ns.out or tempfile.mkdtemp(prefix="fuzz-membership-")), ns.keep,
                    ns.hangs)


def fuzz(seeds: list[int], work: Path, keep: bool, hangs: bool = False) -> int:
    """Run each seed's schedule under `work`; print a line each, then the summary; 0 when every run was right."""
    work.mkdir(parents=True, exist_ok=True)
    from ulfmtrain.data.sources import digits_to_dataset
    digits = work / "digits"
    if not digits.exists():
        digits.mkdir()
        digits_to_dataset(digits)
    free = FailureFree(digits, work / "free")
    results: list[dict] = []
    with open(work / "results.jsonl", "a") as res:
        for seed in seeds:
            case = draw(seed, hangs)
            v = run_case(case, digits, work / f"seed{seed}", free)
            print(f"seed {seed}: {v.report()}", flush=True)
            results.append({"seed": seed, "hangs": hangs, **asdict(case), "outcome": v.outcome, "status": v.status,
                            "fired": v.fired, "seconds": round(v.seconds, 1), "problems": v.problems})
            res.write(json.dumps(results[-1]) + "\n")
            res.flush()
            if not v.problems and not keep:
                shutil.rmtree(work / f"seed{seed}", ignore_errors=True)
    print("\n" + summary(results))
    print(f"results: {work / 'results.jsonl'}")
    return 0 if all(r["outcome"] in GOOD for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
