"""Hot spares: a spare takes a dead rank's slot with the survivors' live state; the run ends where a
failure-free run ends (same seed, same slots, same reduction order)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs, select
from ulfmtrain.launching.launch import mpirun_command
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
SLOTS, EPOCHS, BOUND_S = 3, 2, 150
TRAIN = ["--epochs", str(EPOCHS), "--model", "cnn-bn", "--bucket-bytes", "20000", "--audit", "--no-progress"]


def train(mpi, digits_dir, out, spares: int, *kills: str, slots: int = SLOTS, ended: list[int] | None = None):
    argv = ["train", "--data", str(digits_dir), "--spares", str(spares), *TRAIN]
    for k in kills:
        argv += ["--kill", k]
    ends, logs, _ = mpi.train_slots(SLOTS + spares, argv, out, EPOCHS, BOUND_S, ended or list(range(slots)))
    return ends[min(ends)], logs


@pytest.fixture(scope="module")
def failure_free(mpi, digits_dir, tmp_path_factory):
    end, _ = train(mpi, digits_dir, tmp_path_factory.mktemp("free"), 0)
    assert end["world_history"] == [SLOTS]
    return end


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("kill", ["1@20:backward", "0@33:allreduce", "2@47:commit"])
def test_a_spare_takes_the_slot_and_the_run_ends_bit_identical(mpi, digits_dir, tmp_path, failure_free, kill):
    end, logs = train(mpi, digits_dir, tmp_path, 1, kill)
    assert end["world_history"] == [SLOTS, SLOTS]                  # the world never shrank
    dead = kill.split("@")[0]
    survivors = [s for s in range(SLOTS) if str(s) != dead]
    (rec,) = select(logs[survivors[0]], "recovery")
    assert rec["removed"] == [] and list(rec["replaced"]) == [dead], rec
    assert end["checksum"] == failure_free["checksum"]             # where the failure-free run ends
    # The lowest survivor sent the state to the spare alone: the other survivor received none of it (a
    # broadcast over every slot made each survivor receive the whole state it already held).
    (other,) = select(logs[survivors[1]], "recovery")
    assert rec["handover_bytes_sent"] > 0 and rec["handover_bytes_received"] == 0, rec
    assert other["handover_bytes_sent"] == other["handover_bytes_received"] == 0, other
    # What the communicators held, counted after the repair (the soak's leak check reads it).
    assert rec["handles"]["comms_retired"] >= 2 and rec["handles"]["comm_index"] > rec["handles"]["comms_retired"]


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("phase", ["commit", "final"])
def test_a_spare_takes_the_slot_at_the_very_end(mpi, digits_dir, tmp_path, failure_free, phase):
    """Slot 1 dies in the last step's commit (the step commits: the repair comes in the final check, after the
    loop ended), or in the final consistency check: the spare still gets the state, and every slot ends on one
    replica."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, f"1@{failure_free['steps'] - 1}:{phase}")
    assert end["world_history"] == [SLOTS, SLOTS]
    (rec,) = select(logs[0], "recovery")
    assert list(rec["replaced"]) == ["1"], rec
    assert end["checksum"] == failure_free["checksum"] and end["steps"] == failure_free["steps"]


@pytest.mark.timeout(2 * BOUND_S)
def test_two_deaths_in_the_final_check_with_one_spare_end_on_one_replica(mpi, digits_dir, tmp_path, failure_free):
    """Slots 1 and 2 die in the final check and one spare is left: it takes slot 1, slot 2's records go to the
    others (the data plan changes in the repair), and every slot left ends on one replica, status 0.  Before, the
    survivors agreed on the checksum of their state before the repair, the spare on the state it was handed:
    "consistent" false on both, status 1 (the membership fuzzer's --hangs seed 47)."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, "1@0:final", "2@0:final", ended=[0, 1])
    assert end["world_history"] == [SLOTS, SLOTS - 1]
    assert end["steps"] == failure_free["steps"] and end["checksum"] == failure_free["checksum"]


@pytest.mark.timeout(2 * BOUND_S)
def test_every_slot_replaced_in_turn_ends_bit_identical(mpi, digits_dir, tmp_path, failure_free):
    """Three spares take all three slots, one after another: the world is restored after each failure."""
    end, logs = train(mpi, digits_dir, tmp_path, 3, "0@10", "1@25:allreduce", "2@40:commit")
    assert end["world_history"] == [SLOTS] * 4
    assert [list(r["replaced"]) for r in select(logs[2], "recovery")][:2] == [["0"], ["1"]]
    assert end["checksum"] == failure_free["checksum"]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_commit_agree_that_fails_on_one_rank_alone(mpi, digits_dir, tmp_path, failure_free):
    """Slot 1's commit agree returns an MPI error there alone, with the agreed value 1: every rank committed and
    its peers are in the next step's reduction.  Before the fix slot 1 repaired alone and everyone waited for
    good; now it says so and trains on."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, "1@30:disagree")
    assert select(logs[1], "injected_error"), "the schedule did not fire"
    assert end["world_history"] == [SLOTS] and not select(logs[0], "recovery")
    assert all(row.exact and row.finished for row in audit_logs(logs))
    assert end["checksum"] == failure_free["checksum"]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_process_failure_that_one_rank_alone_did_not_see_in_the_commit_agree(mpi, digits_dir, tmp_path,
                                                                                failure_free):
    """Slot 2 dies before the commit agree: its peers' agree says 1 with a process failure, but slot 1's says
    success (Open MPI makes the value uniform, not the return code).  Before the fix the two that saw it
    repaired at once while slot 1 went on to the next step, and all three waited for each other for good; now
    nobody repairs on its own return code: the repair comes uniformly at the next step."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, "2@30:commit", "1@30:disagree")
    assert select(logs[1], "injected_error"), "the schedule did not fire"
    assert end["world_history"] == [SLOTS, SLOTS]
    for slot in (0, 1):
        (rec,) = select(logs[slot], "recovery")
        assert rec["step"] == 31 and list(rec["replaced"]) == ["2"], rec
    assert all(row.exact and row.finished for row in audit_logs(logs))
    assert end["checksum"] == failure_free["checksum"]


@pytest.mark.timeout(2 * BOUND_S)
def test_more_failures_than_spares_falls_back_to_shrink(mpi, digits_dir, tmp_path):
    end, logs = train(mpi, digits_dir, tmp_path, 1, "1@15", "2@40", slots=SLOTS - 1)
    assert end["world_history"] == [SLOTS, SLOTS, SLOTS - 1]
    first, second = select(logs[0], "recovery")      # slot 0 survives both
    assert list(first["replaced"]) == ["1"] and second["removed"] == [2] and second["replaced"] == {}


@pytest.mark.timeout(2 * BOUND_S)
def test_two_deaths_at_once_with_one_spare(mpi, digits_dir, tmp_path):
    """One repair both replaces and removes: the spare takes the lower slot and reads what the survivors'
    data plan holds for it (the other dead slot's records included), not a fresh partition."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, "0@30:allreduce", "2@30:allreduce", slots=SLOTS - 1)
    assert end["world_history"] == [SLOTS, SLOTS - 1]
    (rec,) = select(logs[1], "recovery")
    assert list(rec["replaced"]) == ["0"] and rec["removed"] == [2], rec


@pytest.mark.timeout(2 * BOUND_S)
def test_the_sender_dies_in_the_hand_over(mpi, digits_dir, tmp_path):
    """Slot 0 dies as it starts to send slot 1's spare the state: the spare, which holds no records yet, leaves
    the re-plan to the survivors and takes the state from the next one."""
    end, logs = train(mpi, digits_dir, tmp_path, 1, "1@20", "0@20:handover", ended=[1, 2])
    assert end["world_history"] == [SLOTS, SLOTS, SLOTS - 1]
    assert select(logs[0], "kill")[0]["phase"] == "handover"
    assert [r["removed"] for r in select(logs[2], "recovery")] == [[], [0]]


@pytest.mark.timeout(2 * BOUND_S)
def test_two_shrinks_after_the_spares_ran_out(mpi, digits_dir, tmp_path):
    """A slot removed by the first shrink is not reported dead again by the second."""
    _, logs = train(mpi, digits_dir, tmp_path, 1, "1@15", "2@30", "0@45", ended=[1])
    end = select(logs[1], "end")[-1]                # the spare that took slot 1 is the last one left
    assert end["world_history"] == [SLOTS, SLOTS, SLOTS - 1, SLOTS - 2]
    assert [r["removed"] for r in select(logs[1], "recovery")] == [[2], [0]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, kill", [("dies", []), ("dies", ["1@50"]), ("takes-over", ["1@30"]),
                                        ("dies-at-start", []), ("die-first", [])])
def test_spares_in_a_loop_of_your_own(mpi, tmp_path, mode, kill):
    """A spare that dies while it waits is noticed at the release (or at the next failure, which then
    shrinks); a spare that takes a slot in a user's loop ends with the same replica.  A rank that dies inside
    SpareComm's constructor (before its first collective; before, every survivor raised out of it) is repaired
    there: the spare holds its slot from the start.  A rank and the spare that die before it (die-first): the
    slots are still the launch ranks, slot 1 is removed, and slots 0 and 2 train (before, the smaller world was
    cut anew: one slot trained, and launch rank 2 waited as a spare to the end, status 0)."""
    mpi.script(4, mpi.root / "tests" / "scripts" / "spare_loop.py", [str(tmp_path), mode, *kill], timeout=100)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    shrunk = mode == "dies" and kill or mode == "die-first"
    assert sorted(got) == ([0, 2] if shrunk else [0, 1, 2]), got
    assert len({g["checksum"] for g in got.values()}) == 1 and len({g["steps"] for g in got.values()}) == 1, got
    assert got[0]["steps"] > 75 if shrunk else got[0]["steps"] == 75    # 3 slots: 75 steps; 2 take more
    for g in got.values():
        assert g["spares_left"] == 0
        if not g["joined"]:         # the survivors' repairs: slot 1 removed (no spare left) or taken over
            assert g["removed"] == ([[1]] if shrunk else [[]] if kill or mode == "dies-at-start" else []), g
            assert g["history"][0] == 3 and g["history"][-1] == (2 if shrunk else 3), g
    assert (1 in got and got[1]["joined"]) == (mode == "takes-over")


def _spare_pid(out: Path, slots: int, timeout: float = 60.0) -> int:
    """The pid of the waiting spare (launch rank `slots`) once the slots have started: the process mpirun started
    for it (the rank itself, or the shim of a rank forked by the suite's fork server, whose death takes the
    rank with it: forkserver.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = {r["pid"] for recs in read_rank_logs(out).values() for r in select(recs, "start")}
        spare = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_rank(p, out)
                 and _launch_rank(p) == slots]
        if len(started) == slots and len(spare) == 1:
            return spare[0]
        time.sleep(0.05)
    raise AssertionError(f"no waiting spare found among the ranks of {out}")


def _is_rank(proc: Path, out: Path) -> bool:
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"ulfmtrain" in argv and b"train" in argv and str(out).encode() in argv and b"--with-ft" not in argv


def _launch_rank(proc: Path) -> int | None:
    try:
        env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
    except OSError:
        return None
    rank = env.get(b"OMPI_COMM_WORLD_RANK")
    return int(rank) if rank is not None else None


@pytest.mark.timeout(2 * BOUND_S)
def test_a_spare_killed_while_it_takes_over(mpi, digits_dir, tmp_path):
    """Slot 1 dies; the spare is SIGKILLed from outside 0.3 s later, while it repairs and takes the slot over
    (or just after): the survivors repair again, remove slot 1, and train on; every record exactly once."""
    # 6 epochs (about 180 steps): training still runs 0.3 s after the kill, whatever the machine's pace.
    epochs = 6
    argv = ["train", "--data", str(digits_dir), "--out", str(tmp_path), "--spares", "1", *TRAIN, "--kill", "1@20",
            "--epochs", str(epochs)]
    proc = subprocess.Popen(mpirun_command(SLOTS + 1, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=mpi.root)
    spare = _spare_pid(tmp_path, SLOTS)
    killed = threading.Event()

    def kill_the_spare() -> None:
        while proc.poll() is None:
            if select(read_rank_logs(tmp_path).get(1, []), "kill"):
                time.sleep(0.3)
                os.kill(spare, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.005)

    threading.Thread(target=kill_the_spare, daemon=True).start()
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end within {BOUND_S} s after the spare was killed")
    assert killed.is_set(), err[-2000:]
    logs = read_rank_logs(tmp_path)
    ends = {r: select(recs, "end")[-1] for r, recs in logs.items() if select(recs, "end")}
    assert sorted(ends) == [0, 2], err[-3000:]
    assert len({e["checksum"] for e in ends.values()}) == 1 and all(e["consistent"] for e in ends.values()), ends
    assert ends[0]["world_history"][-1] == SLOTS - 1 and ends[0]["alive"] == [0, 2], ends[0]
    rows = audit_logs(logs)
    assert len(rows) == epochs and all(r.exact and r.finished for r in rows), rows


@pytest.mark.timeout(3 * BOUND_S)
def test_dropout_a_cosine_schedule_and_a_grad_scaler_travel_to_spares_bit_identical(mpi, digits_dir, tmp_path):
    """The whole training state goes to a replacement: with dropout, a cosine LR schedule and mixed precision
    (float16 autocast, a GradScaler), two spares take slot 1 (SIGKILL in its backward) and then slot 0 (an
    uncaught exception in its allreduce), and every slot ends where the failure-free run ends: the weights
    (checksum), the learning rate and the scaler's state (a spare's own scaler would count its growth from
    the step it joined; its own generator would draw other dropout masks)."""
    # Batches of 48: 10 steps an epoch, so that the two runs take seconds.
    argv = ["train", "--data", str(digits_dir), *TRAIN, "--batch", "48", "--dropout", "0.3", "--lr-schedule",
            "cosine", "--amp"]
    free, _, _ = mpi.train_slots(SLOTS, argv, tmp_path / "free", EPOCHS, BOUND_S, list(range(SLOTS)))
    kills = ["--kill", "1@4:backward", "--kill", "0@13:allreduce/raise"]
    got, logs, err = mpi.train_slots(SLOTS + 2, [*argv, "--spares", "2", *kills], tmp_path / "spares", EPOCHS,
                                     BOUND_S, list(range(SLOTS)))
    assert err.count("injected failure 0@13:allreduce/raise") == 1, err[-3000:]
    assert got[2]["world_history"] == [SLOTS] * 3, got[2]
    assert [list(r["replaced"]) for r in select(logs[2], "recovery")] == [["1"], ["0"]]
    # What makes these checks strict: a schedule that moved, a scaler that counted steps.
    assert free[0]["lr"] < 0.05 / 10 and free[0]["grad_scaler"]["_growth_tracker"] > 0, free[0]
    for slot in range(SLOTS):
        assert {k: got[slot][k] for k in ("checksum", "lr", "grad_scaler", "steps")} == \
               {k: free[slot][k] for k in ("checksum", "lr", "grad_scaler", "steps")}, (slot, got[slot], free[slot])


def _launch_script(script: Path, out: Path, spares: int, kill: str | None) -> tuple[dict[int, dict], str]:
    """`launch -n SLOTS --spares K -- python SCRIPT OUT` as a user runs it; each slot's OUT/rank<slot>.json."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ULFMTRAIN_KILL"}
    if kill:
        env["ULFMTRAIN_KILL"] = kill
    cmd = [sys.executable, "-m", "ulfmtrain", "launch", "-n", str(SLOTS), "--spares", str(spares), "--",
           "python", str(script), str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=BOUND_S)
    # Training completed on every slot: a true status 0 (the exit protocol), whatever failed on the way.
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}, proc.stderr


@pytest.mark.timeout(3 * BOUND_S)
def test_a_grad_scaler_in_your_own_script_travels_to_spares(mpi, tmp_path):
    """A script of your own (ulfmtrain.connect()) with float16 autocast, a GradScaler whose scale grows every
    2 steps and backs off at an overflow (step 2), a cosine schedule and dropout: two spares take slot 1
    (SIGKILL in forward) and slot 0 (an exception in the allreduce), and every slot ends with the failure-free
    run's weights, scale and schedule; each replacement's scales, from the step it joined, are the dead rank's."""
    script = mpi.root / "tests" / "scripts" / "scaler_spare.py"
    free, _ = _launch_script(script, tmp_path / "free", 0, None)
    assert sorted(free) == [0, 1, 2] and len({f["checksum"] for f in free.values()}) == 1, free
    scales = free[0]["scales"]
    assert scales["2"] < scales["1"] and max(scales.values()) > 2.0**10, scales    # backed off, and grew
    got, err = _launch_script(script, tmp_path / "spares", 2, "1@5,0@9:allreduce/raise")
    assert err.count("injected failure 0@9:allreduce/raise") == 1, err[-3000:]
    assert sorted(got) == [0, 1, 2] and [got[s]["joined"] for s in range(SLOTS)] == [True, True, False], got
    assert got[2]["history"] == [SLOTS] * 3, got[2]
    for slot in range(SLOTS):
        for key in ("checksum", "scaler", "lr", "schedule", "steps"):
            assert got[slot][key] == free[slot][key], (slot, key, got[slot][key], free[slot][key])
        mine = got[slot]["scales"]
        assert mine == {k: v for k, v in free[slot]["scales"].items() if k in mine}, (slot, mine)
    assert min(int(k) for k in got[1]["scales"]) == 5 and min(int(k) for k in got[0]["scales"]) == 9, got


@pytest.mark.timeout(2 * BOUND_S)
def test_a_spare_that_takes_the_writers_slot_inside_a_checkpoint_joins_its_next_round(mpi, digits_dir, tmp_path):
    """Slot 0 dies half-way through writing the checkpoint of step 10 and slot 1 inside the repair that follows
    (the fuzzer's seed 389): the spare takes slot 0 inside the save's agree.  The survivors then run the save
    again (its writer died), and the spare, not in the save, went on training: they waited for it for good.  It
    now joins that round and, holding slot 0, writes the checkpoint."""
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--data", str(digits_dir), "--spares", "1", *TRAIN, "--ckpt-dir", str(ckpt), "--ckpt-every",
            "5", "--step-timeout", "60", "--kill", "0@10:checkpoint", "--kill", "1@5:recovery"]
    ends, logs, _ = mpi.train_slots(SLOTS + 1, argv, tmp_path / "run", EPOCHS, BOUND_S, [0, 2])
    assert ends[0]["world_history"] == [SLOTS, SLOTS - 1], ends
    # Slot 0's log holds the spare's records since the takeover: it wrote step 10's checkpoint.
    (written,) = [r for r in select(logs[0], "checkpoint") if r["step"] == 10 and r.get("ok")]
    assert written.get("write_ms", 0) > 0, written
    (again,) = [r for r in select(logs[2], "checkpoint") if r["step"] == 10]
    assert again["ok"] and again.get("rewritten"), again          # the survivors' save, in a second round
    steps = [r["step"] for r in select(logs[2], "checkpoint") if r.get("ok")]
    assert steps == sorted(set(steps)) and steps[-1] >= 80, steps   # every later save too, each once
