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

from ulfmtrain.launching.launch import mpirun_prefix

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


def same_as(got: dict[int, dict], free: dict[int, dict], *keys: str, steps: str = "") -> None:
    """Every slot ended where the failure-free run's slot ended (`steps`: a {step: value} record, which a
    replacement holds from the step it joined: that part)."""
    assert sorted(got) == sorted(free), (got, free)
    for slot in free:
        for key in keys:
            assert got[slot][key] == free[slot][key], (slot, key, got[slot][key], free[slot][key])
        if steps:
            mine, ref = got[slot][steps], free[slot][steps]
            assert mine and max(mine, key=int) == max(ref, key=int), (slot, mine, ref)
            assert mine == {k: v for k, v in ref.items() if k in mine}, (slot, steps, mine, ref)


@pytest.fixture(scope="module")
def gan_free(tmp_path_factory):
    proc, free = launch("gan.py", tmp_path_factory.mktemp("gan") / "free")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(free) == [0, 1, 2] and len({f["checksum"] for f in free.values()}) == 1, free
    return free


@pytest.mark.timeout(3 * BOUND_S)
@pytest.mark.parametrize("die", ["1@5:g", pytest.param("0@7:d", marks=pytest.mark.long)])
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


@pytest.mark.long
@pytest.mark.timeout(3 * BOUND_S)
def test_a_gan_survives_an_exception_and_a_sigkill_without_spares(tmp_path):
    """Shrink: slot 2 raises in D's forward of step 4 (an uncaught exception, the traceback once), slot 1 dies
    between D's and G's steps of step 8; the survivor ends, its own end check passes, status 0."""
    proc, got = launch("gan.py", tmp_path, "1@8:g", kill="2@4:forward/raise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    assert sorted(got) == [0] and got[0]["steps"] == [12, 12] and got[0]["history"] == [3, 2, 1], got


@pytest.mark.timeout(2 * BOUND_S)
def test_a_replacement_that_restarts_its_own_step_counter_stops_the_job(tmp_path):
    """`for step in range(STEPS)`: the spare that takes slot 1 at step 5 starts its loop over at 0 and would
    train 5 steps past its peers.  Before: the survivors that finished were SIGKILLed, the spare trained alone
    (world [3, 3, 1]) and the job exited 0.  Now: one line names the cause and the fix; status 1, no hang."""
    proc, _ = launch("step_loop.py", tmp_path, "restart", "1@5", spares=1)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "out of phase" in x]
    assert len(lines) == 1 and "range(comm.step, max_steps)" in lines[0], proc.stderr[-3000:]
    assert "slot 1 in opt.step() of step 12" in lines[0] and "slots 0, 2 in the end of the script" in lines[0], \
        lines


@pytest.mark.long
@pytest.mark.timeout(3 * BOUND_S)
def test_a_step_count_loop_with_a_warm_up_resumes_bit_identical(tmp_path):
    """`range(comm.step, STEPS)` and a warm-up on `state.global_step` (comm.track): rank 0 dies at step 2 (inside
    the warm-up) and the spare resumes both counters; every slot ends as in the failure-free run."""
    proc, free = launch("step_loop.py", tmp_path / "free", "resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, got = launch("step_loop.py", tmp_path / "spare", "resume", "0@2", spares=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_as(got, free, "checksum", "global_step", "lr")
    assert got[0]["joined"] and got[0]["global_step"] == 12, got


@pytest.mark.timeout(BOUND_S)
def test_a_bare_fault_tolerant_comm_under_spares_refuses_instead_of_training_the_spare(tmp_path):
    """Before: the spare of `launch --spares 1` trained as a fourth rank, silently.  Now: one line pointing at
    connect(), status 2, nothing trained."""
    proc, got = launch("bare_comm.py", tmp_path, spares=1)
    assert proc.returncode == 2 and not got, (proc.returncode, got, proc.stderr[-3000:])
    assert proc.stderr.count("ulfmtrain.connect()") == 1, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def metric_free(tmp_path_factory):
    proc, free = launch("metric_loop.py", tmp_path_factory.mktemp("metric") / "free")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return free


@pytest.mark.timeout(3 * BOUND_S)
@pytest.mark.parametrize("die", ["1@4:metric", pytest.param("0@0:start", marks=pytest.mark.long)])
def test_a_failure_inside_a_metric_allreduce_with_a_spare_is_survived_bit_identical(metric_free, tmp_path, die):
    """A rank dies while its peers reduce a metric between steps (or, rank 0, before any optimizer exists: the
    peers' first comm.allreduce leaked the internal StartOver there).  The peers finish the metric without it;
    the spare takes the slot at the next step and the run ends as the failure-free one."""
    proc, got = launch("metric_loop.py", tmp_path, die, spares=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "StartOver" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "vacant until the next step" in proc.stderr, proc.stderr[-3000:]
    same_as(got, metric_free, "checksum")
    slot, step = int(die[0]), int(die.split("@")[1].split(":")[0])
    survivor = got[2 if slot != 2 else 0]
    assert survivor["history"] == [3, 2, 3], survivor
    if die.endswith("metric"):      # the metric of that step is the mean over the two that reduced it
        assert survivor["metrics"] != metric_free[2]["metrics"] and survivor["metrics"][str(step + 1)] == \
            metric_free[2]["metrics"][str(step + 1)], survivor
    else:
        assert survivor["ranks"] == 2 and metric_free[2]["ranks"] == 3, survivor


@pytest.fixture(scope="module")
def lbfgs_free(tmp_path_factory):
    proc, free = launch("closure.py", tmp_path_factory.mktemp("lbfgs") / "free", "lbfgs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len({json.dumps(f["losses"]) for f in free.values()}) == 1, free     # every rank: the global mean
    return free


@pytest.mark.timeout(3 * BOUND_S)
def test_lbfgs_with_a_spare_killed_between_two_evaluations_ends_bit_identical(lbfgs_free, tmp_path):
    """Before: `opt.step(closure)` stepped LBFGS without its closure (TypeError on every rank).  Slot 1 dies
    inside the second evaluation of step 3, after LBFGS moved the parameters: the survivors roll the step back
    to its start, hand the spare that state, and redo the whole step with it."""
    proc, got = launch("closure.py", tmp_path, "lbfgs", spares=1, kill="1@3:allreduce")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replaced by spares" in proc.stderr, proc.stderr[-3000:]
    same_as(got, lbfgs_free, "checksum", steps="losses")


@pytest.mark.long
@pytest.mark.timeout(3 * BOUND_S)
def test_lbfgs_survives_a_shrink_in_the_middle_of_a_step(tmp_path):
    """Without a spare: rank 0 dies inside step 3's second evaluation; the survivors redo the step on two ranks,
    agree at the end (status 0) and every later step's loss is one mean."""
    proc, got = launch("closure.py", tmp_path, "lbfgs", kill="0@3:allreduce")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(got) == [1, 2] and got[1]["history"] == [3, 2], got
    assert got[1]["losses"] == got[2]["losses"] and got[1]["checksum"] == got[2]["checksum"], got


@pytest.mark.long
@pytest.mark.timeout(4 * BOUND_S)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_closure_with_sgd_or_adam_and_a_spare_ends_bit_identical(tmp_path, kind):
    proc, free = launch("closure.py", tmp_path / "free", kind)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, got = launch("closure.py", tmp_path / "spare", kind, spares=1, kill="2@4:forward")
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_as(got, free, "checksum", steps="losses")


@pytest.mark.long
@pytest.mark.timeout(BOUND_S)
def test_a_collective_on_one_rank_only_stops_the_job_with_one_line(tmp_path):
    """Slot 2 alone reduces one more metric at step 3: its reduction would have met its peers' next step (a hang
    or a mis-sum).  Every rank ends with status 1; one line says where each was."""
    proc, _ = launch("metric_loop.py", tmp_path, "2@3:extra")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "out of phase" in x]
    assert len(lines) == 1 and "slot 2 in comm.allreduce(max) after step 4" in lines[0], proc.stderr[-3000:]
    assert "slots 0, 1 in comm.allreduce(mean) after step 4" in lines[0], lines


@pytest.mark.long
@pytest.mark.timeout(BOUND_S)
def test_optimizers_stepped_in_another_order_on_one_rank_stop_the_job(tmp_path):
    proc, _ = launch("gan.py", tmp_path, "1@3:swap")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "out of phase" in x]
    assert len(lines) == 1 and "slot 1 in opt1.step() of step 3" in lines[0], proc.stderr[-3000:]


@pytest.mark.timeout(BOUND_S)
def test_a_replacement_whose_loop_ends_on_the_world_size_stops_the_job_instead_of_a_respawn_loop(tmp_path):
    """Respawn, a loop `while ... comm.size < 3`: the newcomer joins at the start of the step its peers are in,
    sees 3 and ends its script at once.  Before: it left as a rank that exits mid-run, was respawned, and did so
    again, for good (a livelock: 180 s, the test's bound).  Now every rank ends with status 1 and one line that
    names the replacement and the cause."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*mpirun_prefix(3), sys.executable, "-P", str(SCRIPTS / "slot_device.py"), str(out), "size-loop"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND_S - 10,
                              env={**os.environ, "ULFMTRAIN_REPLACE": "respawn"})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job did not end (a respawn loop?): {str(exc.stderr)[-2000:]}")
    lines = [x for x in proc.stderr.splitlines() if "out of phase" in x]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and "a replacement that took no step with its peers" in lines[0], proc.stderr[-3000:]
    assert "slot 1 in the end of the script" in lines[0] and "slots 0, 2 in opt.step() of step" in lines[0], lines
    assert proc.stderr.count("ended its program while its peers train on") <= 1, proc.stderr[-3000:]


@pytest.mark.timeout(BOUND_S)
def test_replicas_that_end_different_in_a_script_end_the_job_with_status_1(tmp_path):
    """Slot 2 changes a weight by hand after its loop.  Before: nothing checked a script's replicas, exit 0.  Now
    the end check: status 1 and one line naming the slot and the step."""
    proc, got = launch("step_loop.py", tmp_path, "restart", "2@nudge")
    assert proc.returncode == 1 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "replicas ended different" in x]
    assert len(lines) == 1 and "after step 12: slot 2 holds another state than slot 0" in lines[0], lines


@pytest.mark.timeout(2 * BOUND_S)
def test_a_script_that_calls_mpi_finalize_itself_ends_as_at_its_last_line(tmp_path):
    """mpi4py's habit, `MPI.Finalize()` at the script's end.  Before, MPI ended under ulfmtrain's end: the end
    check went unrun, and the job aborted (MPI_Comm_size after MPI_FINALIZE, status 14), or with replicas that
    differed said every rank had died by a signal.  Now the call ends the rank as its last line would: status 0
    and the script goes on after it; replicas that differ end the job with status 1 and the end check's line."""
    proc, got = launch("step_loop.py", tmp_path / "same", "restart", "-", "finalize")
    assert proc.returncode == 0 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    assert sorted(x for x in proc.stdout.splitlines() if "after MPI.Finalize()" in x) == \
        [f"slot {s} after MPI.Finalize()" for s in range(3)], proc.stdout[-2000:]
    assert "MPI_FINALIZE" not in proc.stderr and "error" not in proc.stderr, proc.stderr[-3000:]
    proc, got = launch("step_loop.py", tmp_path / "nudged", "restart", "2@nudge", "finalize")
    assert proc.returncode == 1 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "replicas ended different" in x]
    assert len(lines) == 1 and "after step 12: slot 2 holds another state than slot 0" in lines[0], lines
    # mpi4py imported after ulfmtrain (the rank leaves without MPI_Finalize under ULFM), then an exception: it
    # ends the process with its traceback (before, it waited for good to leave a job it had left).
    proc, got = launch("step_loop.py", tmp_path / "raised", "restart", "-", "finalize-raise")
    assert proc.returncode == 1 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    assert proc.stderr.count("RuntimeError: after MPI.Finalize()") == 3, proc.stderr[-3000:]


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("slot", [1, 0])
def test_a_rank_whose_exception_hook_did_not_finish_fails_and_its_peer_trains_on(tmp_path, slot):
    """Slot 1 (or 0) raises in step 5 (ULFMTRAIN_KILL's /raise) and the exception hook does not finish: here the
    script's own hook, which ulfmtrain's calls to print the traceback, fails (as one that a signal handler's raise
    cuts short as it begins: torch's SIGCHLD storm after a worker died).  Before, in a rank forked by the fork
    server (the suite's, launch's) the hook's error was lost with nothing printed, and the rank ended as if its
    program had: it ran the end check while its peer stepped, and the job of two ended with status 1, "out of
    phase".  Now the hook's error and the original are printed, and the rank leaves as failed at exit
    (sys.last_traceback): the other slot trains on alone to the end, status 0."""
    proc, got = launch("step_loop.py", tmp_path, "resume", "-", "hook-raises", kill=f"{slot}@5/raise", slots=2)
    other = 1 - slot
    assert proc.returncode == 0 and sorted(got) == [other], proc.stderr[-3000:]
    assert got[other]["global_step"] == 12 and got[other]["history"] == [2, 1], got
    assert f"world rank {slot} failed" in proc.stderr and "out of phase" not in proc.stderr, proc.stderr[-3000:]
    assert "OSError: the script's log is gone" in proc.stderr and "InjectedFailure" in proc.stderr, proc.stderr[-3000:]
