"""Real mpirun, real SIGKILL: atomic checkpoints, checkpoint-restart under the supervisor, Reinit emulation, compare."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ulfmtrain.checkpoint.format import list_checkpoints, load_latest, read_pointer
from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.data.format import DatasetFile
from ulfmtrain.data.plan import initial_holdings

pytestmark = pytest.mark.faults
RANKS, EPOCHS, EVERY = 4, 3, 10     # digits: 23 steps per epoch on 4 ranks, 69 in all
RUN_S = 120


def train_argv(data: Path, out: Path, *extra: str, ckpt: Path | None = None, recovery: str = "restart") -> list[str]:
    argv = ["train", "--data", str(data), "--out", str(out), "--epochs", str(EPOCHS), "--model", "mlp",
            "--no-progress", "--recovery", recovery, "--ckpt-every", str(EVERY)]
    return argv + ["--ckpt-dir", str(ckpt or out / "ckpt")] + list(extra)


def supervise(mpi, n: int, argv: list[str], *sup: str) -> subprocess.CompletedProcess:
    return mpi.supervise(n, argv, "--timeout", str(RUN_S), *sup, timeout=2 * RUN_S)


def diag(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> dict:
    """A failure-free restart-mode run (plain MPI, checkpoints every 10 steps): the parameters to reproduce."""
    from ulfmtrain.launching.launch import mpirun_command

    out = tmp_path_factory.mktemp("reference")
    cmd = mpirun_command(RANKS, train_argv(digits_dir, out), ft=False)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S)
    assert (out / "summary.json").exists(), diag(proc)
    return {"dir": out, "summary": json.loads((out / "summary.json").read_text())}


@pytest.mark.timeout(150)
def test_kill_inside_the_checkpoint_write_leaves_latest_loadable(mpi, digits_dir: Path, tmp_path: Path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = mpi.run(RANKS, train_argv(digits_dir, out, "--kill", "0@20:checkpoint", ckpt=ckpt), RUN_S, ft=False)
    logs = read_rank_logs(out)
    assert [(r["step"], r["phase"]) for r in logs[0] if r["event"] == "kill"] == [(20, "checkpoint")], diag(proc)
    assert not (out / "summary.json").exists()
    # The writer died half-way through step 20's file: the pointer still names step 10, complete and verified.
    partial = list(ckpt.glob(".tmp-ckpt-000020.pt.*"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    assert read_pointer(ckpt)["file"] == "ckpt-000010.pt"
    assert load_latest(ckpt, warn=pytest.fail).step == 10
    assert not (ckpt / "ckpt-000020.pt").exists()

    # The supervisor resumes from it and finishes; the half-written file is cleaned up.
    proc = supervise(mpi, RANKS, train_argv(digits_dir, tmp_path / "again", "--resume", ckpt=ckpt))
    assert proc.returncode == 0, diag(proc)
    assert "resuming from ckpt-000010.pt" in proc.stderr
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["steps"] == EPOCHS * 23
    assert not list(ckpt.glob(".tmp-*"))


@pytest.mark.timeout(150)
def test_supervisor_restart_reproduces_the_failure_free_parameters(mpi, digits_dir: Path, tmp_path: Path,
                                                                   reference: dict) -> None:
    out = tmp_path / "run"
    proc = supervise(mpi, RANKS, train_argv(digits_dir, out, "--kill", "1@35"), "--max-attempts", "3")
    assert proc.returncode == 0, diag(proc)
    sup = json.loads((out / "supervisor.json").read_text())
    assert [a["completed"] for a in sup["attempts"]] == [False, True]
    assert sup["attempts"][0]["kills_fired"] == ["1@35:forward"] and sup["attempts"][0]["rc"] != 0
    assert sup["attempts"][1]["resumed_from"] == "ckpt-000030.pt"
    assert "--with-ft" not in " ".join(map(str, sup["attempts"][0]["argv"]))   # plain MPI: a failure ends the job
    summary = json.loads((out / "summary.json").read_text())
    assert summary["attempts"] == 2 and summary["world_history"] == [RANKS]
    assert summary["checksum"] == reference["summary"]["checksum"]            # bit for bit
    assert summary["test_acc"] == reference["summary"]["test_acc"]

    logs = read_rank_logs(out / "attempt-2")
    assert [r["step"] for r in logs[0] if r["event"] == "resume"] == [30]
    assert min(r["step"] for r in logs[0] if r["event"] == "step") == 30      # steps 30..34 replayed
    with DatasetFile(digits_dir / "train.ulfmds") as ds:                       # every rank re-read its whole shard
        full = {r: ds.nbytes(h) for r, h in initial_holdings(ds.count, RANKS).items()}
    assert {r: [x["bytes_read"] for x in recs if x["event"] == "ready"][0] for r, recs in logs.items()} == full


@pytest.mark.timeout(150)
def test_supervisor_relaunches_with_fewer_ranks(mpi, digits_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = supervise(mpi, RANKS, train_argv(digits_dir, out, "--kill", "3@35", "--ckpt-strategy", "overlapped"),
                     "--relaunch", "fewer")
    assert proc.returncode == 0, diag(proc)
    sup = json.loads((out / "supervisor.json").read_text())
    assert [a["ranks"] for a in sup["attempts"]] == [4, 3]
    resume = [r for r in read_rank_logs(out / "attempt-2")[0] if r["event"] == "resume"][0]
    # Overlapped: step 30's write may not have been durable when the job was torn down.
    assert resume["step"] in (20, 30) and (resume["ckpt_world"], resume["world"], resume["remapped"]) == (4, 3, True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["consistent"] and summary["epochs"] == EPOCHS


@pytest.mark.timeout(90)
def test_supervisor_stops_at_the_attempt_limit(mpi, digits_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = supervise(mpi, RANKS, train_argv(digits_dir, out, "--kill", "2@12"), "--max-attempts", "1")
    assert proc.returncode == 1, diag(proc)
    assert "giving up after 1 attempts (--max-attempts 1)" in proc.stderr
    assert not (out / "summary.json").exists()


@pytest.mark.timeout(150)
def test_reinit_restores_the_world_and_rolls_back(mpi, digits_dir: Path, tmp_path: Path, reference: dict) -> None:
    out = tmp_path / "run"
    proc = mpi.run(RANKS, train_argv(digits_dir, out, "--kill", "1@35", recovery="reinit"), RUN_S)
    assert (out / "summary.json").exists(), diag(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_history"] == [4, 3, 4] and summary["consistent"], summary
    assert summary["steps"] == EPOCHS * 23
    # Same world size after the rebuild, same order of ranks: the same parameters as without a failure.
    assert summary["checksum"] == reference["summary"]["checksum"]
    logs = read_rank_logs(out)
    reinit = {r: [x for x in recs if x["event"] == "reinit"] for r, recs in logs.items()}
    assert all(len(v) == 1 and v[0]["dead"] == [1] and v[0]["spawn_ok"] for v in reinit.values()), reinit
    assert reinit[1][0].get("replacement") and not any(reinit[r][0].get("replacement") for r in (0, 2, 3))
    # Every rank read its whole shard again and resumed from the step-30 checkpoint.
    for _r, recs in logs.items():
        ready = [x for x in recs if x["event"] == "ready"]
        assert len(ready) == 2 and ready[1]["bytes_read"] == ready[0]["bytes_read"] > 0
        assert [x["step"] for x in recs if x["event"] == "resume"] == [30]


@pytest.mark.timeout(150)
def test_reinit_survives_a_death_during_its_rebuild(mpi, digits_dir: Path, tmp_path: Path, reference: dict) -> None:
    """Slot 1 dies at step 35; slot 3 dies in the rebuild that follows (after the gather of the slots, before
    the spawn).  Before, the rebuild's collectives raised on every survivor and the job stopped; now the
    survivors repair and rebuild again, spawning for both slots, and end where a failure-free run ends."""
    out = tmp_path / "run"
    proc = mpi.run(RANKS, train_argv(digits_dir, out, "--kill", "1@35", "--kill", "3@0:rebuild", recovery="reinit"),
                   RUN_S)
    assert proc.returncode == 0, diag(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_history"][-1] == 4 and summary["consistent"], summary
    assert summary["checksum"] == reference["summary"]["checksum"]
    reinit = [x for x in read_rank_logs(out)[0] if x["event"] == "reinit"]
    assert len(reinit) == 1 and reinit[0]["dead"] == [1, 3] and reinit[0]["rebuilds"] == 1, reinit


@pytest.mark.timeout(150)
def test_resume_errors_are_clear(mpi, digits_dir: Path, tmp_path: Path, reference: dict) -> None:
    missing = tmp_path / "nowhere"
    proc = mpi.run(2, train_argv(digits_dir, tmp_path / "a", "--resume", ckpt=missing), RUN_S, ft=False)
    line = (f"ulfmtrain: error: checkpoint directory '{missing}' does not exist: check --ckpt-dir, "
            "or start without --resume to train from scratch")
    assert proc.stderr.splitlines().count(line) == 1, diag(proc)     # said once, by rank 0

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["dir"] / "ckpt", ckpt)
    proc = mpi.run(2, train_argv(digits_dir, tmp_path / "b", "--resume", "--model", "cnn", ckpt=ckpt), RUN_S, ft=False)
    assert "was saved from a different model" in proc.stderr and "resume with the --model" in proc.stderr, diag(proc)
    assert not (tmp_path / "b" / "summary.json").exists()

    proc = mpi.run(2, train_argv(digits_dir, tmp_path / "c", ckpt=ckpt), RUN_S, ft=False)   # fresh start, used dir
    assert "already holds checkpoints" in proc.stderr and "pass --resume" in proc.stderr, diag(proc)


@pytest.mark.timeout(120)
def test_corrupt_latest_checkpoint_is_reported_and_skipped(mpi, digits_dir: Path, tmp_path: Path,
                                                           reference: dict) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["dir"] / "ckpt", ckpt)
    (newest, path), (older, good) = list_checkpoints(ckpt)[:2]
    good_bytes = good.read_bytes()
    path.write_bytes(path.read_bytes()[:-64])      # truncated
    out = tmp_path / "run"
    proc = mpi.run(RANKS, train_argv(digits_dir, out, "--resume", ckpt=ckpt), RUN_S, ft=False)
    assert f"checkpoint '{path}' is truncated" in proc.stderr, diag(proc)
    assert f"using the previous good checkpoint '{good}'" in proc.stderr
    assert [r["step"] for r in read_rank_logs(out)[0] if r["event"] == "resume"] == [older]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checksum"] == reference["summary"]["checksum"]
    assert good.read_bytes() == good_bytes             # the good one was never overwritten


@pytest.mark.timeout(300)
def test_compare_reports_every_field(digits_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-P", "-m", "ulfmtrain", "compare", "--out", str(out), "--data", str(digits_dir),
           "--model", "mlp", "--epochs", "2", "--ckpt-every", "10", "--strategies", "overlapped", "--no-reference",
           "--spares", "1", "--modes", "shrink,restart,reinit"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * RUN_S)
    consoles = "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*/console.log"))
                       if proc.returncode)
    assert proc.returncode == 0, diag(proc) + consoles
    report = json.loads((out / "compare.json").read_text())
    assert set(report["runs"]) == {"shrink", "spares-1", "restart-overlapped", "reinit-overlapped"}
    for label, r in report["runs"].items():
        assert r["ok"], (label, r)
        for key in ("wall_s", "time_to_target_s", "lost_per_failure_s", "lost_breakdown_s", "steps_replayed",
                    "bytes_reread", "checkpoint", "goodput_samples_per_s", "test_acc", "failures", "progress"):
            assert key in r, (label, key)
        assert len(r["failures"]) == 1 and r["lost_per_failure_s"] > 0
        assert set(r["lost_breakdown_s"]) == {"detection", "mpi_recovery", "relaunch_init", "checkpoint_load",
                                              "data_reload", "replay"}
    for label in ("restart-overlapped", "reinit-overlapped"):
        r = report["runs"][label]
        assert r["steps_replayed"] > 0 and r["bytes_reread"] > 0
        assert r["checkpoint"]["stall_ms"] > 0 and r["checkpoint"]["write_ms"] > 0
        assert report["lost_ratio"][label] > 1
    assert report["runs"]["shrink"]["checkpoint"] is None
    spare = report["runs"]["spares-1"]     # the world kept its size; the hand-over is its relaunch/init
    assert spare["world_history"] == [RANKS, RANKS] and spare["lost_breakdown_s"]["relaunch_init"] > 0
    for png in ("compare_timeline.png", "compare_lost_time.png"):
        assert (out / png).stat().st_size > 10_000
    assert "lost time per failure" in proc.stdout
