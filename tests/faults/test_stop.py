"""`launch` and `supervise` stop when told: SIGINT (a terminal's Ctrl-C, sent to its foreground process group),
SIGTERM (a batch scheduler) and SIGHUP (a closed terminal) end mpirun, every rank and the ranks' DataLoader
workers within seconds, with one line and status 128 + the signal, and no traceback; a checkpoint being
written is the previous good one or the new one.  SIGKILL of the launcher leaves nothing running either: the
ranks see their launcher go.

Real `launch` and mpirun --with-ft ulfm, real signals.  The job's processes are found by their tree (the
launcher's descendants, and each rank's, whatever session or process group they moved to), taken while the
job runs, and each must be gone afterwards (same pid and start time: not a process that reused the pid).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
START_S, GONE_S = 120, 5.0     # start-up under load; how long the job's processes may outlive the stop


def _stat(pid: int) -> list[str] | None:
    # The test's own reading of /proc, not jobtree's: the launcher's cleanup is judged by other means than its own.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(root: int) -> dict[int, str]:
    """`root` and its live descendants: pid -> start time."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        st = _stat(int(name)) if name.isdigit() else None
        if st and st[0] != "Z":
            kids.setdefault(int(st[1]), []).append(int(name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        st = _stat(pid)
        if st and st[0] != "Z":
            out[pid] = st[19]
            todo += kids.get(pid, [])
    return out


def running(procs: dict[int, str]) -> dict[int, str]:
    """Those of `procs` still running (not zombies, not a later process with a reused pid): pid -> command."""
    left = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st and st[0] != "Z" and st[19] == start:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                left[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    return left


def start(cmd: list[str], ready, env: dict | None = None) -> tuple[subprocess.Popen, dict[int, str]]:
    """Start a launcher as a terminal would (a process group of its own: Ctrl-C reaches that group), wait until
    ready() names the ranks' pids, and return it with the job's processes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    t0 = time.monotonic()
    while not (ranks := ready()) and proc.poll() is None and time.monotonic() - t0 < START_S:
        time.sleep(0.1)
    if not ranks:
        proc.kill()
        pytest.fail(f"the job did not start within {START_S} s: {proc.communicate()[1][-3000:]}")
    job = tree(proc.pid)
    for pid in ranks:             # a rank forked by the test suite's fork server is no descendant of launch
        job.update(tree(pid))
    return proc, job


def pids_written(out: Path, n: int):
    def ready() -> list[int]:
        files = [out / f"pid{r}" for r in range(n)]
        return [int(f.read_text()) for f in files] if all(f.exists() for f in files) else []
    return ready


def stop(proc: subprocess.Popen, job: dict[int, str], sig: signal.Signals) -> tuple[int, str]:
    """Send sig (SIGINT to the launcher's process group, as a terminal does); return the launcher's status and
    stderr once every process of the job is gone (fails if one outlives the launcher by GONE_S)."""
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not end within 60 s of {sig.name}: {proc.communicate()[1][-3000:]}")
    t0 = time.monotonic()
    while (left := running(job)) and time.monotonic() - t0 < GONE_S:
        time.sleep(0.05)
    assert not left, f"{len(left)} of the job's {len(job)} processes outlived {sig.name} by {GONE_S} s: {left}"
    print(f"\n{sig.name}: the launcher ended, and the {len(job)} processes of its job were gone "
          f"{time.monotonic() - t0:.2f} s later")
    return proc.returncode, err


def one_line(err: str, prog: str, sig: signal.Signals) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert err.count(f"{prog}: stopped by {sig.name}") == 1 and err.rstrip().endswith("children)"), err[-3000:]


def loader_job(tmp_path: Path, ranks: int = 2) -> tuple[subprocess.Popen, dict[int, str]]:
    out = tmp_path / "out"
    out.mkdir()
    proc, job = start([sys.executable, "-m", "ulfmtrain", "launch", "-n", str(ranks), "--",
                       "python", str(SCRIPTS / "loader_loop.py"), str(out)], pids_written(out, ranks))
    # The ranks and their workers (2 each) at least: what must end is there.
    assert len(job) >= 3 * ranks, job
    return proc, job


@pytest.mark.timeout(240)
def test_ctrl_c_ends_launch_its_ranks_and_their_dataloader_workers_with_status_130(tmp_path):
    proc, job = loader_job(tmp_path)
    rc, err = stop(proc, job, signal.SIGINT)
    assert rc == 130, err[-3000:]
    one_line(err, "ulfmtrain launch", signal.SIGINT)


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_end_launch_with_128_plus_the_signal(tmp_path, sig):
    proc, job = loader_job(tmp_path)
    rc, err = stop(proc, job, sig)
    assert rc == 128 + sig, err[-3000:]
    one_line(err, "ulfmtrain launch", sig)


@pytest.mark.timeout(240)
def test_sigkill_of_launch_leaves_nothing_running(tmp_path):
    """No handler runs: mpirun dies with its parent, and each rank sees its launcher go and ends its workers
    and itself."""
    proc, job = loader_job(tmp_path)
    rc, _ = stop(proc, job, signal.SIGKILL)
    assert rc == -signal.SIGKILL


@pytest.mark.timeout(240)
def test_a_job_whose_every_rank_died_by_a_signal_does_not_end_with_status_0(tmp_path):
    """Every rank SIGKILLed (as every survivor of a crash in Open MPI can be: docs/failures.md): mpirun says 0,
    since under ULFM a death by signal does not count; launch says 1, with one line: the job left no result."""
    out = tmp_path / "out"
    out.mkdir()
    proc, job = start([sys.executable, "-m", "ulfmtrain", "launch", "-n", "2", "--",
                       "python", str(SCRIPTS / "loader_loop.py"), str(out)], pids_written(out, 2))
    for rank in (0, 1):
        os.kill(int((out / f"pid{rank}").read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert err.count("every rank died by a signal") == 1 and "Traceback" not in err, err[-3000:]
    t0 = time.monotonic()
    while running(job) and time.monotonic() - t0 < GONE_S:
        time.sleep(0.05)
    assert not running(job)


def checkpoint_job(cmd: str, digits_dir: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """`launch` or `supervise` of `train` that checkpoints every step, stopped by sig mid-run: status, one line,
    nothing left, and the checkpoint directory loads (the previous good checkpoint or the new one)."""
    from ulfmtrain.checkpoint.format import load_latest, read_checkpoint, read_pointer

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    train = ["train", "--data", str(digits_dir), "--epochs", "1000", "--no-progress", "--ckpt-dir", str(ckpt),
             "--ckpt-every", "1", "--out", str(out)]
    launcher = [sys.executable, "-m", "ulfmtrain", cmd, "-n", "2", "--", *train]

    def ready() -> list[int]:       # training, with two checkpoints written: the ranks' pids from their logs
        from ulfmtrain.core.events import read_rank_logs

        logs = read_rank_logs(out / "attempt-1" if cmd == "supervise" else out) if out.exists() else {}
        starts = [next((x for x in recs if x["event"] == "start"), None) for recs in logs.values()]
        ok = len(starts) == 2 and all(starts) and len(list(ckpt.glob("ckpt-*.pt"))) >= 2
        return [s["pid"] for s in starts if s] if ok else []

    proc, job = start(launcher, ready)
    rc, err = stop(proc, job, sig)
    assert rc == 128 + sig, err[-3000:]
    one_line(err, f"ulfmtrain {cmd}", sig)
    warned: list[str] = []
    latest = load_latest(ckpt, warn=warned.append)
    pointer = read_pointer(ckpt)
    assert pointer is not None and not warned, warned
    assert latest.step == pointer["step"] == read_checkpoint(ckpt / pointer["file"]).step >= 1


@pytest.mark.timeout(240)
def test_sigterm_to_launch_of_train_leaves_a_checkpoint_that_loads(digits_dir, tmp_path):
    checkpoint_job("launch", digits_dir, tmp_path, signal.SIGTERM)


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_supervise_stops_its_attempt_and_leaves_a_checkpoint_that_loads(digits_dir, tmp_path, sig):
    checkpoint_job("supervise", digits_dir, tmp_path, sig)
