"""How many failures does one job survive, and what do they cost, with spares and respawn refilling the world?

One digits job, `launch -n N --spares K -- train --replace respawn --audit`,
without failures (the reference) before and after the soak (the machine's own
pace drifts), once more with every link on TCP (as when every rank is a
respawned process: a spawned job does not share Open MPI's shared-memory
transport), and in between with seeded SIGKILLs from outside (as a crashing
node would), one episode every INTERVAL seconds on average (uniform in
[0.5, 1.5] x INTERVAL, and never before the world is whole again: every slot
trains and the last refill joined), until FAILURES processes have been killed;
the mean interval shrinks when the job's pace says the episodes left would not
fit in its epochs (fitted_interval).
An episode kills a random training rank at a random moment (whatever it is
doing: forward, backward, a reduction, the commit agree, the update); now and
then (--repair-kills) a second one 0-80 ms later, inside the detection, repair
or hand-over the first started, or (--spawn-kills) inside the spawn that
refills the spare; or (--spare-kills) it kills the waiting spare instead.  A
kill is only sent while a survivor is left; --keep-slot S spares slot S, so
that one process lives through every failure.  Before each episode the driver
samples every process of the job from /proc (RSS, open file descriptors,
threads: each rank, the waiting spare, mpirun, the fork server), and each rank
records the MPI handles it holds after each repair (comm.handles_held): a leak
shows as a slope, fitted per failure over each process's life.

It reports failures survived, steps committed, goodput against the reference
(the same records trained on, so the ratio of the two training times; and
while the kills came: the steps committed up to one interval after the last
kill against the reference's pace), time lost per failure and where it went
(lost_parts), the same against the soak's own pace between failures
(lost_at_own_pace, free of the drift; by part: the recovery, the refill's
spawn, the newcomer's start-up) and the interval between failures each
cost allows for a goodput of 0.98, each episode's recovery, whether the
replicas stayed identical (the checksum every rank logs after each recovery,
and at the end) and the audit exact (read line by line: audit_files), whether
the world was whole again before the next episode, and the leak slopes.  The
kills and the samples are written as they come (WORKDIR/soak.kills.json,
soak.samples.jsonl); --analyze measures a work directory again.

Usage: python benchmarks/bench_soak.py [--failures 100] [--interval 10] [--ranks 4] [--spares 1] [--keep-slot 1]
       [--name soak_1000] [--workdir DIR] [--analyze]
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
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# `python -P` (as `make bench` runs it) leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ulfmtrain.core import atomic  # noqa: E402
from ulfmtrain.tools.audit import audit_files  # noqa: E402
from ulfmtrain.tools.demo import RECOVERY_PARTS  # noqa: E402
from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "soak"
SLOW_DETECT_MS = 1000.0
REPAIR_WINDOW_S = 0.08      # a second kill this soon after the first falls in its detection, repair or hand-over
SPAWN_WINDOW_S = 0.06       # ... this soon after the refill's spawn began, in the spawn or the newcomer's start
RESTORE_BOUND_S = 120.0     # an episode waits at most this long for the world to be whole again


def train_argv(args: argparse.Namespace, data: Path, out: Path, epochs: int) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--epochs", str(epochs), "--model", args.model,
            "--replace", "respawn", "--spares", str(args.spares), "--audit", "--no-progress", "--seed", str(args.seed),
            *(["--lr", str(args.lr)] if args.lr is not None else [])]


class TrainingPids:
    """slot -> pid of the process that trains it now (its latest start line), for slots that have not ended; and
    the latest join (its joined line).

    Reads only what the rank logs gained since the last call, and parses only their start, end and respawn
    lines: the logs grow by two lines per rank and step, and parsing them whole before each kill took seconds
    of CPU from the ranks (6 s at the end of a 30-failure soak), which the first soak figures counted as lost
    goodput.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.read: dict[Path, int] = {}                 # bytes consumed, up to the last whole line
        self.latest: dict[int, tuple[int, bool]] = {}   # slot -> (pid of its latest start, ended since)
        self.joined = (0.0, 0, 0)                       # the latest join: (time, world after it, spares after it)
        self.epoch = -1                                 # the last epoch any rank ended

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
                elif line.startswith(b'{"event": "epoch"'):
                    self.epoch = max(self.epoch, json.loads(line)["epoch"])
                elif line.startswith(b'{"event": "respawn"') and b'"joined"' in line:
                    r = json.loads(line)
                    self.joined = max(self.joined, (r["t"], r["size_after"], r["spares"]))
        return {s: pid for s, (pid, ended) in self.latest.items() if not ended and _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _read_proc(pid: int) -> dict[str, Any] | None:
    """RSS (bytes), open file descriptors and threads of a live process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"pid": pid, "rss": int(status["VmRSS"].split()[0]) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": int(status["Threads"])}
    except (OSError, KeyError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Processes:
    """Every process of a job from outside: mpirun (its daemon here), the fork server, the ranks that do not train
    (a waiting spare, newcomers, their spawn shims); sampled for RSS, file descriptors and threads."""

    def __init__(self, mpirun: int) -> None:
        self.mpirun = mpirun

    def shims(self, session: set[int] | None = None) -> set[int]:
        """The spawn shims alive (one per newcomer, from its spawn to its end) among the job's processes."""
        return {p for p in session or common._session_pids(self.mpirun) if b"spawn_shim.py" in _cmdline(p)}

    def scan(self, training: dict[int, int]) -> dict[str, Any]:
        """The processes now: mpirun, forkserver (or None), ranks (slot -> sample), others (rank processes that
        do not train: spares, newcomers), shims (spawn shims alive), processes (the job's count)."""
        session = set(common._session_pids(self.mpirun))
        # The job's fork server watches rank 0's parent (its last argument, a process of the job's session),
        # and its children, the forked newcomers, keep its command line: the server is the one whose parent is
        # not one.  (Another job's server watches another process; the test suite's, none of this job's.)  It
        # lives in the job's session: it is no waiting spare.
        mark = b"\0-m\0ulfmtrain.membership.forkserver\0"
        forks = {p: _ppid(p) for p in self._all() if mark in (c := _cmdline(p))
                 and c.rstrip(b"\0").rsplit(b"\0", 1)[-1].decode(errors="replace") in {str(x) for x in session}}
        server = next((p for p, parent in forks.items() if parent not in forks), None)
        children = {p for p, parent in forks.items() if parent == server}
        shims = self.shims(session)
        trainers = set(training.values())
        others = [p for p in (session | children) - trainers - {self.mpirun, *shims}
                  if b"ulfmtrain" in _cmdline(p) and p != server]
        return {"t": time.time(), "mpirun": _read_proc(self.mpirun),
                "forkserver": _read_proc(server) if server else None,
                "ranks": {s: _read_proc(p) for s, p in training.items()},
                "others": [x for x in map(_read_proc, others) if x],
                "shims": len(shims), "processes": len(session | set(forks))}

    @staticmethod
    def _all() -> set[int]:
        return {int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()}


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _victim(rng: np.random.Generator, pids: dict[int, int], keep: int | None,
            exclude: tuple[int, ...] = ()) -> int | None:
    """A random training slot, not the kept one nor the excluded; None if none is left (a survivor must be)."""
    slots = sorted(s for s in pids if s != keep and s not in exclude)
    return int(rng.choice(slots)) if slots else None


def fitted_interval(interval: float, epochs_left: int, pace_s: float | None, kills_left: int,
                    kills_per_episode: float) -> float:
    """The mean interval to the next episode: --interval, or shorter when the job's pace (seconds per epoch,
    failures included; None before it is known) says the episodes left would not fit before its last epoch ends,
    with two intervals and 15 s to spare (the last refill and the goodput window after the last kill).  The job's
    length is fixed in epochs at its start, its pace is not (0.15-0.22 s per epoch in one soak's 10-minute windows
    and from one day to the next): sized for the slow pace, a soak ended 39 kills short of its count."""
    if pace_s is None or kills_left <= 0:
        return interval
    episodes_left = kills_left / max(1.0, kills_per_episode)
    return max(1.0, min(interval, (epochs_left * pace_s - 15.0) / (episodes_left + 2)))


def run_job(args: argparse.Namespace, data: Path, out: Path, epochs: int, failures: int) -> dict[str, Any]:
    """One job; with failures > 0, SIGKILL that many processes, one episode at the mean interval: a training rank
    at a random moment, now and then followed by a second kill inside the repair it started (--repair-kills) or
    inside the spawn that refills it (--spawn-kills), or the waiting spare instead (--spare-kills).  Before
    each episode, when the world is whole, every process is sampled (RSS, descriptors, threads).  The kills and
    the samples are written as they come (OUT.kills.json, OUT.samples.jsonl): a driver that dies keeps them."""
    cmd = common.train_command(args.ranks + args.spares, train_argv(args, data, out, epochs), args)
    rng = np.random.default_rng(args.seed)
    log = out.parent / f"{out.name}.console.log"
    kills_path, samples_path = out.parent / f"{out.name}.kills.json", out.parent / f"{out.name}.samples.jsonl"
    samples_path.unlink(missing_ok=True)
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def kill(pid: int, episode: int, kind: str, slot: int | None) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        # interval_s: the mean interval to the next episode, as the schedule set it before this one's kills.
        kills.append({"t": time.time(), "slot": slot, "pid": pid, "kind": kind, "episode": episode,
                      "interval_s": round(mean, 3)})
        atomic.write_json(kills_path, kills)
        return True

    with open(log, "wb") as console, open(samples_path, "a") as samples:
        proc = common.start_job(cmd, stdout=console, stderr=subprocess.STDOUT)
        training_pids = TrainingPids(out)
        procs = Processes(proc.pid)
        # Kills start once every slot trains (start-up is not what this measures).
        while failures and proc.poll() is None and len(training_pids()) < args.ranks:
            time.sleep(0.1)
        pace_from = (time.monotonic(), training_pids.epoch)
        mean = args.interval

        def fit() -> float:
            # The job's pace since the kills began (its cost included), once 20 epochs tell it.
            done = training_pids.epoch - pace_from[1]
            pace = (time.monotonic() - pace_from[0]) / done if done >= 20 else None
            per_episode = len(kills) / episode if episode >= 10 else 1 + args.repair_kills + args.spawn_kills
            return fitted_interval(args.interval, epochs - 1 - training_pids.epoch, pace, failures - len(kills),
                                   per_episode)

        next_at = time.monotonic() + rng.uniform(0.5, 1.5) * mean
        episode, waiting_since = 0, None
        while proc.poll() is None and time.monotonic() - t0 < args.timeout:
            time.sleep(0.05)
            if time.monotonic() < next_at or len(kills) >= failures:
                continue
            pids = training_pids()
            # The world whole again (every slot trains, and the last refill joined after the last kill with N
            # slots and K spares) before the next episode, however late; bounded, and said in the sample.  (A kill
            # inside the refill's MPI_Intercomm_merge would end the job: a known limit, not what this measures.)
            # A dead waiting spare is refilled only once a failure repairs the world: nothing to wait for then.
            t_joined, world_after, spares_after = training_pids.joined
            whole = len(pids) == args.ranks and (not kills or kills[-1]["kind"] == "spare" or (
                t_joined > kills[-1]["t"] and world_after == args.ranks and spares_after == args.spares))
            waiting_since = waiting_since or time.monotonic()
            if not whole and time.monotonic() - waiting_since < RESTORE_BOUND_S:
                continue
            waited, waiting_since = time.monotonic() - waiting_since, None
            mean = fit()
            next_at = time.monotonic() + rng.uniform(0.5, 1.5) * mean
            if len(pids) < 2:
                continue
            sample = procs.scan(pids)
            sample.update(episode=episode, failures_before=len(kills), waited_for_world_s=round(waited, 3),
                          world_whole=whole)
            samples.write(json.dumps(sample) + "\n")
            samples.flush()
            spares = [x["pid"] for x in sample["others"] if x["pid"] not in pids.values()]
            draw = rng.uniform()
            if draw < args.spare_kills and spares and kill(int(rng.choice(spares)), episode, "spare", None):
                episode += 1
                continue
            slot = _victim(rng, pids, args.keep_slot)
            if slot is None or not kill(pids[slot], episode, "step", slot):
                continue
            draw = rng.uniform()
            second = _victim(rng, pids, args.keep_slot, (slot,))
            if len(kills) < failures and second is not None and draw < args.repair_kills:
                time.sleep(rng.uniform(0, REPAIR_WINDOW_S))        # inside the detection, repair or hand-over
                kill(pids[second], episode, "repair", second)
            elif len(kills) < failures and second is not None and draw < args.repair_kills + args.spawn_kills:
                # Inside the spawn that refills the spare: the new spare's, right after its join (it spawns its
                # successor while it waits), or the lowest rank's at a boundary, the others waiting in the next
                # reduction (where no spare spawns).  Seen as a new spawn shim, which PRRTE starts inside
                # MPI_Comm_spawn; only while it is young, never near the join's merge (a death inside
                # MPI_Intercomm_merge ends the job: a known limit, docs/repair.md).
                before, new = procs.shims(), set()
                deadline = time.monotonic() + 5.0
                while not new and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.01)
                    new = procs.shims() - before
                if new:
                    time.sleep(rng.uniform(0, SPAWN_WINDOW_S / 2))
                    now = training_pids()
                    target = _victim(rng, now, args.keep_slot)
                    if target is not None and len(now) >= 2:
                        kill(now[target], episode, "spawn", target)
            episode += 1
        if proc.poll() is None:
            print(f"bench_soak: the job ran past --timeout ({args.timeout:g} s) after {len(kills)} kills: stopped",
                  file=sys.stderr, flush=True)
            common._stop(proc)
    return {"kills": kills, "launch_wall_s": time.monotonic() - t0, "console": str(log),
            "rc": proc.returncode, "samples": str(samples_path)}


class LogScan:
    """What measure() needs of one job's rank logs, read once line by line: the start, end, recovery, respawn and
    epoch records, and of the step records only when each step first committed, the world then, and the
    checksums logged after a recovery.  (A 1000-failure soak logs tens of millions of lines, which read whole as
    dicts, as read_rank_logs does, would not fit in memory.)"""

    KINDS = (b'{"event": "start"', b'{"event": "end"', b'{"event": "recovery"', b'{"event": "respawn"')

    def __init__(self, out: Path) -> None:
        self.starts: list[dict] = []
        self.ends: list[dict] = []
        self.recoveries: list[dict] = []      # each with "pid": the process that logged it
        self.respawns: list[dict] = []
        self.checksums: dict[int, set[int]] = defaultdict(set)
        self.accuracy: list[tuple[int, float]] = []     # (epoch, test accuracy of the replica), from rank 0's log
        first = np.full(1 << 16, np.inf)
        world = np.zeros(1 << 16, dtype=np.int16)
        for path in sorted(out.glob("rank*.jsonl")):
            pid = -1
            with open(path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break                                   # a rank killed while writing it
                    if line.startswith(b'{"event": "step"'):
                        r = json.loads(line)
                        i = r["step"]
                        if i >= first.size:
                            first = np.concatenate([first, np.full(first.size, np.inf)])
                            world = np.concatenate([world, np.zeros(world.size, dtype=np.int16)])
                        if r["t"] < first[i]:
                            first[i], world[i] = r["t"], r["world"]
                        if "checksum" in r:
                            self.checksums[i].add(r["checksum"])
                    elif line.startswith(b'{"event": "epoch"') and b'"test_acc"' in line:
                        r = json.loads(line)
                        self.accuracy.append((r["epoch"], r["test_acc"]))
                    elif line.startswith(self.KINDS):
                        r = json.loads(line)
                        if r["event"] == "start":
                            pid = r["pid"]
                            self.starts.append(r)
                        elif r["event"] == "end":
                            self.ends.append(r)
                        elif r["event"] == "recovery":
                            self.recoveries.append({**r, "pid": pid})
                        else:
                            self.respawns.append(r)
        done = np.isfinite(first)
        order = np.argsort(first[done], kind="stable")
        self.t = first[done][order]                      # when each step first committed, in order
        self.world = world[done][order]


def measure(out: Path, ranks: int, kills: list[dict[str, Any]], ref_step_s: float = 0.0,
            interval: float = 0.0) -> dict[str, Any]:
    """What one job's rank logs say: steps, training time, consistency, audit, world restored; with kills, where
    the time lost went (lost_parts, against a reference step of ref_step_s), the steps committed while the
    kills came (from the start to one interval after the last kill), each episode's recovery time and the
    handles each process held after each repair."""
    logs = LogScan(out)
    ends, starts = logs.ends, logs.starts
    res: dict[str, Any] = {"ended": bool(ends)}
    if not ends:
        return res
    rows = audit_files(out)
    t, w = logs.t, logs.world
    restored, restore_s = [], []
    for e in episodes(kills):
        lo, hi = np.searchsorted(t, e["last"], side="right"), np.searchsorted(t, e["next"])
        after_t, after_w = t[lo:hi], w[lo:hi]
        restored.append(bool(after_w.size) and int(after_w[-1]) == ranks)
        dropped = np.flatnonzero(after_w < ranks)
        if dropped.size:
            back = np.flatnonzero((after_w == ranks) & (np.arange(after_w.size) > dropped[0]))
            if back.size:
                restore_s.append(float(after_t[back[0]] - after_t[dropped[0]]))
    respawns, recs = logs.respawns, logs.recoveries
    # Every training rank logs each respawn record: count them once.
    joins = {(r["step"], r["t_spawn"]) for r in respawns if r["status"] == "joined"}
    failed = {(r["step"], r["reason"]) for r in respawns if r["status"] == "failed"}
    newcomers = {r["t_start"]: r.get("forked", False) for r in respawns if r["status"] == "newcomer"}
    # Per recovery, its slowest survivor: detection to the end of the hand-over (the parts demo prints).
    per_step: dict[int, float] = defaultdict(float)
    for r in recs:
        per_step[r["step"]] = max(per_step[r["step"]], sum(r.get(k, 0.0) for k in RECOVERY_PARTS))
    train_s = max(e["t"] for e in ends) - min(s["t"] for s in starts)
    every = max(1, t.size // 2000)
    res.update(
        steps=max(e["steps"] for e in ends), train_s=train_s,
        final_world=ends[0]["world_history"][-1], world_history_len=len(ends[0]["world_history"]),
        checksum=ends[0]["checksum"], consistent=all(e["consistent"] for e in ends)
        and len({e["checksum"] for e in ends}) == 1,
        replicas_identical_after_every_recovery=all(len(v) == 1 for v in logs.checksums.values()),
        checked_steps=len(logs.checksums), audit_exact=bool(rows) and all(r.exact and r.finished for r in rows),
        epochs_audited=len(rows), restored_before_next=sum(restored), episodes=len(restored),
        restore_s=common.summarize(restore_s),
        spare_takeovers=len({(r["step"], r["size_before"]) for r in recs if r.get("replaced")}),
        shrinks=len({(r["step"], r["size_after"]) for r in recs if r["removed"]}),
        respawn_joins=len(joins), respawn_failed=len(failed), newcomers=len(newcomers),
        newcomers_forked=sum(newcomers.values()), recovery_ms=common.summarize(list(per_step.values())),
        # An MPI error with no rank dead, redone on a rebuilt communicator; a failure that took over a second to
        # be noticed (a kill is noticed in tens of ms: longer means the ranks were stuck when it came).
        errors_with_nobody_dead=len({r["step"] for r in recs if r.get("cause")}),
        slow_detections=len({r["step"] for r in recs if r["detect_ms"] > SLOW_DETECT_MS}),
        world=[(float(a), int(b)) for a, b in zip(t[::every], w[::every])],
        accuracy=model_quality(logs.accuracy))
    # (seconds since the first step, committed steps): the figure's curve, at most 2000 points.
    res["progress"] = [(round(float(x - t[0]), 3), i + 1) for i, x in enumerate(t)][every - 1:: every]
    res["t_first_step"] = float(t[0])
    if kills:
        res["lost_s_per_failure_by_part"] = lost_parts(respawns, t, kills, ref_step_s)
        tw = while_failing_steps(t, kills, interval)
        res["lost_s_per_failure_at_own_pace"] = lost_at_own_pace(tw, kills)
        res["lost_s_per_failure_at_own_pace_by_part"] = lost_at_own_pace_by_part(tw, kills, respawns)
        res["lost_s_per_failure_near_failure"] = lost_near_failure(tw, kills)
        res["stalls"] = stalls(t, kills)
        t_start, t_end = min(s["t"] for s in starts), kills[-1]["t"] + interval
        res["while_failing"] = {"window_s": t_end - t_start, "steps": int(np.searchsorted(t, t_end, side="right"))}
        res["per_episode"] = per_episode(recs, kills)
        res["handles"] = handle_series(recs, kills)
        # The driver's samples, with the steps committed by then (a leak per step and one per failure differ).
        res["samples"] = read_samples(out.parent / f"{out.name}.samples.jsonl")
        for smp in res["samples"]:
            smp["steps_before"] = int(np.searchsorted(t, smp["t"]))
    return res


def model_quality(accuracy: list[tuple[int, float]]) -> dict[str, Any]:
    """The replica's test accuracy: at the end, at best, and the first epoch after the best where it fell below
    half of it (identical replicas and an exact audit say nothing of a model that training destroyed)."""
    if not accuracy:
        return {}
    accs = np.array([a for _, a in accuracy])
    best = int(np.argmax(accs))
    fell = next((e for e, a in accuracy[best:] if a < accs[best] / 2), None)
    return {"final": float(accs[-1]), "best": float(accs[best]), "best_epoch": accuracy[best][0],
            "fell_at_epoch": fell}


def episodes(kills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episodes in time order: first and last kill, the next episode's first kill (inf for the last one) and
    the kinds (an episode is a kill and, now and then, a second one inside its repair or spawn; kills without
    an episode number are one each)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for i, k in enumerate(kills):
        groups.setdefault(k.get("episode", f"k{i}"), []).append(k)
    spans = sorted(([k["t"] for k in ks], [k.get("kind", "step") for k in ks]) for ks in groups.values())
    return [{"first": min(ts), "last": max(ts), "next": spans[i + 1][0][0] if i + 1 < len(spans) else math.inf,
             "kinds": kinds} for i, (ts, kinds) in enumerate(spans)]


def per_episode(recs: list[dict], kills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each episode: when, its kinds, how many failures came before it, and its recovery: per process the sum of
    every repair's parts (detection to the end of the hand-over) from its first kill to the next episode, the
    slowest process's."""
    out = []
    for e in episodes(kills):
        mine = [r for r in recs if e["first"] <= r["wall_error"] < e["next"]]
        ms: dict[int, float] = defaultdict(float)
        for r in mine:
            ms[r["pid"]] += sum(r.get(k, 0.0) for k in RECOVERY_PARTS)
        out.append({"t": e["first"], "kinds": e["kinds"], "failures_before": sum(k["t"] < e["first"] for k in kills),
                    "recovery_ms": max(ms.values()) if ms else None, "repairs": len({r["step"] for r in mine})})
    return out


def handle_series(recs: list[dict], kills: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, int, int, int]]]:
    """pid -> (failures before the repair, its step, communicators retired, communicator index, group index) after
    each of its repairs: what a process holds as failures and steps go by."""
    times = np.sort([k["t"] for k in kills])
    out: dict[str, list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for r in recs:
        h = r.get("handles")
        if h:
            out[str(r["pid"])].append((int(np.searchsorted(times, r["wall_error"])), r["step"], h["comms_retired"],
                                       h["comm_index"], h["group_index"]))
    return dict(out)


def stalls(t: np.ndarray, kills: list[dict[str, Any]]) -> list[float]:
    """Seconds from a kill to the next committed step, where over a second: every rank was stuck.

    detect_ms misses such a stall when the failure's error surfaced only with a later event (once, the next
    kill): the repair that followed then found its error at once.
    """
    at = np.array([k["t"] for k in kills])
    i = np.searchsorted(t, at)
    gaps = np.where(i < len(t), t[np.minimum(i, len(t) - 1)] - at, math.inf)
    return [round(float(g), 3) for g in gaps if g > SLOW_DETECT_MS / 1e3]


def lost_parts(respawns: list[dict], t: np.ndarray, kills: list[dict[str, Any]],
               ref_step_s: float) -> dict[str, float]:
    """Where the time above the reference's pace went, in seconds per failure: each step's time past the
    reference's mean step, by the parts of lost_at_own_pace_by_part (the steps before the first kill: `rest`;
    the later ones also count a slower steady state, newcomers on TCP).  t: the steps' commit times."""
    parts = dict.fromkeys(PARTS, 0.0)
    parts["rest"] = float(np.sum(np.diff(t[:int(np.searchsorted(t, kills[0]["t"])) if kills else t.size]) - ref_step_s))
    labels = _Parts(respawns)
    for k, at, dt in _intervals(t, kills):
        part, ex = labels(k, at), dt - ref_step_s
        for name in parts:
            parts[name] += float(ex[part == name].sum())
    return {name: v / max(1, len(kills)) for name, v in parts.items()}


def while_failing_steps(t: np.ndarray, kills: list[dict[str, Any]], interval: float) -> np.ndarray:
    """The commit times up to one interval after the last kill, where the goodput window ends: the last kill's
    interval ends there, not with the job (a failure-free tail of minutes, summed against its own last third,
    moved the own-pace figure of a 300-failure soak by 0.4 s per failure)."""
    if not kills or interval <= 0:
        return t
    return t[:np.searchsorted(t, kills[-1]["t"] + interval, side="right")]


def _intervals(t: np.ndarray, kills: list[dict[str, Any]]) -> Iterator[tuple[dict, np.ndarray, np.ndarray]]:
    """For each interval from a kill to the next (the last: to the last step): the kill, the commit time of each
    step and its duration, the step that spans the kill first."""
    ends = [k["t"] for k in kills[1:]] + [float(t[-1])]
    for k, end in zip(kills, ends):
        first = max(0, int(np.searchsorted(t, k["t"], side="right")) - 1)     # the last step before the kill
        seg = t[first:np.searchsorted(t, end, side="right")]
        yield k, seg[1:], np.diff(seg)


def _own_pace_excess(t: np.ndarray, kills: list[dict[str, Any]]) -> list[tuple[dict, np.ndarray, np.ndarray]]:
    """For each interval with 6 steps or more: the kill, the commit times and each step's time past the mean step
    of the interval's last third."""
    return [(k, at, dt - np.mean(dt[-(dt.size // 3):])) for k, at, dt in _intervals(t, kills) if dt.size >= 6]


def lost_at_own_pace(t: np.ndarray, kills: list[dict[str, Any]]) -> float:
    """Seconds lost per failure against the soak's own pace: in each interval from a kill to the next, every
    step's time past the mean step of the interval's last third (by then the world is whole again), the step
    that spans the kill included (the one redone after the repair: before, the gap from the last step before
    the kill to it was left out, and with it the recovery itself).

    Free of the drift between a reference run and the soak (this machine's pace moved by up to 54 % within
    one soak), but blind to a slower steady state (newcomers on TCP), which the goodput ratios count.
    t: the steps' commit times."""
    return sum(float(ex.sum()) for _, _, ex in _own_pace_excess(t, kills)) / max(1, len(kills))


NEAR_S = 3.0    # a failure's effect on the steps ends within this (its recovery, spawn, start-up and join: p90 0.5 s)


def lost_near_failure(t: np.ndarray, kills: list[dict[str, Any]], window_s: float = NEAR_S) -> dict[str, Any]:
    """Seconds lost per failure near it: from the step that spans the kill to `window_s` after the kill, each
    step's time past the mean step of the rest of the interval to the next kill (the job's own pace, as it is
    once the world is whole again).  lost_at_own_pace sums every step of the interval against its last third:
    a pace 3 % off there (the slower ends of long intervals) times 700 steps moved it by 0.2 s.  Intervals with
    fewer than 30 steps after the window are left out ("judged" says how many were not)."""
    lost = []
    for k, at, dt in _intervals(t, kills):
        near = at <= k["t"] + window_s
        if (~near).sum() >= 30:
            lost.append(float(np.sum(dt[near] - np.mean(dt[~near]))))
    return {"s": float(np.mean(lost)) if lost else math.nan, "judged": len(lost), "of": len(kills),
            "window_s": window_s}


PARTS = ("recovery", "join", "spawn", "newcomer_start_up", "rest")


class _Parts:
    """Which part each step of an interval after a kill belongs to: `recovery` (the step across the kill and the
    steps before the refill's join that no other part holds: detection, repair, the hand-over to the spare, the
    step redone), `join` (the step that holds the join), `spawn` (the steps from a spawn's start to the first
    commit after MPI_Comm_spawn returned: the training ranks wait for a spawning training rank, or share the
    cores with a spawning spare), `newcomer_start_up` (from there to the first commit after the newcomer was
    ready: its start-up takes the training ranks' cores) and `rest`.  Either layout: a training rank spawns after
    the kill and the newcomer joins later, or the spare spawned its successor before the kill, which joins soon
    after it (and the new spare spawns the next).  Where no join came before the next kill (the waiting spare
    killed), recovery runs to it."""

    def __init__(self, respawns: list[dict]) -> None:
        self.joins = sorted((r["t_spawn"], r["t_spawn"] + r["spawn_s"],
                             r["t_spawn"] + r.get("ready_s", r["spawn_s"]), r["t"])
                            for r in respawns if r["status"] == "joined" and r.get("spawn_s") is not None)
        self.t_join = np.sort([j[3] for j in self.joins])

    def __call__(self, kill: dict[str, Any], at: np.ndarray) -> np.ndarray:
        def held(x: float) -> float:      # the commit of the step that holds time x (a call returns inside it)
            j = int(np.searchsorted(at, x))
            return float(at[j]) if j < at.size else np.inf

        i = int(np.searchsorted(self.t_join, kill["t"], side="right"))
        joined = held(float(self.t_join[i])) if i < self.t_join.size else np.inf
        spawn, start_up = np.zeros(at.size, bool), np.zeros(at.size, bool)
        for t_spawn, back, ready, _ in self.joins:
            if at.size and t_spawn <= at[-1] and ready >= at[0] - 60.0:
                spawn |= (at >= t_spawn) & (at <= held(back))
                start_up |= (at > held(back)) & (at <= held(ready))
        part = np.where(at == joined, "join", np.where(spawn, "spawn", np.where(
            start_up, "newcomer_start_up", np.where(at < joined, "recovery", "rest"))))
        part[:1] = "recovery"
        return part


def lost_at_own_pace_by_part(t: np.ndarray, kills: list[dict[str, Any]], respawns: list[dict]) -> dict[str, float]:
    """lost_at_own_pace split by what the job was doing, per failure (the parts: _Parts).  They add up to it."""
    parts = dict.fromkeys(PARTS, 0.0)
    labels = _Parts(respawns)
    for k, at, ex in _own_pace_excess(t, kills):
        part = labels(k, at)
        for name in parts:
            parts[name] += float(ex[part == name].sum())
    return {name: v / max(1, len(kills)) for name, v in parts.items()}


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


def pooled_slope(series: dict[Any, list[tuple[float, float]]], min_points: int = 3) -> dict[str, float]:
    """The slope of y against x shared by every series (each its own intercept: one process each), by least
    squares on the values centred within each series; its standard error, points and series used."""
    num = den = 0.0
    resid: list[np.ndarray] = []
    used = points = 0
    for pts in series.values():
        if len(pts) < min_points:
            continue
        x, y = np.asarray(pts, dtype=float).T
        xd, yd = x - x.mean(), y - y.mean()
        if not np.any(xd):
            continue
        num += float(xd @ yd)
        den += float(xd @ xd)
        resid.append((xd, yd))                                   # type: ignore[arg-type]
        used, points = used + 1, points + len(pts)
    if not den:
        return {"slope": math.nan, "stderr": math.nan, "points": points, "series": used}
    b = num / den
    sse = sum(float(np.sum((yd - b * xd) ** 2)) for xd, yd in resid)
    dof = points - used - 1
    return {"slope": b, "stderr": math.sqrt(sse / dof / den) if dof > 0 else math.nan, "points": points,
            "series": used}


def pooled_fit(series: dict[Any, list[tuple[float, ...]]], names: tuple[str, ...] = ("per_failure", "per_step"),
               min_points: int = 4) -> dict[str, Any]:
    """y against several x at once (points (x1, x2, ..., y)), every series its own intercept (one process each): least
    squares on the values centred within each series; each slope with its standard error.  Failures and steps
    both grow with time: fitted together, a leak per step (an agreement's) and one per failure part."""
    xs, ys, used = [], [], 0
    for pts in series.values():
        if len(pts) < min_points:
            continue
        a = np.asarray(pts, dtype=float)
        xs.append(a[:, :-1] - a[:, :-1].mean(axis=0))
        ys.append(a[:, -1] - a[:, -1].mean())
        used += 1
    nan = {name: {"slope": math.nan, "stderr": math.nan} for name in names}
    if not xs:
        return {**nan, "points": 0, "series": 0}
    x, y = np.vstack(xs), np.concatenate(ys)
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    dof = y.size - used - x.shape[1]
    if rank < x.shape[1] or dof <= 0:
        return {**nan, "points": int(y.size), "series": used}
    cov = float(np.sum((y - x @ coef) ** 2)) / dof * np.linalg.inv(x.T @ x)
    return {**{name: {"slope": float(coef[i]), "stderr": float(math.sqrt(cov[i, i]))} for i, name in enumerate(names)},
            "points": int(y.size), "series": used}


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The per-episode samples the driver wrote (a line cut by a driver killed while writing it is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def leak_slopes(samples: list[dict[str, Any]], handles: dict[str, list[tuple[int, int, int, int, int]]]
                ) -> dict[str, Any]:
    """Growth as failures and steps go by, as slopes over each process's life: RSS (bytes; per failure and per step
    together), open file descriptors and threads of every rank process (pooled: each its own intercept), of
    mpirun and of the fork server (per failure); the job's process count; and from the ranks' own records after
    each repair, the communicators and groups held (per failure and per step).  A slope whose interval (2 standard
    errors) holds 0 shows no leak at this length."""
    rss: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    ranks: dict[str, dict[int, list[tuple[float, float]]]] = {k: defaultdict(list) for k in ("fds", "threads")}
    single: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for smp in samples:
        x, steps = smp["failures_before"], smp.get("steps_before", 0)
        for rec in [*smp["ranks"].values(), *smp["others"]]:
            if rec:
                rss[rec["pid"]].append((x, steps, rec["rss"]))
                for k in ranks:
                    ranks[k][rec["pid"]].append((x, rec[k]))
        for who in ("mpirun", "forkserver"):
            if smp.get(who):
                for k in ("rss", "fds", "threads"):
                    single[f"{who}_{k}"].append((x, smp[who][k]))
        single["processes"].append((x, smp["processes"]))
        single["shims"].append((x, smp["shims"]))
    out: dict[str, Any] = {"rank_rss": pooled_fit(rss)}
    out.update({f"rank_{k}_per_failure": pooled_slope(v) for k, v in ranks.items()})
    out.update({f"{k}_per_failure": pooled_slope({0: v}) for k, v in single.items()})
    for i, name in ((2, "comms_retired"), (3, "comm_index"), (4, "group_index")):
        out[name] = pooled_fit({pid: [(h[0], h[1], h[i]) for h in hs] for pid, hs in handles.items()})
    if rss:
        pid, pts = max(rss.items(), key=lambda kv: kv[1][-1][0] - kv[1][0][0])
        hs = handles.get(str(pid), [])
        out["longest_lived"] = {
            "pid": pid, "failures_lived": pts[-1][0] - pts[0][0], "steps_lived": pts[-1][1] - pts[0][1],
            "rss": pooled_fit({0: pts}), "fds_per_failure": pooled_slope({0: ranks["fds"][pid]}),
            "comm_index": pooled_fit({0: [(h[0], h[1], h[3]) for h in hs]}),
            "group_index": pooled_fit({0: [(h[0], h[1], h[4]) for h in hs]})}
    return out


def plot_failures(soak: dict[str, Any], samples: list[dict[str, Any]], leaks: dict[str, Any], path: Path) -> None:
    """Failures on x: each episode's recovery (ms), the processes' RSS (MB), their descriptors and the
    communicators each holds: a leak shows as a slope."""
    plt = pyplot()
    fig, (rec, mem, fd) = plt.subplots(3, 1, figsize=(8, 8), sharex=True, height_ratios=(2, 2, 1.5))
    colors = {"step": "C0", "repair": "C3", "spawn": "C1", "spare": "C2"}
    for kind, color in colors.items():
        pts = [(e["failures_before"], e["recovery_ms"]) for e in soak.get("per_episode", [])
               if e["recovery_ms"] is not None and e["kinds"][-1] == kind]
        if pts:
            rec.scatter(*zip(*pts), s=8, color=color, label={"step": "a kill at a random moment",
                                                             "repair": "+ a kill inside its repair",
                                                             "spawn": "+ a kill inside the refill's spawn",
                                                             "spare": "the waiting spare killed"}[kind])
    rec.set_yscale("log")
    rec.set_ylabel("recovery ms (slowest rank)")
    if soak.get("per_episode"):
        rec.legend(fontsize=7, loc="upper left")
    rec.grid(True, which="both", alpha=0.3)
    by_pid: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    for smp in samples:
        for r in [*smp["ranks"].values(), *smp["others"]]:
            if r:
                by_pid[r["pid"]].append((smp["failures_before"], r["rss"] / 2**20, r["fds"]))
    for i, pts in enumerate(by_pid.values()):
        x, rss, fds = zip(*pts)
        mem.plot(x, rss, lw=0.7, color="C0", alpha=0.6, label="rank processes" if i == 0 else None)
        fd.plot(x, fds, lw=0.7, color="C0", alpha=0.6, label="rank processes" if i == 0 else None)
    for who, color in (("mpirun", "k"), ("forkserver", "C4")):
        pts = [(s["failures_before"], s[who]["rss"] / 2**20, s[who]["fds"]) for s in samples if s.get(who)]
        if pts:
            x, rss, fds = zip(*pts)
            mem.plot(x, rss, lw=1.2, color=color, label=who)
            fd.plot(x, fds, lw=1.2, color=color, label=who)
    rank = leaks.get("rank_rss", {}).get("per_failure", {})
    mem.set_ylabel("RSS (MiB)")
    mem.set_title(f"RSS per failure: rank processes {rank.get('slope', math.nan) / 1024:+.1f} "
                  f"± {2 * rank.get('stderr', math.nan) / 1024:.1f} KiB (per step apart), mpirun "
                  f"{leaks.get('mpirun_rss_per_failure', {}).get('slope', math.nan) / 1024:+.1f} KiB", fontsize=9)
    mem.legend(fontsize=7, loc="upper left")
    fd.set_ylabel("open descriptors")
    fd.set_xlabel("failures so far")
    fd.legend(fontsize=7, loc="upper left")
    comms = fd.twinx()        # what each rank process holds after each repair (comm.handles_held)
    for i, pts in enumerate(soak.get("handles", {}).values()):
        comms.plot([p[0] for p in pts], [p[3] for p in pts], ".", ms=2, color="C1",
                   label="communicators made (Open MPI's index)" if i == 0 else None)
    comms.set_ylabel("communicators", color="C1")
    if soak.get("handles"):
        comms.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def goodput_cost(soak: dict[str, Any], free: dict[str, Any], kills: int, goal: float = 0.98) -> dict[str, Any]:
    """Goodput against the job's own failure-free pace (its steps between failures, free of this machine's
    drift) and against the failure-free reference, and the mean interval between failures each cost per
    failure allows for `goal`: a failure that costs c seconds every T seconds leaves 1 - c/T."""
    window = soak.get("while_failing", {"window_s": math.nan})["window_s"]
    own = soak.get("lost_s_per_failure_at_own_pace", math.nan)
    near = soak.get("lost_s_per_failure_near_failure", {}).get("s", math.nan)
    per_step = free["train_s"] / free["steps"]
    ref = (soak["train_s"] - per_step * soak["steps"]) / max(1, kills)    # the same steps at the reference's pace
    return {"goal": goal, "lost_s_per_failure_own_pace": own, "lost_s_per_failure_near_failure": near,
            "lost_s_per_failure_vs_reference": ref,
            "goodput_own_pace": 1 - own * kills / window if window > 0 else math.nan,
            "goodput_near_failure": 1 - near * kills / window if window > 0 else math.nan,
            "interval_for_goal_own_pace_s": own / (1 - goal),
            "interval_for_goal_near_failure_s": near / (1 - goal),
            "interval_for_goal_vs_reference_s": ref / (1 - goal)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--failures", type=int, default=100, help="SIGKILLs to deliver")
    p.add_argument("--interval", type=float, default=10.0, help="mean seconds between two episodes of SIGKILLs")
    p.add_argument("--ranks", type=int, default=4, help="training ranks (N)")
    p.add_argument("--spares", type=int, default=1, help="hot spares (K); respawn refills them")
    p.add_argument("--model", default="cnn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help="train's --lr, for the soak and its references (default: train's own, 0.05, which destroys "
                        "this model now and then in tens of thousands of epochs without failures: section 5b)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs of the soak job (default: the episodes' time x 1.2 at the reference's pace)")
    p.add_argument("--reference-epochs", type=int, default=None,
                   help="epochs of the failure-free reference (default: --epochs, else 100); with fewer epochs "
                        "than the soak, goodput is compared per epoch and the checksums are not compared")
    p.add_argument("--repair-kills", type=float, default=0.05,
                   help="chance that an episode's kill is followed by a second one inside its repair")
    p.add_argument("--spawn-kills", type=float, default=0.05,
                   help="chance that it is followed by a second one inside the spawn that refills the spare")
    p.add_argument("--spare-kills", type=float, default=0.03, help="chance that an episode kills the waiting spare")
    p.add_argument("--keep-slot", type=int, default=None,
                   help="never kill this slot: its process lives through every failure (the clearest leak slope)")
    p.add_argument("--name", default=NAME, help="results/NAME.json, NAME.png and NAME_failures.png")
    p.add_argument("--analyze", action="store_true",
                   help="run nothing: measure what --workdir holds (a soak whose driver stopped)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where ranks write (default: a temporary dir); a failure-free reference already there is "
                        "kept")
    common.add_common_args(p, timeout=3600)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.failures < 1 or args.interval <= 0 or args.spares < 0:
        p.error("need --ranks >= 2, --failures >= 1, --interval > 0 and --spares >= 0")
    if args.analyze and args.workdir is None:
        p.error("--analyze measures a --workdir: name it")
    from ulfmtrain.data.sources import digits_to_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_soak."))
    data = work / "data"
    if not (data / "train.ulfmds").exists() and not args.analyze:
        digits_to_dataset(data)
    t0 = time.perf_counter()
    ref_epochs = args.reference_epochs or args.epochs or 100
    tcp = argparse.Namespace(**{**vars(args), "mpirun_arg": [*args.mpirun_arg, "--mca", "btl", "tcp,self"]})
    refs: dict[str, dict[str, Any]] = {}

    def reference(name: str, a: argparse.Namespace) -> bool:
        kept = measure(work / name, args.ranks, []) if (work / name).exists() else {}
        if kept.get("ended") or args.analyze:
            refs[name] = kept
            return bool(kept.get("ended"))
        print(f"failure-free reference ({name}): {args.ranks} ranks + {args.spares} spares, {ref_epochs} epochs",
              flush=True)
        run = run_job(a, data, work / name, ref_epochs, 0)
        refs[name] = measure(work / name, args.ranks, [])
        if not refs[name].get("ended"):
            print(f"the failure-free run did not end: see {run['console']}", file=sys.stderr)
        return bool(refs[name].get("ended"))

    if not (reference("free", args) and reference("free_tcp", tcp)):
        print("bench_soak: no failure-free reference ended: nothing to compare with", file=sys.stderr)
        return 1
    free = refs["free"]
    # Long enough for every episode at the reference's pace (one or two kills each), with room for the recoveries.
    episodes_due = args.failures / (1 + args.repair_kills + args.spawn_kills)
    epochs = args.epochs or max(2, math.ceil(episodes_due * args.interval * 1.2 / (free["train_s"] / ref_epochs)))
    if args.analyze:
        kills = json.loads((work / "soak.kills.json").read_text()) if (work / "soak.kills.json").exists() else []
        epochs = next((json.loads(line)["config"]["epochs"] for line in open(work / "soak" / "rank0.jsonl", "rb")
                       if line.startswith(b'{"event": "start"')), epochs)
    else:
        print(f"soak: {epochs} epochs, {args.failures} SIGKILLs, one episode every {args.interval:g} s on average "
              f"(less if the job's pace says they would not fit in its epochs)", flush=True)
        # Bounded by three times the episodes' time (--timeout's default, an hour, stopped a 1000-failure soak at
        # 559 kills), or --timeout if longer.
        bound = argparse.Namespace(**{**vars(args), "timeout": max(args.timeout, 3 * episodes_due * args.interval)})
        kills = run_job(bound, data, work / "soak", epochs, args.failures)["kills"]
    # The goodput window ends one interval after the last kill: the interval the schedule had come to.
    last_interval = kills[-1].get("interval_s", args.interval) if kills else args.interval
    soak = measure(work / "soak", args.ranks, kills, free["train_s"] / free["steps"], last_interval)
    reference("free_after", args)
    samples = soak.pop("samples", [])
    leaks = leak_slopes(samples, soak.get("handles", {}))
    ok = bool(free.get("ended") and soak.get("ended"))
    headline: dict[str, Any] = {"failures_delivered": len(kills), "job_ended": bool(soak.get("ended")),
                                "kills_by_kind": dict(Counter(k.get("kind", "step") for k in kills))}
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
        by_kind: dict[str, list[float]] = defaultdict(list)
        for e in soak.get("per_episode", []):
            if e["recovery_ms"] is not None:
                by_kind[e["kinds"][-1]].append(e["recovery_ms"])
        headline.update(
            failures_survived=len(kills) if soak["consistent"] else 0,
            steps_committed=soak["steps"], goodput_ratio=goodput["free"], goodput_against=goodput,
            goodput_while_failing=while_failing,
            lost_s_per_failure=(soak["train_s"] - free["train_s"] * epochs / ref_epochs) / max(1, len(kills)),
            lost_s_per_failure_by_part=soak["lost_s_per_failure_by_part"],
            lost_s_per_failure_at_own_pace=soak["lost_s_per_failure_at_own_pace"],
            goodput_and_interval=goodput_cost(soak, free, len(kills)),
            recovery_ms_per_failure=soak["recovery_ms"],
            recovery_ms_by_episode_kind={k: common.summarize(v) for k, v in by_kind.items()},
            replicas_identical=soak["consistent"] and soak["replicas_identical_after_every_recovery"],
            # The model itself: the soak's replica at its end against the failure-free reference's.
            test_acc={"soak": soak["accuracy"], "reference": free.get("accuracy")},
            model_intact=soak["accuracy"].get("final", 0.0) >= free.get("accuracy", {}).get("final", 1.0) - 0.05,
            audit_exact=soak["audit_exact"],
            checksum_equals_failure_free=soak["checksum"] == free["checksum"] if ref_epochs == epochs else None,
            world_restored_before_next_failure=f"{soak['restored_before_next']}/{soak['episodes']}",
            spare_takeovers=soak["spare_takeovers"], respawn_joins=soak["respawn_joins"],
            respawn_failed=soak["respawn_failed"], shrinks=soak["shrinks"],
            errors_with_nobody_dead=soak["errors_with_nobody_dead"], slow_detections=soak["slow_detections"],
            stalls=soak["stalls"], newcomers_forked=f"{soak['newcomers_forked']}/{soak['newcomers']}",
            leaks=leaks,
            # The driver waits for the world to be whole before an episode: how often it had to, and how long.
            waited_for_world={"episodes": sum(x.get("waited_for_world_s", 0) > 0.1 for x in samples),
                              "max_s": max((x.get("waited_for_world_s", 0) for x in samples), default=0.0),
                              "not_whole_at_bound": sum(not x.get("world_whole", True) for x in samples)})
    print(json.dumps({k: v for k, v in headline.items() if k != "leaks"}, indent=1))
    for key, f in leaks.items():
        for part, g in ([("", f)] if "slope" in f else [(f" {k}", v) for k, v in f.items() if isinstance(v, dict)
                                                         and "slope" in v]):
            print(f"  {key}{part}: {g['slope']:+.4g} ± {2 * g['stderr']:.2g} ({f.get('points')} points, "
                  f"{f.get('series')} processes)")
    png, failures_png = args.results / f"{args.name}.png", args.results / f"{args.name}_failures.png"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(free, soak, kills, headline.get("goodput_ratio"), png)
    plot_failures(soak, samples, leaks, failures_png)
    for r in (*refs.values(), soak):
        r.pop("world", None)     # drawn; the progress curve stays, so the figure can be drawn again
    path = common.write_result(args.results, args.name, {
        "question": __doc__.split("\n\n")[0],
        "params": {"failures": args.failures, "interval_s": args.interval,
                   "interval_fitted_s": common.summarize([k["interval_s"] for k in kills if "interval_s" in k]),
                   "ranks": args.ranks,
                   "spares": args.spares, "model": args.model, "seed": args.seed, "lr": args.lr, "epochs": epochs,
                   "reference_epochs": ref_epochs, "repair_kills": args.repair_kills,
                   "spawn_kills": args.spawn_kills, "spare_kills": args.spare_kills, "keep_slot": args.keep_slot},
        "command": common.portable(cmd_of(args, epochs)),
        "headline": headline, "failure_free": free, "failure_free_tcp": refs["free_tcp"],
        "failure_free_after": refs.get("free_after"),
        "soak": soak, "kills": kills, "samples": samples, "plot": png.name, "plot_failures": failures_png.name,
        "bench_wall_s": time.perf_counter() - t0})
    common.finish(args, work, path, png)
    bad = [k for k in ("replicas_identical", "audit_exact", "model_intact") if headline.get(k) is False]
    if ok and (bad or headline["failures_survived"] != len(kills)):
        print(f"bench_soak: the soak did not hold: {', '.join(bad) or 'replicas'} failed (see {path})",
              file=sys.stderr)
        return 1
    return 0 if ok else 1


def cmd_of(args: argparse.Namespace, epochs: int) -> list[str]:
    argv = train_argv(args, Path("DATA"), Path("OUT"), epochs)
    i = argv.index("--spares")
    return ["python", "-m", "ulfmtrain", "launch", "-n", str(args.ranks), "--spares", str(args.spares), "--",
            *argv[:i], *argv[i + 2:]]


if __name__ == "__main__":
    common.entry(main)
