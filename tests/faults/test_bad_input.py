"""Bad input gets one clear line naming the problem and the fix; nothing already written is lost."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("ulfmtrain: error:")]


@pytest.fixture
def out_with_old_summary(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"earlier": "run"}')
    return out


def assert_one_error(proc, *words):
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stdout + proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr


def test_corrupt_record_stops_every_rank(mpi, digits_dir, tmp_path, out_with_old_summary):
    bad = tmp_path / "bad"
    shutil.copytree(digits_dir, bad)
    with open(bad / "train.ulfmds", "r+b") as f:     # flip a byte near the end: only the last rank's shard
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    proc = mpi.run(2, ["train", "--data", str(bad), "--out", str(out_with_old_summary), "--no-progress"], 100)
    assert_one_error(proc, "checksum", "record", "python -m ulfmtrain data")
    assert (out_with_old_summary / "summary.json").read_text() == '{"earlier": "run"}'


def test_truncated_dataset(mpi, digits_dir, tmp_path, out_with_old_summary):
    bad = tmp_path / "bad"
    shutil.copytree(digits_dir, bad)
    with open(bad / "train.ulfmds", "r+b") as f:
        f.truncate(5000)
    proc = mpi.run(2, ["train", "--data", str(bad), "--out", str(out_with_old_summary), "--no-progress"], 100)
    assert_one_error(proc, "truncated", "python -m ulfmtrain data")
    assert (out_with_old_summary / "summary.json").read_text() == '{"earlier": "run"}'


def test_missing_dataset(mpi, tmp_path):
    proc = mpi.run(2, ["train", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")], 100)
    assert_one_error(proc, "nowhere", "python -m ulfmtrain data digits")


@pytest.mark.parametrize("spec,word", [("1@x", "bad kill spec"), ("1@5:sideways", "unknown phase"),
                                       ("7@5", "does not exist"), ("1@5:backward=2", "fraction")])
def test_bad_kill_spec(mpi, digits_dir, tmp_path, spec, word):
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(tmp_path), "--kill", spec], 100)
    assert_one_error(proc, word, "RANK@STEP")
    assert not (tmp_path / "summary.json").exists()


def test_fault_tolerance_not_enabled(mpi, digits_dir, tmp_path):
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(tmp_path)], 100, ft=False)
    assert_one_error(proc, "not enabled", "--with-ft ulfm")
    assert not (tmp_path / "summary.json").exists()


def test_data_info_on_corrupt_file(digits_dir, tmp_path):
    bad = tmp_path / "test.ulfmds"
    data = bytearray((digits_dir / "test.ulfmds").read_bytes())
    data[20] ^= 0xFF                                # inside the JSON header
    bad.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-P", "-m", "ulfmtrain", "data", "info", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert_one_error(proc, "header")


def test_bad_input_with_a_spare_stops_the_spare_too(mpi, digits_dir, tmp_path):
    """The spare checks the job before it starts waiting: bad input ends every rank, none waits for ever."""
    proc = mpi.run(3, ["train", "--data", str(digits_dir), "--out", str(tmp_path), "--spares", "1",
                       "--kill", "5@5"], 100)
    assert_one_error(proc, "does not exist", "RANK@STEP")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_stops_at_start(mpi, digits_dir, out_with_old_summary):
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(out_with_old_summary), "--device", "cuda",
                       "--no-progress"], 100)
    assert proc.returncode == 2 or not (out_with_old_summary / "rank0.jsonl").exists()
    assert_one_error(proc, "--device cuda", "--device cpu")
    assert (out_with_old_summary / "summary.json").read_text() == '{"earlier": "run"}'


def test_resnet18_on_flat_records_names_the_fix(mpi, tmp_path):
    from ulfmtrain.data.sources import synthetic_dataset

    flat = synthetic_dataset(tmp_path / "flat.ulfmds", records=64, features=32)
    proc = mpi.run(2, ["train", "--train", str(flat), "--out", str(tmp_path / "o"), "--model", "resnet18",
                       "--no-progress"], 100)
    assert_one_error(proc, "resnet18", "--shape 3,32,32")


def test_respawn_with_another_recovery_mode_is_refused(mpi, digits_dir, tmp_path):
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(tmp_path), "--replace", "respawn",
                       "--recovery", "restart"], 100)
    assert_one_error(proc, "--replace respawn", "--recovery shrink")


class PlantsAFile:
    """A pickle that runs a command creating a file, if anything loads it."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_that_would_run_code_is_refused(mpi, digits_dir, tmp_path, out_with_old_summary):
    """train --resume from a checkpoint directory someone else wrote into: the replica section is a pickle that
    would create a file, in a file with a valid checksum.  One line, status 2, the file never appears."""
    import io

    import torch

    from ulfmtrain.checkpoint.format import Snapshot, model_signature, write_checkpoint
    from ulfmtrain.training.models import build_model

    planted, ckpt = tmp_path / "planted", tmp_path / "ckpt"
    buf = io.BytesIO()
    torch.save({"model": PlantsAFile(planted)}, buf)
    ckpt.mkdir()
    # The header of the model that train builds, so that every check of the format passes (as an attacker's would).
    write_checkpoint(ckpt, Snapshot(step=5, epoch=0, records_done=0, world_size=2,
                                    model=model_signature(build_model("mlp")),
                                    sections={"replica": buf.getvalue(), "rng": buf.getvalue()}))
    proc = mpi.run(2, ["train", "--data", str(digits_dir), "--out", str(out_with_old_summary), "--ckpt-dir",
                       str(ckpt), "--resume", "--model", "mlp", "--no-progress"], 100)
    assert proc.returncode == 2 and not planted.exists(), proc.stdout + proc.stderr
    assert_one_error(proc, "ckpt-000005.pt' is refused", "GLOBAL posix.system", "a copy you trust")
    assert (out_with_old_summary / "summary.json").read_text() == '{"earlier": "run"}'
