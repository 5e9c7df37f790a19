"""Shared fixtures: a digits dataset, and running jobs under real mpirun --with-ft ulfm."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ulfmtrain.launching.launch import mpirun_command, mpirun_prefix, warm_server

ROOT = Path(__file__).resolve().parent.parent

# tests/mpi runs only inside mpirun (tests/test_mpi_suite.py starts it).
collect_ignore_glob = [] if os.environ.get("ULFMTRAIN_IN_MPIRUN") else ["mpi/*"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked cuda skip with one line where no GPU can be used (CI has none)."""
    if not any("cuda" in item.keywords for item in items):
        return
    from ulfmtrain.training.device import cuda_missing

    why = cuda_missing()
    if why:
        skip = pytest.mark.skip(reason=f"no GPU: {why}")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


class FakeComm:
    """Sums as if `size` ranks had sent the same contribution; records the size of every reduction."""

    rank, world_rank, next_attempt, step, alive = 0, 0, 0, 0, [0]

    def __init__(self, size: int = 3) -> None:
        self.size, self.sent, self.barriers = size, [], 0

    def barrier(self):
        self.barriers += 1

    def reduce_try(self, send, recv, op=None):
        self.sent.append(send.size)
        np.multiply(send, self.size, out=recv)

    def transaction(self, attempt, commit=None, *, what="step", before_agree=None):
        result = attempt(0)
        if commit is not None:
            commit(result)
        return result

    def bcast_bytes(self, make, root=0):
        return make()


@pytest.fixture(scope="session", autouse=True)
def warm_ranks():
    """The ranks of the suite's jobs start as forks of one server that imported torch and ulfmtrain once
    (forkserver.py, as respawned processes do; launch.warm_start): 3-6 s of CPU less per rank, most of the
    suite's time on 2 cores.  Ranks of scripts started by hand (run_script) and of other hosts start from
    scratch.  ULFMTRAIN_FORKSERVER=0 starts every rank from scratch."""
    if os.environ.get("ULFMTRAIN_IN_MPIRUN"):
        yield
        return
    with warm_server():
        yield


@pytest.fixture(autouse=True)
def no_stale_daemon_sessions():
    """After each test: the session directories that PRRTE daemons SIGKILLed by it left (<tmpdir>/prted.<pid>;
    the namespace and Slurm hosts share this machine's /tmp).  A later daemon that got the same pid would fail
    at start ("The PMIx server's listener thread failed to start"); launch guards mpirun's own (mpirun_head),
    a real host's are its own."""
    yield
    for d in Path(os.environ.get("TMPDIR", "/tmp")).glob("prted.*"):
        pid = d.name.split(".", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_comm() -> type[FakeComm]:
    """A one-process stand-in communicator, for pure logic (never proof that recovery works)."""
    return FakeComm


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ulfmtrain.data.sources import digits_to_dataset

    d = tmp_path_factory.mktemp("digits")
    digits_to_dataset(d)
    return d


# Open MPI's runtime failing to start, before any rank ran (seen once in a CI run of 500 tests: the PMIx server's
# listener thread): not the code under test; such a launch is tried once more, and says so.
RUNTIME_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def _run(cmd: list[str], timeout: float, env: dict | None, what: str = "mpirun") -> subprocess.CompletedProcess:
    def launch() -> subprocess.CompletedProcess:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})}, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{what} did not finish within {timeout} s (a hung collective?): {' '.join(cmd)}\n"
                        f"{exc.stdout}\n{exc.stderr}")

    proc = launch()
    failed_start = next((m for m in RUNTIME_START_FAILURES if m in proc.stdout + proc.stderr), None)
    if failed_start is None:
        return proc
    print(f"{what}: Open MPI's runtime did not start ({failed_start}); launching once more", file=sys.stderr)
    return launch()


def run_mpi(n: int, argv: list[str], timeout: float, *, ft: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ulfmtrain ARGV` under mpirun; a hang fails the test."""
    return _run(mpirun_command(n, argv, ft=ft), timeout, env)


def run_script(n: int, script: Path, args: list[str], timeout: float,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a Python script (not the CLI) on n ranks under mpirun --with-ft ulfm."""
    return _run([*mpirun_prefix(n), sys.executable, "-P", str(script), *args], timeout, env)


def launch_script(script: Path, out: Path, args: list[str], timeout: float, *, n: int = 3, spares: int = 0,
                  kill: str | None = None) -> subprocess.CompletedProcess:
    """`python -m ulfmtrain launch -n N --spares K -- python SCRIPT OUT ARGS`, as a user runs a script: its events in
    OUT/events, $ULFMTRAIN_KILL from `kill`; a hang fails the test, and so does a process of the job that
    outlives mpirun (its ranks name OUT)."""
    import time

    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ULFMTRAIN_KILL", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update({"ULFMTRAIN_EVENTS": str(out / "events"), **({"ULFMTRAIN_KILL": kill} if kill else {})})
    cmd = [sys.executable, "-m", "ulfmtrain", "launch", "-n", str(n), "--spares", str(spares), "--", "python",
           str(script), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    failed_start = next((m for m in RUNTIME_START_FAILURES if m in proc.stdout + proc.stderr), None)
    if failed_start is not None:        # before any rank ran: once more, as _run does
        print(f"launch: Open MPI's runtime did not start ({failed_start}); launching once more", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    def ours() -> set[int]:
        pids = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
        return {int(p) for p in pids} - {os.getpid()}

    deadline = time.monotonic() + 2.0      # mpirun returns once it saw a status; a rank can take a moment to go
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours(), "a process of the job outlived mpirun"
    return proc


def run_supervise(n: int, argv: list[str], *sup: str, timeout: float,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `ulfmtrain supervise -n N SUP -- ARGV`; a hang fails the test."""
    cmd = [sys.executable, "-P", "-m", "ulfmtrain", "supervise", "-n", str(n), *sup, "--", *argv]
    return _run(cmd, timeout, env, "supervise")


def train_slots(ranks: int, argv: list[str], out: Path, epochs: int, timeout: float, ended: list[int], *,
                env: dict | None = None) -> tuple[dict[int, dict], dict[int, list[dict]], str]:
    """Run `train ARGV --out OUT` on `ranks` ranks; check that the slots `ended` end, on one replica, with every
    record of every epoch seen exactly once; return each slot's end record, the logs and mpirun's stderr."""
    from ulfmtrain.core.events import read_rank_logs, select
    from ulfmtrain.tools.audit import audit_logs

    proc = run_mpi(ranks, [*argv, "--out", str(out)], timeout, env=env)
    logs = read_rank_logs(out)
    diag = proc.stdout[-2000:] + proc.stderr[-3000:]
    # One log per slot: a process that takes a slot goes on writing that slot's log.
    ends = {r: select(recs, "end")[-1] for r, recs in logs.items() if select(recs, "end")}
    assert sorted(ends) == ended, diag
    # Training completed, whatever failed on the way: mpirun says so (a newcomer that died before it joined
    # made it 137 before `launch` made spawned jobs recoverable).
    assert proc.returncode == 0, f"mpirun's status {proc.returncode}\n{diag}"
    assert len({e["checksum"] for e in ends.values()}) == 1 and all(e["consistent"] for e in ends.values()), ends
    rows = audit_logs(logs)
    assert len(rows) == epochs and all(r.exact and r.finished for r in rows), rows
    return ends, logs, proc.stderr


@pytest.fixture(scope="session")
def mpi():
    """The helpers above, for tests (importlib mode keeps conftest out of reach of imports)."""
    return type("Mpi", (), {"run": staticmethod(run_mpi), "script": staticmethod(run_script),
                            "launch": staticmethod(launch_script),
                            "train_slots": staticmethod(train_slots), "supervise": staticmethod(run_supervise),
                            "root": ROOT})
