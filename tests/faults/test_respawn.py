"""Respawn: a process spawned in the background takes an empty slot (or refills the spares) at a step boundary,
with the survivors' live state, while the survivors keep training; the world size comes back."""
from __future__ import annotations

import json

import pytest

from ulfmtrain.core.events import read_rank_logs, select
from ulfmtrain.membership.respawn import LEAVE_S, SPAWN_RETRIES
from ulfmtrain.tools.audit import audit_logs
from ulfmtrain.training.config import TrainConfig

pytestmark = pytest.mark.faults
BOUND_S = 180
TRAIN = ["--model", "cnn-bn", "--bucket-bytes", "20000", "--audit", "--no-progress", "--replace", "respawn"]


def train(mpi, digits_dir, out, slots: int, spares: int, epochs: int, *kills: str, env: dict | None = None,
          ended: list[int] | None = None, args: tuple[str, ...] = ()):
    """Slot 0's end record, every slot's log and mpirun's stderr (ended: the slots that end; default all)."""
    argv = ["train", "--data", str(digits_dir), "--spares", str(spares), "--epochs", str(epochs), *TRAIN, *args]
    for k in kills:
        argv += ["--kill", k]
    ends, logs, stderr = mpi.train_slots(slots + spares, argv, out, epochs, BOUND_S,
                                         list(range(slots)) if ended is None else ended, env=env)
    return ends[0], logs, stderr


def respawns(logs, slot: int, status: str) -> list[dict]:
    return [r for r in select(logs[slot], "respawn") if r["status"] == status]


def sizes(history: list[int]) -> list[int]:
    """The sizes a world without spares went through: an MPI error with no rank dead (two or three per 30
    failures in older soaks, when the spawning rank still spawned and merged on a thread) is redone on a
    rebuilt communicator of the same size, which adds an entry."""
    return [n for i, n in enumerate(history) if i == 0 or n != history[i - 1]]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_respawned_process_takes_the_empty_slot_while_the_survivors_train(mpi, digits_dir, tmp_path):
    # 15 epochs (345 steps): the newcomer joins a few to a few dozen steps after the kill at step 30.
    end, logs, _ = train(mpi, digits_dir, tmp_path, 4, 0, 15, "1@30")
    assert end["world_history"] == [4, 3, 4]
    (spawning,) = respawns(logs, 0, "spawning")
    (joined,) = respawns(logs, 0, "joined")
    assert spawning["slots"] == [1] and joined["slots"] == [1] and joined["size_after"] == 4
    # Training never waited for the newcomer's start: the survivors committed steps, three-wide, until the join
    # (a few: a fork of the fork server is ready in about 0.1 s).
    shrunk = [r for r in select(logs[0], "step") if spawning["t"] < r["t"] < joined["t"]]
    assert shrunk and {r["world"] for r in shrunk} == {3}, (spawning, joined)
    assert joined["ready_s"] > 0 and joined["join_ms"] < 5000
    (newcomer,) = respawns(logs, 1, "newcomer")
    assert newcomer["slots"] == [1] and select(logs[1], "end")[-1]["steps"] == end["steps"]
    assert newcomer["forked"], newcomer          # a fork of this host's fork server, not a fresh Python
    # The learning rate followed the world down and back up (to the last bit or so), on the newcomer too, which
    # got the shrunk one: the same lr on every rank.
    lr, lrs = TrainConfig().lr, select(logs[0], "lr")
    assert [x["world"] for x in lrs] == [4, 3, 4], lrs
    assert [x["lr"] for x in lrs] == pytest.approx([lr, lr * 3 / 4, lr], rel=1e-12)
    mine = logs[1][logs[1].index(newcomer):]         # slot 1's log: the killed rank's lines, then the newcomer's
    assert [(x["step"], x["lr"]) for x in select(mine, "lr")] == [(lrs[-1]["step"], lrs[-1]["lr"])]


@pytest.mark.long          # about a minute: two runs of 40 epochs
@pytest.mark.timeout(3 * BOUND_S)
def test_respawn_refills_the_spare_and_the_run_ends_bit_identical(mpi, digits_dir, tmp_path):
    """The spare takes slot 1; a respawned process becomes the new spare and takes slot 2: no shrink at all.  Each
    spare spawned its successor while it waited: no training rank spawned (none waited in MPI_Comm_spawn)."""
    free, _, _ = train(mpi, digits_dir, tmp_path / "free", 3, 1, 40)
    end, logs, _ = train(mpi, digits_dir, tmp_path / "killed", 3, 1, 40, "1@20", "2@1000")
    joined = respawns(logs, 0, "joined")[0]           # (another refill may join after the second takeover)
    assert joined["slots"] == [] and joined["spares"] == 1 and joined["step"] < 1000, joined
    # Two takeovers and the refill (and a second refill if it joins before the end): never shrunk.
    assert set(end["world_history"]) == {3} and len(end["world_history"]) >= 4, end
    assert [list(r["replaced"]) for r in select(logs[0], "recovery")] == [["1"], ["2"]]
    assert end["checksum"] == free["checksum"]
    assert respawns(logs, 0, "spawning") == [] and respawns(logs, 1, "spawning"), logs[1]


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize("spares", [0, 1])
def test_checkpoints_go_on_after_a_newcomer_or_a_spare_takes_a_slot(mpi, digits_dir, tmp_path, spares):
    """With --ckpt-dir, the process that takes slot 1 (a respawned one, or the spare) joins the survivors'
    checkpoints instead of starting a run of its own: it hung there, alone in the directory check of a new run."""
    from ulfmtrain.checkpoint.format import load_latest

    ckpt = tmp_path / "ckpt"
    argv = ["train", "--data", str(digits_dir), "--spares", str(spares), "--epochs", "6", *TRAIN,
            "--ckpt-dir", str(ckpt), "--step-timeout", "60", "--kill", "1@30"]
    ends, logs, _ = mpi.train_slots(3 + spares, argv, tmp_path / "run", 6, BOUND_S, [0, 1, 2])
    end = ends[0]
    assert end["world_history"][-1] == 3, end
    mine = logs[1][max(i for i, r in enumerate(logs[1]) if r["event"] == "kill"):]   # after slot 1's kill
    saves = [r["step"] for r in select(mine, "checkpoint")]
    assert saves and saves == [r["step"] for r in select(logs[0], "checkpoint") if r["step"] >= saves[0]], saves
    assert load_latest(ckpt, warn=pytest.fail).step == end["steps"]     # the last epoch's, after the takeover


@pytest.mark.timeout(2 * BOUND_S)
def test_more_failures_than_spares_spares_first_then_shrink_then_respawn(mpi, digits_dir, tmp_path):
    """The spare spawned its successor while it waited.  It takes slot 1 at step 15; its successor is ready, and
    the join it leads is due at step 17's start, where slot 2 dies: the world shrinks (that join fails first, when
    slot 2 died inside it: either way the successor is kept), and the successor takes slot 2 when it joins.  The
    training ranks spawned nothing for it.  (Before the spare spawned, slot 0 spawned the refill at step 16's
    boundary, and every training rank waited for that spawn.)"""
    end, logs, _ = train(mpi, digits_dir, tmp_path, 3, 1, 15, "1@15", "2@17")
    assert end["world_history"][:3] == [3, 3, 2] and end["world_history"][-1] == 3, end
    first, second = select(logs[0], "recovery")[:2]
    assert list(first["replaced"]) == ["1"] and second["removed"] == [2]
    # The spare's own record (it logs it once it trains: slot 1's log).
    spawning, joined = respawns(logs, 1, "spawning")[0], respawns(logs, 0, "joined")[0]
    assert spawning["slots"] == [] and spawning["t_spawn"] < first["wall_error"], (spawning, first)
    assert joined["slots"] == [2] and joined["size_after"] == 3 and joined["t_spawn"] == spawning["t_spawn"], joined
    assert all(r["t"] > joined["t"] for r in respawns(logs, 0, "spawning")), respawns(logs, 0, "spawning")


def _kill_a_fork(nth: int, after_s: float, killed: list[float]) -> None:
    """SIGKILL the nth process (from 0) forked by a fork server from now on, `after_s` seconds after it appeared (the
    suite's warm server forks the ranks too: warm_ranks; forks keep the server's command line); the kill's time
    goes to `killed`."""
    import os
    import signal
    import time
    from pathlib import Path

    def forks() -> set[int]:
        found = {}
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and b"ulfmtrain.membership.forkserver" in (d / "cmdline").read_bytes():
                    found[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
        return {p for p, parent in found.items() if parent in found}

    before, seen, deadline = forks(), [], time.monotonic() + 60
    while time.monotonic() < deadline:
        seen += sorted(forks() - before - set(seen))
        if len(seen) > nth:
            time.sleep(after_s)
            os.kill(seen[nth], signal.SIGKILL)
            killed.append(time.time())
            return
        time.sleep(0.02)


@pytest.mark.timeout(2 * BOUND_S)
def test_a_spares_successor_killed_while_it_waits_fails_its_join_alike_and_is_spawned_again(mpi, digits_dir,
                                                                                            tmp_path):
    """The spare's successor, spawned while the spare waits, is SIGKILLed from outside once it waits merged with
    the spare; then slot 1 dies, and the spare takes it and leads the successor's join.  The dead successor does
    not answer: the join fails alike everywhere, and a training rank spawns the missing spare.  (Every survivor
    waited in MPI_Intercomm_create for good: a soak stalled there until a kill of the spare ended it.)"""
    import threading

    killed: list[float] = []
    killer = threading.Thread(target=_kill_a_fork, args=(4, 1.0, killed))     # the fifth: after 3 slots and the spare
    killer.start()
    end, logs, _ = train(mpi, digits_dir, tmp_path, 3, 1, 60, "1@500")      # LEAVE_S after it: a spawn
    killer.join()
    (kill,) = [k for k in select(logs[1], "kill")]
    assert killed and killed[0] < kill["t"], (killed, kill)       # the successor died first
    assert list(select(logs[0], "recovery")[0]["replaced"]) == ["1"]
    failed = respawns(logs, 0, "failed")
    assert failed and failed[0]["reason"] == "a process failed during the join" and failed[0]["t"] > kill["t"]
    joined = respawns(logs, 0, "joined")
    assert joined and joined[-1]["spares"] == 1 and joined[-1]["t"] > failed[0]["t"], joined
    assert respawns(logs, 0, "spawning"), "a training rank spawned the missing spare"
    assert set(end["world_history"]) == {3}, end


@pytest.mark.long          # about a minute: two spawns one after the other
@pytest.mark.timeout(2 * BOUND_S)
def test_the_spawning_rank_dies_and_another_survivor_respawns(mpi, digits_dir, tmp_path):
    """Slot 0, the lowest survivor, spawns after the first kill (at step 31's boundary) and is killed while its
    batch starts: in step 33, after one boundary saw the batch not yet ready (a spawn takes 0.1 s or more) and
    before a second could join it (at step 40 it could have joined first)."""
    end, logs, _ = train(mpi, digits_dir, tmp_path, 4, 0, 45, "1@30", "0@33")
    assert sizes(end["world_history"])[:3] == [4, 3, 2] and end["world_history"][-1] == 4, end
    failed = respawns(logs, 2, "failed")
    assert failed and failed[0]["reason"] == "the spawning rank failed", failed
    assert sorted(s for r in respawns(logs, 2, "joined") for s in r["slots"]) == [0, 1]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_respawned_process_that_dies_once_ready_is_survived_and_replaced(mpi, digits_dir, tmp_path):
    """Slot 0 spawns after slot 1's kill and SIGKILLs the process once it says it is ready, right before merging
    with it (kill phase `ready`).  Open MPI 5.0.x then fails that merge (MPI_ERR_INTERN: slot 0 says so, trains
    on shrunk and spawns again LEAVE_S later), or slot 0 crashes inside MPI soon after (a segfault in a later
    reduction, about half the runs), or never returns from the merge (then slot 0 ends itself after the spawn
    bound, with one line and by SIGKILL: the others were never told of an exit, and hung in CI).  Whichever:
    training goes on, exactly once, and the world comes back to 4."""
    # 80 epochs (1840 steps, about 45 s on a 2-core CI box): the world is back to 4 within about 10 s of step 30
    # whichever way it goes (a spawn bound of 5 s, or LEAVE_S, then a spawn and a join): 4x room on that box.
    end, logs, stderr = train(mpi, digits_dir, tmp_path, 4, 0, 80, "1@30", "0@30:ready",
                              env={"ULFMTRAIN_SPAWN_TIMEOUT": "5"})
    (kill,) = select(logs[0], "kill")
    assert kill["phase"] == "ready" and kill["pid"] > 0, kill
    assert end["world_history"][-1] == 4, end
    (first, *rest) = select(logs[2], "recovery")
    if not rest:            # slot 0 lived: a failed spawn, said so by slot 0, and spawned again
        (failed,) = respawns(logs, 0, "failed")
        assert failed["reason"].startswith("a newcomer failed before it was ready"), failed
        again = [r for r in respawns(logs, 0, "spawning") if r["t"] > failed["t"]]
        assert again and again[0]["t"] - failed["t"] >= LEAVE_S and again[0]["slots"] == [1], again
        assert end["world_history"] == [4, 3, 4], end
    else:                   # slot 0 died (a crash, or its bound: then with one line), and both slots came back
        assert rest[0]["removed"] == [0] and sizes(end["world_history"])[:3] == [4, 3, 2], (rest, end)
        assert sorted(s for r in respawns(logs, 2, "joined") for s in r["slots"]) == [0, 1]
        assert "Segmentation fault" in stderr or "did not finish in 5 s" in stderr, stderr[-3000:]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_respawned_process_that_fails_before_it_is_ready_is_spawned_again_up_to_the_limit(
        mpi, digits_dir, tmp_path):
    """Every process slot 0 respawns fails with an error before it is ready (kill phase `newcomer`).  Open MPI
    tells slot 0 nothing of it (the newcomer never sent to it), so slot 0 gives up on it after the spawn bound,
    says so, spawns again LEAVE_S later, SPAWN_RETRIES times, then trains on at 3.  (Before, slot 0 waited for
    the ready message for good and never spawned again.)"""
    epochs = 130     # room for three spawns, each given up after 2 s, LEAVE_S apart (about 19 s; 28 s here)
    end, logs, stderr = train(mpi, digits_dir, tmp_path, 4, 0, epochs, "1@30", "0@30:newcomer",
                              env={"ULFMTRAIN_SPAWN_TIMEOUT": "2"}, ended=[0, 2, 3])     # slot 1 stays empty
    failed = respawns(logs, 0, "failed")
    assert len(failed) == SPAWN_RETRIES + 1, (failed, stderr[-3000:])
    assert all(f["reason"] == "a newcomer was not ready within 2 s of its spawn" for f in failed), failed
    spawns = respawns(logs, 0, "spawning")
    assert len(spawns) == SPAWN_RETRIES + 1 and all(s["slots"] == [1] for s in spawns), spawns
    for before, after in zip(failed, spawns[1:]):
        assert after["t"] - before["t"] >= LEAVE_S, (before, after)
    assert not respawns(logs, 0, "joined") and end["world_history"] == [4, 3], end
    assert stderr.count("a respawned process failed before it joined") == SPAWN_RETRIES + 1, stderr[-3000:]


@pytest.mark.timeout(2 * BOUND_S)
@pytest.mark.parametrize(("victim", "phase"), [(2, "join"), (0, "join"), (2, "split"), (0, "split"),
                                               (2, "intercomm")])
def test_a_death_inside_the_join_leaves_the_world_at_its_size_and_says_so(mpi, digits_dir, tmp_path, victim,
                                                                         phase):
    """A slot dies after the join's intercommunicator, before the merge (slot 0: the spawning rank, which leads
    the join), or after the merge, before the split of the training communicator, or once the survivors agreed to
    make the intercommunicator, before MPI_Intercomm_create: the survivors decide together not to take the joined
    world, say so, train on shrunk, and a later spawn refills the world.  (At `split` every rank used to raise
    MPI_ERR_PROC_FAILED from the split, and the job ended with status 1.)  At `intercomm` the survivors' call
    returns an error, the newcomer's does not: it leaves at its bound ($ULFMTRAIN_SPAWN_TIMEOUT, 5 s here), and
    only then is the slot spawned again."""
    # 80 epochs: room for the second spawn, of two processes, LEAVE_S after the failed join, to join before the end
    # (about 10 s after step 30; 80 epochs take about 45 s on a 2-core CI box: 4x room).
    env = {"ULFMTRAIN_SPAWN_TIMEOUT": "5"} if phase == "intercomm" else None
    end, logs, _ = train(mpi, digits_dir, tmp_path, 4, 0, 80, "1@30", f"{victim}@30:{phase}", env=env)
    (kill,) = select(logs[victim], "kill")
    assert kill["phase"] == phase
    failed = respawns(logs, 3, "failed")
    assert failed and failed[0]["reason"] == "a process failed during the join", failed
    # Not at once: a spawn that overlapped the exit of the newcomer sent away deadlocked inside Open MPI.
    spawner = min({0, 2, 3} - {victim})           # the lowest survivor
    its = respawns(logs, spawner, "failed")[0]
    again = [r for r in respawns(logs, spawner, "spawning") if r["t"] > its["t"]]
    assert again and again[0]["t_spawn"] - its["t"] >= LEAVE_S, (its, again)
    assert sizes(end["world_history"])[:3] == [4, 3, 2] and end["world_history"][-1] == 4, end
    assert all(row.exact and row.finished for row in audit_logs(logs))
    # Nothing was lost: the survivors train on through the failed join and a later spawn joins.
    assert sorted(s for r in respawns(logs, 3, "joined") for s in r["slots"]) == sorted({1, victim})


@pytest.mark.timeout(2 * BOUND_S)
def test_a_death_inside_the_merge_ends_the_job_and_supervise_resumes_from_the_checkpoint_before_the_join(
        mpi, digits_dir, tmp_path):
    """Slot 2 dies once the survivors agreed to merge: Open MPI 5.0.x never returns from that merge, so its bound
    ($ULFMTRAIN_SPAWN_TIMEOUT) ends the job with one line; supervise resumes it from the checkpoint written at the
    boundary before the join, and no step that was updated is redone."""
    out = tmp_path / "run"
    argv = ["train", "--data", str(digits_dir), "--out", str(out), "--epochs", "20", *TRAIN, "--recovery", "shrink",
            "--ckpt-dir", str(out / "ckpt"), "--kill", "1@30", "--kill", "2@30:merge"]
    proc = mpi.supervise(4, argv, "--timeout", str(BOUND_S), timeout=2 * BOUND_S - 10,
                         env={"ULFMTRAIN_SPAWN_TIMEOUT": "5"})
    diag = proc.stderr[-3000:]
    assert proc.returncode == 0, diag
    assert "ulfmtrain: error: joining a respawned process did not finish in 5 s" in proc.stderr, diag
    first = read_rank_logs(out / "attempt-1")
    assert [k["phase"] for k in select(first[2], "kill")] == ["merge"]
    spawned = respawns(first, 0, "spawning")[-1]["step"]
    saved = select(first[0], "checkpoint")[-1]["step"]
    updated = max(r["step"] for r in select(first[0], "step"))     # the last step whose update was applied
    assert spawned < saved == updated + 1, (spawned, saved, updated)
    second = read_rank_logs(out / "attempt-2")
    assert [r["step"] for r in select(second[0], "resume")] == [saved]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["attempts"] == 2 and summary["consistent"] and summary["world_history"] == [4], summary


@pytest.mark.timeout(2 * BOUND_S)
def test_a_slot_left_vacant_by_a_scripts_collective_is_the_spares_not_a_spawns(mpi, tmp_path):
    """A user's loop with respawn and one spare (spare_loop.py respawn-spare, the reduction in step()): slot 1
    dies inside the loop's own comm.allreduce, between backward and the step.  That repair leaves slot 1 vacant;
    the spare takes it when the step starts its reduction (at_step_start), before the step's boundary, where a
    vacant slot counted as empty would have made slot 0 spawn beside the spare's own successor (two owners of a
    batch; a review asked, and boundaries no longer count vacant slots).  The spare's successor joins, and no
    training rank ever spawns."""
    mpi.script(4, mpi.root / "tests" / "scripts" / "spare_loop.py", [str(tmp_path), "respawn-spare", "1@30"],
               timeout=BOUND_S)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(got) == [0, 1, 2] and got[1]["joined"] and not got[0]["joined"], got
    # (2 while slot 1 was vacant: never removed.)
    assert len({g["checksum"] for g in got.values()}) == 1 and got[0]["history"][:3] == [3, 2, 3], got
    assert got[0]["history"][-1] == 3 and not any(got[0]["removed"]), got
    assert "joined" in got[0]["records"] and "spawning" not in got[0]["records"], got[0]["records"]


@pytest.mark.timeout(2 * BOUND_S)
def test_respawn_in_a_loop_of_your_own(mpi, tmp_path):
    """A user's loop (tests/scripts/spare_loop.py respawn, 3 ranks, 20 epochs): the newcomer runs the program
    again; distributed_sampler rebalances at the join and scale_lr follows the world down and back up."""
    mpi.script(3, mpi.root / "tests" / "scripts" / "spare_loop.py", [str(tmp_path), "respawn", "1@20"],
               timeout=BOUND_S)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(got) == [0, 1, 2], got
    assert len({g["checksum"] for g in got.values()}) == 1 and len({g["steps"] for g in got.values()}) == 1, got
    assert sizes(got[0]["history"]) == [3, 2, 3] and got[1]["joined"] and not got[0]["joined"], got
    assert got[0]["samples"] == 20 * 1200, got[0]       # every record once per epoch, through shrink and join
    assert len({g["lr"] for g in got.values()}) == 1 and got[0]["lr"] == pytest.approx(0.05, rel=1e-12), got


@pytest.mark.timeout(90)
@pytest.mark.parametrize("step", ["intercomm", "merge"])
def test_open_mpi_returns_from_a_death_in_intercomm_create_and_not_in_merge(mpi, step):
    """Why a death inside the merge ends the job (scripts/repro_merge_loop.py, mpi4py alone): a death during
    MPI_Intercomm_create returns an error on every survivor; one during MPI_Intercomm_merge returns on none.  When
    an Open MPI release fixes the merge, this fails, and respawn can survive that death in place."""
    proc = mpi.script(4, mpi.root / "scripts" / "repro_merge_loop.py", [], timeout=60,
                      env={"REPRO_STEP": step, "REPRO_GIVE_UP_S": "8"})
    out = proc.stdout + proc.stderr
    survivors = [f"rank {r}" for r in (0, 1, 3)]
    if step == "intercomm":
        assert all(f"{who}: MPI_Intercomm_create failed" in out for who in survivors), out[-3000:]
    else:
        assert all(f"{who}: MPI_Intercomm_create returned" in out for who in survivors), out[-3000:]
        assert "MPI_Intercomm_merge returned" not in out and "MPI_Intercomm_merge failed" not in out, out[-3000:]
        assert "NBC_Progress: an error 75" in out and "Timeout (0:00:08)!" in out, out[-3000:]


@pytest.mark.timeout(2 * BOUND_S)
def test_a_newcomer_gets_the_stepped_schedule_and_the_updated_scaler(mpi, digits_dir, tmp_path):
    """A newcomer is handed the state after a step's scaler update and scheduler step (at the start of the
    next step), not right after the optimizer's update: before the first fix it started one step behind (its
    lr and growth count differed) and the replicas ended inconsistent; the trainer then wrapped those lines
    (defer_handover), which no loop needs now."""
    argv = ["train", "--data", str(digits_dir), "--epochs", "2", "--batch", "48", *TRAIN, "--model", "cnn",
            "--dropout", "0.3", "--lr-schedule", "cosine", "--amp", "--kill", "1@4"]
    ends, _, _ = mpi.train_slots(3, argv, tmp_path, 2, BOUND_S, [0, 1, 2])    # one replica, every record once
    assert sizes(ends[0]["world_history"]) == [3, 2, 3], ends[0]
    assert len({json.dumps([e["lr"], e["grad_scaler"]]) for e in ends.values()}) == 1, ends


@pytest.mark.timeout(2 * BOUND_S)
def test_a_newcomer_that_joins_where_a_checkpoint_is_due_takes_part_in_it(mpi, digits_dir, tmp_path):
    """A checkpoint every 2 steps: a join lands on a boundary where a save is due (a collective: the blocking
    save's agree).  The newcomer, which started after that step's update, took no part in it, so the survivors
    waited in the save and the newcomer in the next step, until its step watchdog ended it (status 3, seen
    twice in the fuzzer's seed 116).  The join now comes at the start of the next step, after the boundary's
    save, and the newcomer takes part in every save after it."""
    end, logs, _ = train(mpi, digits_dir, tmp_path / "run", 3, 0, 2, "1@3",
                         args=("--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2", "--step-timeout", "30"))
    joined = respawns(logs, 0, "joined")
    assert joined and end["world_history"] == [3, 2, 3], end
    (newcomer,) = respawns(logs, 1, "newcomer")
    saved = {r: [c["step"] for c in select(logs[r], "checkpoint") if c["t"] > newcomer["t"]] for r in (0, 1)}
    assert saved[1] and saved[1] == saved[0], saved       # every save since the join, on the newcomer too
    # The join's own boundary, where one was due here (a join at an odd step is followed by an even one).
    assert any(s == joined[0]["step"] + 1 for s in saved[1]) or joined[0]["step"] % 2 == 0, (joined, saved)
