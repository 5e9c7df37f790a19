"""SIGKILL from outside, at a random moment, of a random rank of a user's own loop on the public API.

A seeded helper (this test) waits a random time after the ranks start, then
kills a random rank (sometimes two), as a crashing node would: during start-up,
the initial broadcast, a step, the final check, or after the end.  Every run
must end within its bound; a run whose survivors trained must end with
identical replicas and every record seen exactly once per epoch.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.launching.launch import mpirun_prefix
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
RANKS, BOUND_S = 4, 90
# Four seeds (about 2 minutes) in the default suite; ULFMTRAIN_EXTERNAL_KILL_SEEDS=N or A:B for a campaign.
_seeds = os.environ.get("ULFMTRAIN_EXTERNAL_KILL_SEEDS", "4").split(":")
SEEDS = range(int(_seeds[0])) if len(_seeds) == 1 else range(int(_seeds[0]), int(_seeds[1]))


def run_and_kill(root, out, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    victims = sorted(rng.choice(RANKS, size=1 + (rng.random() < 0.3), replace=False).tolist())
    # Start-up (imports, data, initial broadcast) takes about 3 s here and training about 2 s.
    delays = sorted(rng.uniform(0.0, 6.0, size=len(victims)).tolist())
    cmd = [*mpirun_prefix(RANKS), sys.executable, "-P", str(root / "tests" / "scripts" / "user_loop.py"), str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    while len(pids) < RANKS and time.monotonic() - t0 < 30 and proc.poll() is None:
        for r in range(RANKS):
            p = out / f"pid{r}"
            if r not in pids and p.exists() and p.read_text():
                pids[r] = int(p.read_text())
        time.sleep(0.01)
    t_started = time.monotonic()
    killed = []
    for v, d in zip(victims, delays):
        time.sleep(max(0.0, t_started + d - time.monotonic()))
        try:
            os.kill(pids[v], signal.SIGKILL)
            killed.append((v, round(time.monotonic() - t_started, 2)))
        except (KeyError, ProcessLookupError):
            pass      # it had already ended
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, BOUND_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"seed {seed}: the job did not end within {BOUND_S} s after killing {killed}:\n{stderr[-3000:]}")
    return {"seed": seed, "killed": killed, "wall_s": time.monotonic() - t0, "stderr": stderr, "stdout": stdout}


@pytest.mark.timeout(BOUND_S * len(SEEDS) + 60)
def test_random_external_kills(mpi, tmp_path):
    if not SEEDS:
        pytest.skip("ULFMTRAIN_EXTERNAL_KILL_SEEDS is empty: no seeded external kills asked for")
    outcomes = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        run = run_and_kill(mpi.root, out, seed)
        logs = read_rank_logs(out)
        ends = {r: [x for x in recs if x["event"] == "end"][0] for r, recs in logs.items()
                if any(x["event"] == "end" for x in recs)}
        diag = f"seed {seed}, killed {run['killed']}: {run['stderr'][-2000:]}"
        if not ends:
            # Killed before every rank had the communicator: the job must have ended with one clear line.
            assert "MPI_Init" in run["stderr"] or not logs, diag
            outcomes.append((seed, run["killed"], "ended at start-up"))
            continue
        dead = {v for v, _ in run["killed"]}
        assert set(ends) >= set(range(RANKS)) - dead, diag
        assert len({e["checksum"] for e in ends.values()}) == 1 and all(e["consistent"] for e in ends.values()), diag
        rows = audit_logs(logs)
        assert rows and all(r.exact for r in rows if r.finished), (diag, rows)
        outcomes.append((seed, run["killed"], f"trained, world {next(iter(ends.values()))['world_history']}"))
    print("\nexternal kills:", *outcomes, sep="\n  ")
