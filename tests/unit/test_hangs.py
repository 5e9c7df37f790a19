"""The hang watch's pure logic (no MPI): the agreed step time and the bound, where a main thread is, what an
observer decides from the board, and a watch in a process of its own whose main thread deadlocks or works."""
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ulfmtrain.core.modes import UsageError
from ulfmtrain.training.config import TrainConfig, TrainJob
from ulfmtrain.transport import board as boards
from ulfmtrain.transport import hangs


def test_the_commit_agree_gives_every_rank_the_slowest_ranks_step_time(monkeypatch):
    """Each rank offers its median step as a thermometer code; the AND over the ranks (what the agree returns)
    reads back as the slowest one's, within a factor 2, and the bound is 10 of those or the floor."""
    offered = []
    for step in (0.012, 0.3, 0.05):
        monkeypatch.setattr(hangs.steps, "intervals", [step] * 5)
        offered.append(hangs.step_bits())
    agreed = offered[0] & offered[1] & offered[2]
    assert 0.3 <= hangs.agreed_step(agreed) < 0.6
    comm = type("C", (), {"agreed_bits": agreed})()
    monkeypatch.setenv(hangs.FLOOR_ENV, "2")
    assert hangs.bound(comm) == 10 * hangs.agreed_step(agreed)     # 10 steps of the slowest rank, above 2 s
    monkeypatch.setenv(hangs.FLOOR_ENV, "30")
    assert hangs.bound(comm) == 30                                 # the floor, above 10 steps
    monkeypatch.setattr(hangs.steps, "intervals", [])
    assert hangs.step_bits() >> hangs.STEP_SHIFT == (1 << hangs.STEP_LEVELS) - 1    # nothing measured: no constraint
    assert hangs.step_bits() < 1 << 28           # below the exit protocol's LEAVING bit (exits.py) once shifted
    monkeypatch.setenv(hangs.FLOOR_ENV, "off")
    assert hangs.floor() is None


def _frame_in(filename: str, wait_in_stdlib: bool = False):
    """A frame whose code says it is in `filename`; with wait_in_stdlib, the frame of a standard-library function
    that it called (what a wait in threading looks like)."""
    import threading

    def stdlib_frame():
        return sys._getframe(0)

    def caller():
        return stdlib_frame() if wait_in_stdlib else sys._getframe(0)

    stdlib_frame.__code__ = stdlib_frame.__code__.replace(co_filename=threading.__file__)
    caller.__code__ = caller.__code__.replace(co_filename=filename)
    return caller()


def test_a_main_thread_waits_in_transport_or_membership_and_works_everywhere_else():
    pkg = os.path.dirname(os.path.dirname(hangs.__file__))
    assert hangs.classify(_frame_in(os.path.join(pkg, "transport", "comm.py")))[0] == "wait"
    assert hangs.classify(_frame_in(os.path.join(pkg, "membership", "spares.py")))[0] == "wait"    # a repair
    # A wait inside the standard library belongs to its caller: ulfmtrain's overlap wait, or the program's.
    assert hangs.classify(_frame_in(os.path.join(pkg, "training", "overlap.py"), True))[0] == "wait"
    assert hangs.classify(_frame_in("/home/me/train.py", True))[0] == "work"
    assert hangs.classify(_frame_in(os.path.join(pkg, "checkpoint", "writer.py")))[0] == "work"    # its own save
    state, where = hangs.classify(_frame_in("<injected deadlock>"))     # faults.py's hang kind: the program's code
    assert state == "work" and where.startswith("<injected deadlock>:")


def row(pid, state="work", mono=100.0, cpu=0, role="member", **kw):
    return {"pid": pid, "start": 1, "host": "h", "rank": pid, "role": role, "mono": mono, "cpu": cpu,
            "state": state, "for": kw.pop("for_", 0.0), "bound": 3.0, "work": kw.pop("work", 0.1),
            "steps": kw.pop("steps", 20), "step": kw.pop("step", 0.4), "where": f"world rank {pid}",
            "size": kw.pop("size", 3),
            "nobody": 30.0, "spans_hosts": False, "bounded": False,
            "cpu_now": kw.pop("cpu_now", cpu), **kw}


def test_an_observer_that_waits_evicts_a_process_that_stopped_running_and_only_that():
    """Frozen: no heartbeat for the bound, and no CPU time for half of it, as the observer saw it turn by turn (a
    stopped process ran between its last heartbeat and its stop: the CPU time of the heartbeat says nothing)."""
    me = row(1, "wait", mono=100.0)
    frozen = row(2, mono=96.0, cpu=40, cpu_now=50)          # 4 s without a heartbeat; it ran a little, then stopped
    busy = row(3, mono=96.0, cpu=40, cpu_now=400)           # no heartbeat, but it runs: a long call holding the GIL
    fresh = row(4, mono=99.8)
    elsewhere = row(5, mono=90.0, host="other", cpu_now=7)  # another host's process: not this observer's to kill
    rows = [me, frozen, busy, fresh, elsewhere]
    assert boards.verdicts(me, rows, now=100.0) == []                       # its CPU clock starts now
    busy["cpu_now"] = 450
    verdicts = boards.verdicts(me, rows, now=102.0)                         # 2 s (>= bound / 2) without CPU
    assert [r["pid"] for r, _ in verdicts] == [2]
    assert "has not run for 6.0 s" in verdicts[0][1] and "SIGKILLed" in verdicts[0][1]
    assert boards.verdicts(row(1, "work"), rows, now=104.0) == []           # only a rank that waits judges


def test_a_straggler_is_evicted_only_when_asked_persistently_slower_and_costly():
    rows = [row(1, work=0.1), row(2, work=0.11), row(3, work=0.35)]
    assert boards.verdicts(rows[0], rows, now=100.0) == []                  # off by default
    me = {**rows[0], "straggler": 3.0}
    (verdict,) = boards.verdicts(me, [me, *rows[1:]], now=100.0)
    assert verdict[0]["pid"] == 3 and "straggler" in verdict[1] and "3.3x" in verdict[1]
    few = [me, rows[1], {**rows[2], "steps": 10}]                           # too few steps measured yet
    assert boards.verdicts(me, few, now=100.0) == []
    # 3.5x slower, but in 1 ms of work within a 45 ms step: scheduler noise, not a rank worth removing.
    noise = [{**me, "work": 0.001, "step": 0.045}, row(2, work=0.0011), row(3, work=0.0035)]
    assert boards.verdicts(noise[0], noise, now=100.0) == []


def test_the_board_keeps_one_row_per_live_process_and_one_line_per_eviction(tmp_path, capsys):
    board = boards.Board(str(tmp_path / "board"))
    assert os.stat(board.dir).st_mode & 0o777 == 0o700
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = row(os.getpid(), start=boards.start_time(os.getpid()))
        theirs = row(child.pid, start=boards.start_time(child.pid))
        gone = row(999999, start=123)
        for r in (mine, theirs, gone):
            board.write(r)
        assert sorted(r["pid"] for r in board.rows()) == sorted([os.getpid(), child.pid])  # the dead row removed
        board.evict(theirs, "line one")
        board.evict(theirs, "line two")         # a second observer: the same kill, no second line
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert capsys.readouterr().err.splitlines() == ["line one"]
        assert board.evicted(child.pid) and not board.evicted(os.getpid())
        board.evict({**mine, "start": 1}, "not me")     # another start time: another process, never killed
    finally:
        child.kill()
    board.close(os.getpid())
    assert not os.path.exists(board.dir)


def test_the_last_to_leave_never_removes_a_row_being_written(tmp_path, monkeypatch):
    """A process that leaves while no row is on the board yet (the first rows of a job starting) must not remove
    the board, or the file another process is writing (found while looking for the 64-rank job's failure at
    start, whose cause was the next test's)."""
    board, other = boards.Board(str(tmp_path / "board")), boards.Board(str(tmp_path / "board"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = row(child.pid, start=boards.start_time(child.pid))
        with open(other._path(child.pid, "tmp"), "w") as f:   # half way through its write: written, not renamed
            f.write("{}")
        board.close(os.getpid())                                 # no row on the board: the last to leave?
        os.replace(other._path(child.pid, "tmp"), other._path(child.pid))
        other.write(theirs)
        with monkeypatch.context() as m:    # its row renamed in place after rows() looked, before the clean-up
            m.setattr(board, "rows", lambda: [])
            board.close(os.getpid())
        assert [r["pid"] for r in board.rows()] == [child.pid]
        child.kill()
        child.wait(timeout=10)
        board.close(os.getpid())                                 # only the dead's files: the last one removes it
        assert not os.path.exists(board.dir)
        other.write(theirs)                                      # a writer after that makes it again (mode 0700)
        assert os.stat(board.dir).st_mode & 0o777 == 0o700
    finally:
        child.kill()
        child.wait(timeout=10)


def test_two_threads_of_one_process_write_its_row_at_once(tmp_path):
    """A rank's main thread publishes its row (comm.py, as it becomes a member) while its hang watch's thread
    writes the same row: both wrote PID.tmp, the first rename took it, the second found none (64 ranks on 2 cores:
    FileNotFoundError at start, the rank failed)."""
    board = boards.Board(str(tmp_path / "board"))
    me = row(os.getpid(), start=boards.start_time(os.getpid()))
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(3000):
                board.write(me)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert [r["pid"] for r in board.rows()] == [os.getpid()]


def test_a_board_that_is_a_link_is_refused(tmp_path):
    """A board in a folder anyone can write to (/dev/shm) could be a link another user made, to a folder of ours."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "board").symlink_to(mine)
    with pytest.raises(PermissionError, match="not this user's alone"):
        boards.Board(str(tmp_path / "board"))


def test_nobody_comes_only_when_every_member_waits_past_ten_bounds(tmp_path):
    board = boards.Board(str(tmp_path / "b"))
    me = row(os.getpid(), "wait", for_=31.0, start=boards.start_time(os.getpid()))
    board.write(me)
    assert "none of them hung" in boards.judge(board, me)
    assert boards.judge(board, {**me, "for": 29.0}) is None                 # past the bound, not past ten
    assert boards.judge(board, {**me, "bounded": True}) is None             # a spawn's own watchdog bounds it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        board.write(row(child.pid, "work", start=boards.start_time(child.pid), mono=time.monotonic()))
        assert boards.judge(board, me) is None                              # a member works: it may come
    finally:
        child.kill()
    assert "another host" in boards.judge(board, {**me, "spans_hosts": True})   # peers out of this board's sight


PROGRAM = """
import threading, time
from ulfmtrain.transport import hangs
ends = []
w = hangs.Watch(lambda: None, lambda: 0, lambda line, b: ends.append(line), lambda line: ends.append(line))
threading.Thread(target=lambda: [(time.sleep(0.05), w.tick()) for _ in range(200) if not ends], daemon=True).start()
t0 = time.monotonic()
{main}
print(repr(ends[:1]), round(time.monotonic() - t0, 1))
"""


@pytest.mark.parametrize("main, stuck", [
    ("lock = threading.Lock(); lock.acquire(); lock.acquire(timeout=2.5)", True),          # a deadlock, 2.5 s
    ("x = 0\nwhile time.monotonic() - t0 < 2.5:\n    x += 1", False),                     # busy: an evaluation
    # The main thread joins a thread of the program's that works: a save in the background.
    ("t = threading.Thread(target=lambda: sum(1 for _ in iter(lambda: time.monotonic() - t0 < 2.5, False)))\n"
     "t.start()\nt.join()", False),
    # Asleep most of the time, but reading 40 KiB/s: a download, or a slow disk.
    ("import os\nr, w = os.pipe()\nthreading.Thread(target=lambda: [(time.sleep(0.1), os.write(w, bytes(4096))) "
     "for _ in range(25)] + [os.close(w)], daemon=True).start()\nwhile os.read(r, 65536):\n    pass", False),
])
def test_a_main_thread_that_does_not_run_is_hung_and_a_busy_one_is_not(main, stuck):
    env = {**os.environ, hangs.FLOOR_ENV: "1"}
    proc = subprocess.run([sys.executable, "-P", "-c", PROGRAM.replace("{main}", main)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("does not run" in proc.stdout) == stuck, proc.stdout


# The same main threads inside a frame of ulfmtrain's, where the watch takes them for waiting.
IN_ULFMTRAIN = "exec(compile({body!r}, hangs._PACKAGE + {where!r}, 'exec'), globals())"
LOCKED = "lock = threading.Lock(); lock.acquire(); lock.acquire(timeout=2.5)"


@pytest.mark.parametrize("body, where, stuck", [
    (LOCKED, "/transport/collectives.py", True),                # asleep on a lock in a collective: wedged
    ("time.sleep(2.5)", "/transport/collectives.py", False),    # a test-and-sleep wait (a spare's, a join's)
    ("x = 0\nwhile time.monotonic() - t0 < 2.5:\n    x += 1", "/transport/collectives.py", False),   # a poll
    (LOCKED, "/membership/respawn.py", False),   # a spawn or a join sleeps in PMIx; its own watchdog bounds it
])
def test_a_wait_in_ulfmtrain_asleep_on_a_lock_is_stuck_and_a_sleep_or_a_poll_is_not(body, where, stuck):
    """A main thread in a collective that sleeps on a lock for the bound is deadlocked inside the MPI library (as
    Open MPI's TCP transport did in a soak); one that sleeps between tests, or polls, waits for its peers."""
    env = {**os.environ, hangs.FLOOR_ENV: "1"}
    main = IN_ULFMTRAIN.format(body=body, where=where)
    proc = subprocess.run([sys.executable, "-P", "-c", PROGRAM.replace("{main}", main)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("slept on a lock inside an MPI call" in proc.stdout) == stuck, proc.stdout
    assert "does not run" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_step_timeout_or_straggler_factor_out_of_range_is_refused(bad):
    with pytest.raises(UsageError, match="--step-timeout"):
        TrainJob(config=TrainConfig(step_timeout=bad)).validate()
    with pytest.raises(UsageError, match="--straggler"):
        TrainJob(config=TrainConfig(straggler=bad if bad != 0.0 else 1.0)).validate()


@pytest.mark.parametrize("env, line", [({"ULFMTRAIN_STEP_TIMEOUT": "soon"}, "ULFMTRAIN_STEP_TIMEOUT='soon' is not"),
                                       ({"ULFMTRAIN_STRAGGLER": "0.5"}, "give a factor above 1")])
def test_a_bad_bound_in_the_environment_stops_the_rank_with_one_line(env, line):
    proc = subprocess.run([sys.executable, "-P", "-c", "from ulfmtrain.transport import hangs; hangs.start()"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and line in proc.stderr, proc.stderr


def test_the_watch_of_a_forked_rank_reads_its_own_main_thread():
    """The fork server's ranks are forks: Python keeps the parent's native id for a fork's main thread, so the watch
    read no state and no wait channel there (a rank wedged inside MPI was never found: the 1000-failure soak)."""
    pid = os.fork()
    if pid == 0:
        w = hangs.Watch(lambda: None, lambda: 0, lambda *a: None, lambda *a: None)
        os._exit(0 if hangs._thread_state(w._tid) == "R" else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_time_is_not_counted_while_this_process_itself_did_not_run():
    """After a stop of its own (or of the whole job), the watch starts every clock over instead of taking its
    peers, which did not run either, for frozen."""
    w = hangs.Watch(lambda: None, lambda: 0, lambda *a: pytest.fail("stuck"), lambda *a: pytest.fail("nobody"))
    w.since = w.last_tick = time.monotonic() - 100
    w.tick()
    assert time.monotonic() - w.since < 1


def test_a_hung_ranks_children_are_those_of_its_process_group_not_the_fork_server():
    """A hung rank SIGKILLs its own children (DataLoader workers) as it leaves.  The fork server it starts now
    shares its session (one scheduling group under Linux's autogroup) in a process group of its own: picking
    children by session would have killed the server, and with it every process it forked."""
    worker = subprocess.Popen(["sleep", "60"])                     # as a DataLoader worker: the rank's group
    server = subprocess.Popen(["sleep", "60"], process_group=0)    # as forkserver.start() makes it
    try:
        mine = boards.children(os.getpid())
        assert worker.pid in mine and server.pid not in mine, (mine, worker.pid, server.pid)
    finally:
        for p in (worker, server):
            p.kill()
            p.wait()
