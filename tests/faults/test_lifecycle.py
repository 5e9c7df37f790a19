"""Start-up and shut-down under real mpirun --with-ft ulfm: a bounded MPI_Init and a bounded MPI_Finalize.

The ranks run tests/scripts/lifecycle_rank.py inside tests/scripts/record_exit.sh,
which records each rank's own exit status and end time (mpirun reports one
code for the whole job).  Times are time.time() on this one machine.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulfmtrain.launching.launch import mpirun_prefix
from ulfmtrain.transport import jobtree, lifecycle

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
INIT_TIMEOUT = 5.0
SLACK = 5.0          # a loaded 2-core machine: process start, mpirun noticing, the wrapper's date


def init_line(timeout: float) -> str:
    return (f"ulfmtrain: error: MPI_Init did not complete in {timeout:g} s (a rank died during start-up?); "
            "the job is ended: rerun it, or raise ULFMTRAIN_INIT_TIMEOUT")


def prefix(n: int) -> list[str]:
    """mpirun --with-ft ulfm -np N, oversubscribed: the machine is shared, its cores may be busy."""
    cmd = mpirun_prefix(n)
    return cmd if "--oversubscribe" in cmd else [*cmd, "--oversubscribe"]


def run_ranks(n: int, mode: str, out: Path, *, timeout: float, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    cmd = [*prefix(n), "sh", str(SCRIPTS / "record_exit.sh"), str(out),
           sys.executable, "-P", str(SCRIPTS / "lifecycle_rank.py"), mode, str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish within {timeout} s: {exc.stdout}\n{exc.stderr}")
    # A wrapper can still be writing its status once mpirun has returned (seen in CI): let it finish.
    deadline = time.monotonic() + 5
    while any(out.glob("status.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def records(out: Path, what: str) -> dict[int, dict]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob(f"{what}.*.json")}


def statuses(out: Path) -> dict[int, tuple[int, float]]:
    """Each rank's (exit status, end time), as record_exit.sh wrote them; a rank whose wrapper was killed has none."""
    got = {}
    for p in out.glob("status.*"):
        if p.suffix != ".tmp":
            code, t = p.read_text().split()
            got[int(p.name.split(".")[1])] = (int(code), float(t))
    return got


def diag(proc: subprocess.CompletedProcess, out: Path) -> str:
    files = {p.name: p.read_text() for p in sorted(out.iterdir())}
    return f"rc={proc.returncode}\nfiles={files}\nstdout={proc.stdout[-2000:]}\nstderr={proc.stderr[-3000:]}"


# -- start-up ---------------------------------------------------------------------------------------------------

@pytest.mark.faults
@pytest.mark.timeout(90)
def test_rank_dead_before_init_ends_the_others_within_the_bound(tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself before MPI_Init; without the bound ranks 0 and 2 would wait in MPI_Init for ever."""
    n = 3
    proc = run_ranks(n, "die-before-init", tmp_path, timeout=INIT_TIMEOUT + 40,
                     env={"ULFMTRAIN_INIT_TIMEOUT": f"{INIT_TIMEOUT:g}"})
    why = diag(proc, tmp_path)
    starts, status = records(tmp_path, "init-start"), statuses(tmp_path)
    assert status.get(1, (None,))[0] == 128 + 9, why          # the scenario: rank 1 died by SIGKILL
    assert sorted(starts) == [0, 2], why
    assert records(tmp_path, "init-done") == {}, why          # nobody's MPI_Init completed
    # The first survivor to reach the bound ends itself, status 3.  Open MPI's launcher then ends the
    # job: the other survivor ends within moments, with status 3 if its own watchdog was first, else
    # another status (14 was seen) or not at all (its wrapper killed too).
    ended = {r: status[r] for r in starts if r in status}
    by_watchdog = {r: t - starts[r]["t"] for r, (code, t) in ended.items() if code == lifecycle.INIT_HANG_EXIT_CODE}
    assert by_watchdog, why
    for r, waited in by_watchdog.items():
        assert INIT_TIMEOUT - 0.05 <= waited <= INIT_TIMEOUT + SLACK, (r, waited, why)
    first_end = min(t for code, t in ended.values() if code == lifecycle.INIT_HANG_EXIT_CODE)
    for r, (_code, t) in ended.items():
        assert t - starts[r]["t"] >= INIT_TIMEOUT - 0.05, (r, why)     # nothing ended it before the bound
        assert t - first_end <= 2.0, (r, why)
    print(f"\nMPI_Init bound {INIT_TIMEOUT:g} s: survivors ended after {sorted(by_watchdog.values())} s "
          f"(statuses {ended}), mpirun exit {proc.returncode}")
    # One line per rank whose watchdog fired, that line and nothing like a traceback.
    lines = [ln for ln in proc.stderr.splitlines() if "MPI_Init" in ln]
    assert 1 <= len(lines) <= len(starts), why
    assert set(lines) == {init_line(INIT_TIMEOUT)}, why
    assert "Traceback" not in proc.stderr, why
    # mpirun reports the first non-zero exit of a rank that was not killed: the watchdog's 3.
    assert proc.returncode == lifecycle.INIT_HANG_EXIT_CODE, why


@pytest.mark.timeout(60)
def test_import_initializes_mpi_with_thread_multiple(tmp_path: Path) -> None:
    """A program that uses MPI.COMM_WORLD after `import ulfmtrain` finds MPI as mpi4py would have left it."""
    proc = run_ranks(2, "probe", tmp_path, timeout=50)
    why = diag(proc, tmp_path)
    got, status = records(tmp_path, "probe"), statuses(tmp_path)
    assert sorted(got) == [0, 1], why
    for r in got.values():
        assert r["initialized"] and r["thread"] == r["multiple"], why
        assert r["rc_initialize"] is False and r["rc_finalize"] is False, why   # MPI_Init and finalize are ours
        assert r["errors_return"], why              # mpi4py's rc.errors='exception' applied after our MPI_Init
        assert (r["size"], r["sum"]) == (2, 1), why
    print(f"\nimport ulfmtrain (mpi4py + bounded MPI_Init) took {[round(r['init_s'], 2) for r in got.values()]} s")
    # It never called finalize: at interpreter exit the ranks agreed that all of them were leaving, and left
    # without MPI_Finalize, which can hang after a failure (exits.py, docs/failures.md).
    assert [r["finalized"] for r in records(tmp_path, "exit").values()] == [False, False], why
    assert {r: code for r, (code, _) in status.items()} == {0: 0, 1: 0}, why
    assert proc.returncode == 0 and "MPI_Finalize" not in proc.stderr, why


@pytest.mark.timeout(60)
def test_mpi4py_imported_first_is_left_alone(tmp_path: Path) -> None:
    """The program imported mpi4py.MPI before ulfmtrain: mpi4py's own start-up and finalize, rc untouched."""
    proc = run_ranks(2, "mpi4py-first", tmp_path, timeout=50)
    why = diag(proc, tmp_path)
    got = records(tmp_path, "mpi4py-first")
    assert sorted(got) == [0, 1], why
    for r in got.values():
        assert r["initialized"] and r["thread"] == r["multiple"] and r["sum"] == 1, why
        assert r["rc_initialize"] is True and r["rc_finalize"] is None, why
    # Not armed by ulfmtrain: at atexit time MPI is still up (mpi4py finalizes after the atexit handlers).
    assert [r["finalized"] for r in records(tmp_path, "exit").values()] == [False, False], why
    assert proc.returncode == 0, why


@pytest.mark.timeout(60)
def test_bad_init_timeout_is_one_clear_error_before_mpi_init(tmp_path: Path) -> None:
    cmd = [*prefix(2), sys.executable, "-P", "-c", "import ulfmtrain"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50,
                          env={**os.environ, "ULFMTRAIN_INIT_TIMEOUT": "soon"})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ValueError")]
    # One line per rank that got to print it: the first rank to exit non-zero makes mpirun end the other.
    assert 1 <= len(errors) <= 2, proc.stderr
    assert set(errors) == {"ValueError: ULFMTRAIN_INIT_TIMEOUT='soon' is not a positive number of seconds "
                           "(unset it for the default, 60)"}, proc.stderr
    assert proc.returncode != 0


@pytest.mark.parametrize("raw, expected", [(None, 60.0), ("", 60.0), (" 2.5 ", 2.5), ("120", 120.0)])
def test_init_timeout_from_the_environment(raw: str | None, expected: float) -> None:
    env = {} if raw is None else {lifecycle.INIT_TIMEOUT_ENV: raw}
    assert lifecycle.init_timeout(env) == expected


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan", "inf", "1e999"])
def test_bad_init_timeout_names_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^ULFMTRAIN_INIT_TIMEOUT='{raw}' is not a positive number of seconds"):
        lifecycle.init_timeout({lifecycle.INIT_TIMEOUT_ENV: raw})


def test_outside_mpirun_import_leaves_mpi_alone() -> None:
    """Launchers and data tools (no mpirun) import ulfmtrain without loading mpi4py.MPI at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    code = "import sys, ulfmtrain, mpi4py; print('mpi4py.MPI' in sys.modules, mpi4py.rc.initialize)"
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.stdout.split() == ["False", "True"], proc.stderr
    assert lifecycle.under_mpirun({"OMPI_COMM_WORLD_SIZE": "2"}) and lifecycle.under_mpirun({"PMIX_RANK": "0"})
    assert not lifecycle.under_mpirun({})


# -- shut-down --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "5", True])
def test_finalize_rejects_bad_timeouts(timeout: object) -> None:
    with pytest.raises(ValueError, match="finalize timeout must be a positive number of seconds"):
        lifecycle.finalize(timeout)  # type: ignore[arg-type]


def test_binding_rejects_bad_arguments_without_touching_mpi() -> None:
    """The C calls check too (the binding is public): ValueError, and MPI neither initialized nor finalized."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    code = """
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
from ulfmtrain import _ftcoll
for call, args in [(_ftcoll.finalize, (0.0, 1)), (_ftcoll.finalize, (float('nan'), 1)),
                   (_ftcoll.finalize, (1.0, 0)), (_ftcoll.init_bounded, (-1.0,)),
                   (_ftcoll.init_bounded, (float('inf'),))]:
    try:
        call(*args)
        print('accepted', call.__name__, args)
    except ValueError as exc:
        print('ValueError', exc)
print('initialized', MPI.Is_initialized(), MPI.Is_finalized())
"""
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, env=env)
    lines = proc.stdout.splitlines()
    assert lines == [
        "ValueError finalize timeout must be a positive, finite number of seconds, got 0.0",
        "ValueError finalize timeout must be a positive, finite number of seconds, got nan",
        "ValueError finalize's hang exit code must be non-zero: a hang must not read as success",
        "ValueError MPI_Init timeout must be a positive, finite number of seconds, got -1.0",
        "ValueError MPI_Init timeout must be a positive, finite number of seconds, got inf",
        "initialized False False",
    ], proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_finalize_that_completes_returns_the_callers_code_and_disarms(tmp_path: Path) -> None:
    """finalize(1 s, 7) completes and returns 7; the ranks then live 2 s past the bound and exit 0."""
    proc = run_ranks(2, "finalize-ok", tmp_path, timeout=50)
    why = diag(proc, tmp_path)
    got, status = records(tmp_path, "finalize-ok"), statuses(tmp_path)
    assert sorted(got) == [0, 1], why                 # written after the sleep: the watchdog did not fire
    for r in got.values():
        assert r["code"] == 7 and r["finalized"] and r["finalize_s"] < 1.0, why
    assert {r: code for r, (code, _) in status.items()} == {0: 0, 1: 0}, why   # 7: a watchdog fired
    assert "MPI_Finalize did not complete" not in proc.stderr, why
    print(f"\nfinalize took {[round(r['finalize_s'], 3) for r in got.values()]} s")


@pytest.mark.timeout(60)
def test_finalize_that_hangs_exits_with_the_hang_code(tmp_path: Path) -> None:
    """MPI_Finalize waits for every rank: rank 1 sleeps 8 s first, so rank 0's finalize(2 s, 5) hangs."""
    proc = run_ranks(2, "finalize-hang", tmp_path, timeout=50)
    why = diag(proc, tmp_path)
    start, status = records(tmp_path, "finalize-start"), statuses(tmp_path)
    assert 0 in start and 0 in status, why
    code, end = status[0]
    assert code == 5 and 2.0 - 0.05 <= end - start[0]["t"] <= 2.0 + SLACK, why
    assert records(tmp_path, "finalize-returned") == {}, why
    line = "ulfmtrain: MPI_Finalize did not complete in 2 s (it can hang after a process failure, ompi #11404); " \
           "exiting with code 5"
    assert proc.stderr.splitlines().count(line) == 1, why
    print(f"\nhung finalize ended after {end - start[0]['t']:.2f} s; rank 1: {status.get(1)}; mpirun {proc.returncode}")


@pytest.mark.faults
@pytest.mark.timeout(90)
def test_peer_dead_program_without_finalize_exits_0_at_once(tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed after MPI_Init; the survivors repair, never call finalize, and exit 0 at once.

    Before exits.py, the bounded MPI_Finalize at exit hung after the failure in about 1 run of 3 here and
    ended the rank with 124, which mpirun reported as the job's status."""
    n, bound = 3, 5.0
    proc = run_ranks(n, "peer-dies", tmp_path, timeout=60)
    why = diag(proc, tmp_path)
    got, status, at_exit = records(tmp_path, "peer-dies"), statuses(tmp_path), records(tmp_path, "exit")
    assert status.get(n - 1, (None,))[0] == 128 + 9, why
    assert sorted(got) == [0, 1], why
    assert all(r["size"] == n - 1 and r["sum"] == [n - 1.0] * 4 for r in got.values()), why
    # Every survivor agreed that all were leaving and left without MPI_Finalize, with its own status (0).
    for r in got:
        code, end = status.get(r, (None, math.inf))
        assert code == 0 and end - got[r]["t"] <= bound + SLACK and not at_exit[r]["finalized"], why
    assert proc.returncode == 0 and "MPI_Finalize did not complete" not in proc.stderr, why
    print(f"\nsurvivors exited {[round(status[r][1] - got[r]['t'], 2) for r in got if r in status]} s after "
          f"their last write, statuses {[status.get(r, (None,))[0] for r in got]}, mpirun {proc.returncode}")


def test_a_bad_spawn_timeout_stops_a_respawn_job_at_its_start(mpi, digits_dir, tmp_path) -> None:
    """$ULFMTRAIN_SPAWN_TIMEOUT bounds every spawn and join: a bad value is one line before training, not an
    error at the first failure."""
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(tmp_path), "--epochs", "1",
                       "--no-progress", "--replace", "respawn"], 60, env={"ULFMTRAIN_SPAWN_TIMEOUT": "later"})
    assert "ulfmtrain: error: ULFMTRAIN_SPAWN_TIMEOUT='later' is not a positive number of seconds" in proc.stderr
    assert proc.returncode != 0 and not list(tmp_path.glob("rank*.jsonl"))


@pytest.mark.timeout(120)
def test_an_mpirun_that_gets_the_pid_of_a_killed_one_starts(tmp_path):
    """An mpirun SIGKILLed (a job ended by its tree) leaves its session directory, <tmpdir>/ompi.<pid>; a later
    mpirun that got the same pid failed at start ("The PMIx server's listener thread failed to start", status
    213: a benchmark run and the suite's compare test once each).  Here a killed mpirun's directory is put under
    the pid of the next one (the shell that execs the command keeps its pid); the job runs."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = subprocess.Popen([*prefix(1), "sleep", "60"], env=env)
    left = tmp_path / f"ompi.{killed.pid}"
    deadline = time.monotonic() + 60
    while not (left / "hwloc.sm").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = jobtree.descendants(killed.pid)        # its `sleep 60`, killed with it (only the test's own)
    killed.kill()
    killed.wait()
    for pid in rank:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert left.is_dir(), "a killed mpirun left no session directory: nothing to test"
    stale = 'cp -a "$STALE/." "$TMPDIR/ompi.$$"; exec "$@"'
    proc = subprocess.run(["/bin/sh", "-c", stale, "sh", *prefix(1), "true"], capture_output=True, text=True,
                          timeout=60, env={**env, "STALE": str(left)})
    assert proc.returncode == 0, proc.stderr[-2000:]
