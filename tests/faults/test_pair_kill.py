"""Two processes SIGKILLed a few ms apart: a training rank and the waiting spare (`launch -n 3 --spares 1`), or
two training ranks (`launch -n 4`), at a random moment from start-up on, in a random order; and the reported
case, a survivor that crashes (SIGSEGV) a few ms after them.

Every run must end within its bound; every process neither killed nor crashed must end training on one replica
(none left waiting as a spare), with one slot fewer per slot lost, and the audit must find every record
exactly once; status 0.  Open MPI 5.0.10+ can crash a survivor that learns of a death inside MPI_Comm_split
(docs/failures.md: about 1 run in 75 of the rank and the spare): that crash is one more death, survived by the
others, or, when it hit every survivor, the job must end with status 1 and launch's line, never 0.

Real `launch`, mpirun --with-ft ulfm, real signals from outside.  One run of the rank and the spare in the
default suite; the long test runs ULFMTRAIN_PAIR_KILL_RUNS seeds (20) of each schedule.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pair_loop.py"
BOUND_S, RECORDS = 240, 480
SCHEDULES = {"rank-and-spare": (["-n", "3", "--spares", "1"], (1, 3)), "two-ranks": (["-n", "4"], (1, 2)),
             # ... and then a survivor crashes (SIGSEGV) as the reported one did, a few ms after them
             "rank-spare-and-a-crash": (["-n", "3", "--spares", "1"], (1, 3, 2))}
CRASHES = ("Segmentation fault", "signal 11", "Fatal Python error", "Process received signal")


def run_pair(out: Path, schedule: str, seed: int) -> dict:
    """Launch, SIGKILL the schedule's two processes 1-15 ms apart once every process is up (0-1 s later), and
    SIGSEGV its third as long after the second."""
    rng = np.random.default_rng(seed)
    args, victims = SCHEDULES[schedule]
    victims = (*rng.permutation(victims[:2]).tolist(), *victims[2:])
    gap_ms, delay_s = float(rng.uniform(1.0, 15.0)), float(rng.uniform(0.0, 1.0))
    cmd = [sys.executable, "-m", "ulfmtrain", "launch", *args, "--", "python", str(SCRIPT), str(out), str(RECORDS)]
    for tries in (1, 2):
        out.mkdir()
        # Every rank from scratch (not forked warm by the suite's fork server): the kills, 0-1 s after every pid
        # file, then fall from start-up to the first steps, as designed.  Warm, they fell in training, where the
        # spare's successor refills the world and a newcomer writes its files under its spawn job's rank.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "ULFMTRAIN_EVENTS": str(out), "OMP_NUM_THREADS": "1",
                                     "ULFMTRAIN_FORKSERVER": "0"})
        t0 = time.monotonic()
        while not all((out / f"pid{r}").exists() for r in range(4)) and proc.poll() is None \
                and time.monotonic() - t0 < BOUND_S / 2:
            time.sleep(0.01)
        pids = {r: int((out / f"pid{r}").read_text()) for r in range(4) if (out / f"pid{r}").exists()}
        if len(pids) == 4:
            break
        proc.kill()
        err = proc.communicate()[1]
        # Open MPI's runtime failing to start before any rank ran (tests/conftest.py): once more, and say so.
        if tries == 2 or "failed to start" not in err:
            pytest.fail(f"{schedule} seed {seed}: not every process started ({pids}): {err[-3000:]}")
        print(f"{schedule} seed {seed}: Open MPI's runtime did not start; launching once more", file=sys.stderr)
        shutil.rmtree(out)
    time.sleep(delay_s)
    for i, victim in enumerate(victims):
        if i:
            time.sleep(gap_ms / 1e3)
        try:
            os.kill(pids[victim], signal.SIGKILL if i < 2 else signal.SIGSEGV)
        except ProcessLookupError:
            pass        # the job had ended
    try:
        stdout, stderr = proc.communicate(timeout=BOUND_S - (time.monotonic() - t0))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{schedule} seed {seed}: the job did not end within {BOUND_S} s:\n{stderr[-3000:]}")
    return {"victims": victims, "gap_ms": gap_ms, "delay_s": delay_s, "rc": proc.returncode, "stderr": stderr,
            "stdout": stdout, "pids": pids}


def crashed(run: dict) -> set[int]:
    """The launch ranks, other than the schedule's, that crashed (Open MPI's SIGSEGV handler names their pid)."""
    pids = {int(p) for p in re.findall(r"\[[^\]:]+:(\d+)\] \*\*\* Process received signal", run["stderr"])}
    return {r for r, pid in run["pids"].items() if pid in pids} - set(run["victims"])


def check(out: Path, schedule: str, run: dict) -> str:
    diag = (f"{schedule}: killed {run['victims']} {run['gap_ms']:.1f} ms apart, {run['delay_s']:.2f} s in:\n"
            + run["stdout"][-1000:] + run["stderr"][-3000:])
    # A survivor may crash in Open MPI (>= 5.0.10) when a peer's death is reported while it builds a
    # communicator (docs/failures.md): that is a death like the others, which the rest survive; if it hit every
    # survivor, nothing is left to train, and launch must say so (status 1) instead of mpirun's 0.
    lost = crashed(run)
    if not lost and len(run["victims"]) == 2:
        assert not any(c in run["stderr"] for c in CRASHES), diag
    ends = {int(p.stem[3:]): json.loads(p.read_text()) for p in out.glob("end*.json")}
    if lost and not ends:
        assert run["rc"] == 1 and run["stderr"].count("every rank died by a signal") == 1, diag
        return f"every survivor crashed in Open MPI ({sorted(lost)}): status 1"
    assert run["rc"] == 0, diag
    # Nobody lost but the dead, nobody left waiting.
    assert sorted(ends) == sorted(set(range(4)) - set(run["victims"]) - lost), diag
    assert len({e["checksum"] for e in ends.values()}) == 1 and all(e["consistent"] for e in ends.values()), ends
    # One slot fewer per slot lost (of the spare's 3 slots, or of 4 ranks; a world made after the deaths
    # starts smaller): two left, or one after a crash.
    assert all(e["history"][-1] == 4 - len(run["victims"]) - len(lost) for e in ends.values()), ends
    rows = audit_logs(read_rank_logs(out))
    assert len(rows) == 2 and all(r.exact and r.finished for r in rows), rows
    return f"world {next(iter(ends.values()))['history']}" + (f", {sorted(lost)} crashed in Open MPI" if lost else "")


def campaign(tmp_path: Path, schedule: str, seeds: range) -> None:
    outcomes = []
    for seed in seeds:
        out = tmp_path / f"{schedule}-{seed}"
        run = run_pair(out, schedule, seed)
        outcomes.append((seed, run["victims"], round(run["gap_ms"], 1), check(out, schedule, run)))
    print(f"\n{schedule}:", *outcomes, sep="\n  ")


@pytest.mark.timeout(BOUND_S + 60)
def test_a_rank_and_the_waiting_spare_sigkilled_a_few_ms_apart_are_survived(tmp_path):
    campaign(tmp_path, "rank-and-spare", range(1))


RUNS = int(os.environ.get("ULFMTRAIN_PAIR_KILL_RUNS", "20"))


@pytest.mark.long
@pytest.mark.timeout(BOUND_S * RUNS + 60)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_two_sigkills_a_few_ms_apart_again_and_again(tmp_path, schedule):
    campaign(tmp_path, schedule, range(1, RUNS + 1))
