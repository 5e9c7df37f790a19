"""Hung, frozen and slow ranks under real mpirun --with-ft ulfm, with a short bound (--step-timeout 3): a rank that
makes no progress for the bound is removed as a SIGKILLed one is, and the others train on.

SIGSTOP (for good, then a SIGCONT that comes too late) of rank 0; a waiting spare frozen, then a rank's death; a
program's own evaluation and save between steps (never a hang); a deadlock in a user's loop with a spare; and,
under `long`, a stuck DataLoader, a rank frozen inside the repair, a deadlock on every rank, a frozen spare never
needed and a rank that resumes before the bound; a rank wedged inside MPI (its main thread asleep on a lock
there), rank 0 with a spare, and under `long` rank 1 without.  Across hosts: tests/faults/test_multihost.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs, select
from ulfmtrain.launching.launch import mpirun_command
from ulfmtrain.tools.audit import audit_logs

pytestmark = pytest.mark.faults
BOUND = 3.0         # the bound the tests launch with: short, yet not met by a healthy rank on a loaded 2-core box
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--model", "mlp", "--no-progress", "--audit", "--step-timeout", str(BOUND)]
EVICTED = "it is SIGKILLed so that the others go on without it"
STUCK = "does not run"


class Job:
    """A `train` job under mpirun, its stderr in a file (read while it runs)."""

    def __init__(self, ranks: int, argv: list[str], out: Path) -> None:
        self.out, self.err = out, out.parent / f"{out.name}.stderr"
        with self.err.open("w") as err:      # (its own session: a failed test ends mpirun and every rank)
            self.proc = subprocess.Popen(mpirun_command(ranks, [*argv, "--out", str(out)]), stdout=subprocess.DEVNULL,
                                         stderr=err, cwd=ROOT, start_new_session=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:      # a test that failed half-way: nothing of the job is left (stopped or not)
            _kill_session(self.proc)

    def logs(self) -> dict[int, list[dict]]:
        return read_rank_logs(self.out) if self.out.exists() else {}

    def steps(self, rank: int) -> int:
        return len(select(self.logs().get(rank, []), "step"))

    def wait_for(self, cond, timeout: float = 90.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and self.proc.poll() is None:
            if cond():
                return True
            time.sleep(0.02)
        return False

    def end(self, timeout: float = 120.0) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(self.proc)
            pytest.fail(f"the job did not end within {timeout} s:\n{self.err.read_text()[-3000:]}")
        return self.proc.returncode, self.err.read_text()


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL mpirun's session: mpirun, and every rank it started (a stopped one too)."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.getsid(int(p.name)) == proc.pid:
                os.kill(int(p.name), signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def script(ranks: int, name: str, args: list[str], timeout: float,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """tests/scripts/NAME ARGS on `ranks` ranks, forks of the suite's fork server (a script's ranks started from
    scratch spend most of such a test importing torch), with the short bound."""
    cmd = mpirun_command(ranks, ["python", "-P", str(ROOT / "tests" / "scripts" / name), *args])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "ULFMTRAIN_STEP_TIMEOUT": str(BOUND), **(env or {})},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        pytest.fail(f"mpirun did not finish within {timeout} s: {proc.communicate()[1][-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def rank_process(out: Path, launch_rank: int, timeout: float = 60.0) -> int:
    """The pid of launch rank `launch_rank` of the job writing to `out`: the process mpirun started, or, where it
    is the shim of a rank forked by the suite's fork server, that forked rank (it shares the shim's stdout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
                env = dict(v.split(b"=", 1) for v in (p / "environ").read_bytes().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if str(out).encode() not in argv or b"--with-ft" in argv or env.get(b"OMPI_COMM_WORLD_RANK") != \
                    str(launch_rank).encode():
                continue
            if not any(b"spawn_shim" in a for a in argv):
                return int(p.name)
            pipe = os.readlink(p / "fd" / "1")
            for q in Path("/proc").iterdir():
                try:
                    if q.name.isdigit() and q != p and os.readlink(q / "fd" / "1") == pipe:
                        return int(q.name)
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError(f"no process of launch rank {launch_rank} writing to {out}")


def stop_the_first_spare(job: Job) -> tuple[int, int, str]:
    """SIGSTOP the job's first spare (launch rank 3) once rank 0 trained 10 steps; its pid, the job's status and
    stderr."""
    with job:
        spare = rank_process(job.out, 3)
        assert job.wait_for(lambda: job.steps(0) >= 10), job.err.read_text()[-3000:]
        os.kill(spare, signal.SIGSTOP)
        rc, err = job.end()
    return spare, rc, err


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"   # dead, not yet reaped
    except OSError:
        return True


def bound_of(line: str) -> float:
    """The bound a hang watch's line applied: the floor (BOUND), or 10 agreed steps where steps are slow (under a
    heavy load)."""
    b = float(line.split("bound ")[1].split(" s")[0])
    assert b >= BOUND, line
    return b


def check_trained(logs: dict, ended: list[int], history: list[int], epochs: int) -> dict:
    """The ranks `ended` ended on one replica with the given world history; every record once per epoch."""
    ends = {r: select(recs, "end")[-1] for r, recs in logs.items() if select(recs, "end")}
    assert sorted(ends) == ended, sorted(ends)
    assert all(e["world_history"] == history and e["consistent"] for e in ends.values()), ends
    assert len({e["checksum"] for e in ends.values()}) == 1, ends
    rows = audit_logs(logs)
    assert len(rows) == epochs and all(r.exact and r.finished for r in rows), rows
    return ends[min(ends)]


@pytest.mark.timeout(180)
def test_rank_0_stopped_for_good_is_evicted_and_stays_dead_when_it_resumes(digits_dir, tmp_path):
    """Rank 0 (the lowest rank, the summary's writer) SIGSTOPped mid-training: its peers, waiting for it, see it
    has not run for the bound and SIGKILL it; they train on as after a SIGKILL (world [4, 3], exactly once).  A
    SIGCONT after that finds it dead: it never writes again.  Before, every peer ended with status 3 (the step
    watchdog) and rank 0 stayed stopped."""
    job = Job(4, ["train", "--data", str(digits_dir), "--epochs", "3", *TRAIN], tmp_path / "out")
    with job:
        assert job.wait_for(lambda: job.steps(0) >= 25), job.err.read_text()[-3000:]
        pid = select(job.logs()[0], "start")[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.time()
        assert job.wait_for(lambda: EVICTED in job.err.read_text(), 60), job.err.read_text()[-3000:]
        os.kill(pid, signal.SIGCONT) if not gone(pid) else None
        time.sleep(0.5)
        assert gone(pid), "rank 0 runs again after it was declared hung"
        rc, err = job.end()
    assert rc == 0, err[-3000:]
    logs = job.logs()
    end = check_trained(logs, [1, 2, 3], [4, 3], 3)
    (line,) = [x for x in err.splitlines() if EVICTED in x]
    assert "world rank 0 (pid" in line, line
    bound = bound_of(line)
    assert not [r for r in logs[0] if r["t"] > t_stop + 0.2], "rank 0 wrote after it was stopped"
    rec = select(logs[1], "recovery")[0]
    detected = rec["wall_error"] + rec["commit_agree_ms"] / 1e3 - t_stop
    assert rec["removed"] == [0] and BOUND - 0.5 <= detected <= bound + 10, (detected, rec)
    assert end["steps"] > 0
    print(f"\nrank 0 stopped: evicted and repaired {detected:.2f} s later (bound {bound:g} s)")


@pytest.mark.timeout(180)
def test_a_frozen_spare_is_dropped_and_the_other_spare_takes_the_dead_slot(digits_dir, tmp_path):
    """3 slots and 2 spares; the first spare (launch rank 3, the one that would take a slot) is SIGSTOPped, then
    slot 1 dies: the frozen spare is dropped, not waited for, and the other spare takes slot 1 (the world never
    shrinks, one replica, exactly once).  Before, the survivors spun in the repair of the world for good."""
    job = Job(5, ["train", "--data", str(digits_dir), "--epochs", "4", "--spares", "2", "--kill", "1@70", *TRAIN],
              tmp_path / "out")
    spare, rc, err = stop_the_first_spare(job)
    assert rc == 0, err[-3000:]
    check_trained(job.logs(), [0, 1, 2], [3, 3], 4)
    (line,) = [x for x in err.splitlines() if EVICTED in x]
    assert f"a waiting spare (pid {spare}" in line, line
    assert gone(spare)


@pytest.mark.timeout(180)
def test_a_programs_own_evaluation_and_save_between_steps_are_not_hangs(tmp_path):
    """Every rank evaluates (busy) and saves between epochs; rank 0 for 1.5 s longer, then for two bounds
    longer: its peers wait that long for it in the next step.  Nobody is taken for hung and the job ends 0.
    Before, the watchdog counted the time since the last commit: the peers that had evaluated 1 s and waited
    1.5 s were ended with status 3 ("waited in a collective for 3 s")."""
    proc = script(3, "hang_loop.py", [str(tmp_path), "evaluate"], timeout=150)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank?.json")}
    assert proc.returncode == 0 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    assert all(g["history"] == [3] and g["consistent"] for g in got.values()), got
    assert "ulfmtrain: error" not in proc.stderr and EVICTED not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_deadlock_in_a_users_loop_is_a_failure_a_spare_repairs(tmp_path):
    """Slot 1 of a user's loop deadlocks in its step (a lock taken twice, in the program's own code): after the
    bound it says so in one line and leaves as a failed rank; the spare takes its slot with the live state, and
    every slot ends on one replica (the world never shrinks).  Before, the peers ended with status 3 and slot 1
    stayed deadlocked, so mpirun never returned."""
    proc = script(4, "hang_loop.py", [str(tmp_path), "deadlock-one"], timeout=150, env={"ULFMTRAIN_SPARES": "1"})
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank?.json")}
    assert proc.returncode == 0 and sorted(got) == [0, 1, 2], proc.stderr[-3000:]
    assert all(g["history"] == [3, 3] and g["consistent"] for g in got.values()), got
    (line,) = [x for x in proc.stderr.splitlines() if STUCK in x]
    assert "world rank 1 (after step 30)" in line and "hang_loop.py" in line, line      # comm.step: 30 committed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill, spares, history, survivors", [
    ("0@30:commit/wedge", 1, [3, 3], [0, 1, 2]),
    pytest.param("1@30/wedge", 0, [3, 2], [0, 2], marks=pytest.mark.long),
])
def test_a_rank_wedged_inside_mpi_is_a_failure_the_others_repair(digits_dir, tmp_path, kill, spares, history,
                                                                  survivors):
    """A rank's main thread deadlocks inside its next reduction's MPI call (a lock that nobody releases, as Open
    MPI's TCP transport did in a 1000-failure soak): it sleeps there, so after the bound it says so in one line
    and dies by SIGKILL; the others, waiting in the reduction, repair as after any SIGKILL (the spare takes
    rank 0's slot; without one the world shrinks), exactly once.  Before, the rank counted as waiting in
    ulfmtrain, and every member ended with status 3 after ten bounds (the soak's job, after 600 s)."""
    job = Job(3 + spares, ["train", "--data", str(digits_dir), "--epochs", "3", "--spares", str(spares),
                           "--kill", kill, *TRAIN], tmp_path / "out")
    rc, err = job.end()
    assert rc == 0, err[-3000:]
    check_trained(job.logs(), survivors, history, 3)
    (line,) = [x for x in err.splitlines() if "slept on a lock inside an MPI call" in x]
    assert f"world rank {kill[0]} (after step" in line and "(at comm.py:" in line, line
    bound_of(line)
    assert select(job.logs()[int(kill[0])], "kill")[0]["kind"] == "wedge"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("factor", ["3", None])
def test_a_straggler_is_evicted_when_asked_and_kept_by_default(tmp_path, factor):
    """Rank 2 of a user's loop works 60 ms more per step than its peers (about 10x their own work, as on a slower
    device).  With ULFMTRAIN_STRAGGLER=3 it is SIGKILLed with one line that names it, and the others end on one
    replica in a world of 2; by default (no factor) it is kept and all three end together.  (Before, only the
    rule's unit test ran it; bench_hang's straggler, slow inside the reductions alone, was never evicted.)"""
    env = {"ULFMTRAIN_STRAGGLER": factor} if factor else {}
    proc = script(3, "hang_loop.py", [str(tmp_path), "slow"], timeout=250, env=env)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank?.json")}
    lines = [x for x in proc.stderr.splitlines() if "is a straggler" in x]
    assert proc.returncode == 0, proc.stderr[-3000:]
    if factor:
        assert sorted(got) == [0, 1] and len(lines) == 1 and "world rank 2" in lines[0], proc.stderr[-3000:]
        assert all(g["history"] == [3, 2] for g in got.values()), got
    else:
        assert sorted(got) == [0, 1, 2] and not lines, proc.stderr[-3000:]
        assert all(g["history"] == [3] for g in got.values()), got
    assert all(g["consistent"] for g in got.values()) and len({g["checksum"] for g in got.values()}) == 1, got


# -- long: more cases of the same rules -----------------------------------------------------------------
@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_stuck_dataloader_is_a_failure_and_its_worker_ends_with_it(tmp_path):
    """Rank 1's DataLoader worker blocks for good: its main thread waits for it without running; after the bound
    the rank leaves as a failure (its worker killed with it, which would otherwise hold mpirun's output) and the
    others finish, exactly once.  Before, the peers ended with status 3 and the job never ended."""
    proc = script(3, "hang_loop.py", [str(tmp_path), "loader"], timeout=150)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank?.json")}
    assert proc.returncode == 0 and sorted(got) == [0, 2], proc.stderr[-3000:]
    assert all(g["history"] == [3, 2] and g["consistent"] for g in got.values()), got
    (line,) = [x for x in proc.stderr.splitlines() if STUCK in x]
    assert "world rank 1" in line and "dataloader.py" in line, line


@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_rank_frozen_inside_the_repair_is_evicted_and_the_repair_completes(digits_dir, tmp_path):
    """Rank 1 dies; rank 2 stops (SIGSTOP) inside the repair that follows, right after its shrink: the others,
    waiting for it in the repair, evict it and repair again (world [4, 2])."""
    job = Job(4, ["train", "--data", str(digits_dir), "--epochs", "3", "--kill", "1@30", "--kill",
                  "2@30:recovery/stop", *TRAIN], tmp_path / "out")
    rc, err = job.end()
    assert rc == 0, err[-3000:]
    check_trained(job.logs(), [0, 3], [4, 2], 3)
    assert sum(EVICTED in x and "world rank 2" in x for x in err.splitlines()) == 1, err[-3000:]


@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_deadlock_on_every_rank_ends_the_job_with_status_3(tmp_path):
    """Every rank deadlocks in the same step (a bug that every rank meets): each says so once and the job ends
    with status 3, nobody shrinks (they leave together through the exit protocol)."""
    proc = script(3, "hang_loop.py", [str(tmp_path), "deadlock"], timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert sum(STUCK in x for x in proc.stderr.splitlines()) == 3, proc.stderr[-3000:]
    assert not list(tmp_path.glob("rank?.json"))


@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_frozen_spare_never_needed_is_dropped_and_the_job_ends_0(digits_dir, tmp_path):
    """A waiting spare SIGSTOPped, and no rank dies: training completes, the spare is dropped (not waited for at
    the end), and the job ends with status 0.  Before, it ended with status 3 from the watchdog at the end."""
    job = Job(4, ["train", "--data", str(digits_dir), "--epochs", "3", "--spares", "1", *TRAIN], tmp_path / "out")
    spare, rc, err = stop_the_first_spare(job)
    assert rc == 0, err[-3000:]
    check_trained(job.logs(), [0, 1, 2], [3], 3)
    assert gone(spare) and "a waiting spare" in err, err[-3000:]


@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_rank_that_resumes_before_the_bound_trains_on(digits_dir, tmp_path):
    """SIGSTOP, then SIGCONT half a bound later: no eviction, the world never shrinks."""
    job = Job(3, ["train", "--data", str(digits_dir), "--epochs", "3", "--kill", f"2@30/stop={BOUND / 2:g}",
                  *TRAIN], tmp_path / "out")
    rc, err = job.end()
    assert rc == 0, err[-3000:]
    check_trained(job.logs(), [0, 1, 2], [3], 3)
    assert EVICTED not in err and select(job.logs()[2], "kill"), err[-3000:]

