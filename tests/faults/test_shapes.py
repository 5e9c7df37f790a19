"""Scripts in shapes other than the README's one-model loop, run as a user runs them
(`python -m ulfmtrain launch -n 3 [--spares K] -- python tests/scripts/SCRIPT OUT ...`), with real SIGKILLs and
exceptions: each ends where its failure-free run ends, or stops with one line and status 1, never silently wrong.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SLOTS, BOUND_S = 3, 150


def launch(script: str, out: Path, *args: str, spares: int = 0, kill: str | None = None,
           slots: int = SLOTS) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """`launch -n SLOTS --spares K -- python SCRIPT OUT ARGS`; mpirun's result and each slot's OUT/rank<slot>.json."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "ULFMTRAIN_KILL"}
    if kill:
        env["ULFMTRAIN_KILL"] = kill
    cmd = [sys.executable, "-m", "ulfmtrain", "launch", "-n", str(slots), "--spares", str(spares), "--",
           "python", str(SCRIPTS / script), str(out), *args]
    try:
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job did not end within {BOUND_S} s (a hang): {exc.stderr}")
    return proc, {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def same_as(got: dict[int, dict], free: dict[int, dict], *keys: str) -> None:
    """Every slot ended where the failure-free run's slot ended."""
    assert sorted(got) == sorted(free), (got, free)
    for slot in free:
        for key in keys:
            assert got[slot][key] == free[slot][key], (slot, key, got[slot][key], free[slot][key])


@pytest.fixture(scope="module")
def gan_free(tmp_path_factory):
    proc, free = launch("gan.py", tmp_path_factory.mktemp("gan") / "free")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(free) == [0, 1, 2] and len({f["checksum"] for f in free.values()}) == 1, free
    return free


@pytest.mark.timeout(3 * BOUND_S)
@pytest.mark.parametrize("die", ["1@5:g", "0@7:d"])
def test_a_gan_with_a_spare_ends_bit_identical(gan_free, tmp_path, die):
    """Two models and two optimizers: a spare takes the slot that died before G's step (D's committed: the spare
    must skip D's step of that iteration and join G's) or before D's (rank 0), and every slot ends with the
    failure-free run's models and optimizers.  Before: every optimizer made itself the hand-over's target, the
    spare's first one received the last one's state, and it died of a size mismatch (the world shrank, exit 0)."""
    proc, got = launch("gan.py", tmp_path, die, spares=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replaced by spares" in proc.stderr, proc.stderr[-3000:]
    same_as(got, gan_free, "checksum", "steps")
    assert [got[s]["joined"] for s in range(SLOTS)] == [s == int(die[0]) for s in range(SLOTS)], got
