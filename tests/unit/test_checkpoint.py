"""Unit tests for ulfmtrain.checkpoint: the atomic file protocol, verification and fallback, both writers (no MPI)."""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ulfmtrain.checkpoint.checkpointer import Checkpointer, TrainingState, capture
from ulfmtrain.checkpoint.format import (
    LATEST,
    CheckpointError,
    check_model,
    checkpoint_name,
    list_checkpoints,
    load_latest,
    prune,
    read_checkpoint,
    read_pointer,
    remove_stale_temporaries,
    write_checkpoint,
)
from ulfmtrain.checkpoint.writer import OverlappedWriter, WriteResult
from ulfmtrain.cli import build_parser
from ulfmtrain.training.config import TrainJob
from ulfmtrain.training.models import MLP
from ulfmtrain.training.optim import FTSGD
from ulfmtrain.transport import faults
from ulfmtrain.transport.faults import parse_kill


class FakeComm:
    """The slice of FaultTolerantComm a Checkpointer uses, for one process standing in for `size` ranks."""

    def __init__(self, size: int = 4, rank: int = 0) -> None:
        self.size, self.rank, self.agreed = size, rank, []

    def bcast_obj(self, make: Any) -> Any:
        return make()

    def bcast_bytes(self, make: Any) -> Any:
        return make()

    def agree(self, flag: int) -> int:
        self.agreed.append(flag)
        return flag


class FakeTrainer:
    """A TrainingState (what a Checkpointer saves and restores) over a real model and optimizer, without MPI."""

    def __init__(self, seed: int = 0, hidden: tuple[int, ...] = (16,), size: int = 4, spe: int = 23,
                 kills: tuple = ()) -> None:
        torch.manual_seed(seed)
        self.model = MLP(8, hidden=hidden, classes=3)
        self.comm = FakeComm(size)
        self.opt = FTSGD(self.model.parameters(), self.comm, lr=0.1, momentum=0.9, model=self.model)
        self.position = [0, 0]       # epoch, steps in it: stands in for the sampler state
        self.opt._register_extra_state("position", lambda: list(self.position), self._set)
        self.spe = spe
        self.records: list[dict] = []
        faults.arm(kills, 0)

    def _set(self, pos: list[int]) -> None:
        self.position = list(pos)

    @property
    def step(self) -> int:
        return self.opt.step_count

    @property
    def epoch(self) -> int:
        return self.position[0]

    @property
    def records_done(self) -> int:
        return self.position[1] * 5

    @property
    def epoch_ended(self) -> bool:
        return self.position[1] >= self.spe

    def replica_state(self) -> bytes:
        return self.opt.job.payload()

    def load_replica_state(self, blob: bytes) -> None:
        self.opt.job.load(blob)

    def log(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})

    def train_step(self) -> None:
        """One SGD step on random data (gives the optimizer momentum state), then advance the sampler."""
        x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.optimizer.step()
        self.opt.step_count += 1
        self.position[1] += 1


def _snap(step: int, seed: int = 0):
    tr = FakeTrainer(seed)
    for _ in range(step):
        tr.train_step()
    return tr, capture(tr)


def _flip(path: Path, offset_from_end: int = 10) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="session")
def three_written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 10, 20 and 30, written once (60 SGD steps and three writes) for every test's copy."""
    d = tmp_path_factory.mktemp("three")
    for s in (10, 20, 30):
        write_checkpoint(d, _snap(s)[1])
    return d


@pytest.fixture
def three(tmp_path: Path, three_written: Path) -> Path:
    """A directory with checkpoints of steps 10, 20 and 30 (latest -> 30), this test's own."""
    shutil.copytree(three_written, tmp_path, dirs_exist_ok=True)
    return tmp_path


class Warnings(list):
    def __call__(self, msg: str) -> None:
        self.append(msg)


# --------------------------------------------------------------------------- format and protocol


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    tr, snap = _snap(7)
    tr.position = [1, 3]
    snap = capture(tr)
    path = write_checkpoint(tmp_path, snap)
    assert path.name == checkpoint_name(7) == "ckpt-000007.pt"
    assert read_pointer(tmp_path) == {"file": "ckpt-000007.pt", "step": 7}
    ck = read_checkpoint(path)
    assert (ck.step, ck.header["epoch"], ck.header["records_done"], ck.header["world_size"]) == (7, 1, 15, 4)
    other = FakeTrainer(seed=99)
    assert other.opt.checksum() != tr.opt.checksum()
    other.opt.job.load(ck.sections["replica"])
    assert other.opt.checksum() == tr.opt.checksum()          # model, momentum buffers and step
    assert other.position == [1, 3]                           # the sampler position (registered extra state)
    assert other.opt.optimizer.state_dict()["state"]         # optimizer state is really there


def test_rng_states_are_saved_and_restored(tmp_path: Path) -> None:
    tr = FakeTrainer()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    snap = capture(tr)
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    write_checkpoint(tmp_path, snap)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    back = FakeTrainer(seed=5)
    Checkpointer(tmp_path, every=1, resume=True).begin(back)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_the_trainer_is_a_training_state(tmp_path: Path) -> None:
    """The real Trainer has every member of the protocol, and a checkpoint of it restores into another one."""
    from ulfmtrain.data.sources import arrays_to_dataset
    from ulfmtrain.training.trainer import TrainConfig, Trainer

    class TrainerComm(FakeComm):
        world_rank, alive = 0, [0]

        def add_listener(self, fn: Any) -> None:
            pass

    rng = np.random.default_rng(0)
    train, _ = arrays_to_dataset(tmp_path / "d", rng.standard_normal((40, 8)).astype(np.float32), np.arange(40) % 3)

    def trainer(seed: int) -> Trainer:
        torch.manual_seed(seed)
        return Trainer(MLP(8, hidden=(16,), classes=3), TrainerComm(size=1), train, config=TrainConfig(progress=False))

    first = trainer(0)
    members = [name for name in vars(TrainingState) if not name.startswith("_")]
    assert sorted(members) == sorted(["comm", "model", "step", "epoch", "records_done", "epoch_ended",
                                      "replica_state", "load_replica_state", "log"])
    assert all(hasattr(first, name) for name in members)
    first.sampler.start_epoch(0)
    first.sampler.commit()
    Checkpointer(tmp_path / "c", every=1).begin(first)
    header = read_checkpoint(tmp_path / "c" / "ckpt-000000.pt").header
    assert (header["step"], header["epoch"], header["records_done"], header["world_size"]) == (0, 0, 16, 1)
    second = trainer(1)
    assert second.opt.checksum() != first.opt.checksum()
    second.sampler.start_epoch(0)
    assert Checkpointer(tmp_path / "c", every=1, resume=True).begin(second) is True
    assert second.opt.checksum() == first.opt.checksum() and second.records_done == 16


def test_no_temporary_files_are_left(three: Path) -> None:
    assert sorted(p.name for p in three.iterdir()) == sorted(
        [LATEST, "ckpt-000010.pt", "ckpt-000020.pt", "ckpt-000030.pt"])


# --------------------------------------------------------------------------- bad checkpoints


def test_corrupt_latest_falls_back_to_the_previous_good(three: Path) -> None:
    _flip(three / "ckpt-000030.pt")
    warned = Warnings()
    ck = load_latest(three, warn=warned)
    assert ck.step == 20
    assert warned == [f"checkpoint '{three / 'ckpt-000030.pt'}' is corrupt (checksum mismatch); "
                      f"using the previous good checkpoint '{three / 'ckpt-000020.pt'}'"]


def test_truncated_latest_falls_back(three: Path) -> None:
    p = three / "ckpt-000030.pt"
    p.write_bytes(p.read_bytes()[:-100])
    warned = Warnings()
    assert load_latest(three, warn=warned).step == 20
    assert "is truncated" in warned[0] and "ckpt-000020.pt" in warned[0]


@pytest.mark.parametrize("damage", ["header", "magic", "empty", "trailing"])
def test_every_kind_of_damage_is_detected(three: Path, damage: str) -> None:
    p = three / "ckpt-000030.pt"
    raw = bytearray(p.read_bytes())
    if damage == "header":
        raw[20] ^= 0x01
    elif damage == "magic":
        raw[0:8] = b"NOTACKPT"
    elif damage == "empty":
        raw = bytearray()
    else:
        raw += b"junk"
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"ckpt-000030.pt' (is corrupt|is not|is truncated)"):
        read_checkpoint(p)
    assert load_latest(three, warn=Warnings()).step == 20


def test_pointer_to_a_missing_file_falls_back(three: Path) -> None:
    (three / "ckpt-000030.pt").unlink()
    warned = Warnings()
    assert load_latest(three, warn=warned).step == 20
    assert "is missing" in warned[0]


def test_files_newer_than_the_pointer_are_not_used(three: Path) -> None:
    (three / LATEST).write_text(json.dumps({"file": "ckpt-000020.pt", "step": 20}))
    assert load_latest(three, warn=Warnings()).step == 20


def test_no_good_checkpoint_is_a_clear_error(three: Path) -> None:
    for s in (10, 20, 30):
        _flip(three / checkpoint_name(s))
    with pytest.raises(CheckpointError, match=r"^no good checkpoint in '.*': .*ckpt-000030.pt' is corrupt .*"
                                              r"start without --resume"):
        load_latest(three, warn=Warnings())


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^checkpoint directory '.*nope' does not exist: check --ckpt-dir"):
        load_latest(tmp_path / "nope")


def test_empty_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^no checkpoint in '.*'.*start without --resume"):
        load_latest(tmp_path)


def test_mismatched_model_is_a_clear_error(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, _snap(3)[1])
    ck = load_latest(tmp_path)
    check_model(ck, FakeTrainer().model)        # same architecture: fine
    with pytest.raises(CheckpointError, match=r"saved from a different model \(net.1.weight is \[16, 8\] float32 "
                                              r"there, \[32, 8\] float32 here\): resume with the --model"):
        check_model(ck, FakeTrainer(hidden=(32,)).model)
    with pytest.raises(CheckpointError, match="different model"):
        Checkpointer(tmp_path, every=1, resume=True).begin(FakeTrainer(hidden=(16, 4)))


# --------------------------------------------------------------------------- writes that fail


def test_a_failed_write_never_replaces_the_previous_good(three: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (three / "ckpt-000030.pt").read_bytes()
    _, snap = _snap(30, seed=1)                           # same step, other contents

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_checkpoint(three, snap)
    monkeypatch.undo()
    assert (three / "ckpt-000030.pt").read_bytes() == before
    assert read_pointer(three)["file"] == "ckpt-000030.pt"
    assert not list(three.glob(".tmp-*"))
    assert load_latest(three).step == 30


def test_a_writer_killed_mid_write_leaves_latest_intact(three: Path) -> None:
    class Killed(BaseException):
        pass

    def die(step: int, phase: str) -> None:
        assert (step, phase) == (40, "checkpoint")
        raise Killed

    with pytest.raises(Killed):
        write_checkpoint(three, _snap(40)[1], fault_point=die)
    assert read_pointer(three)["file"] == "ckpt-000030.pt"
    assert not (three / "ckpt-000040.pt").exists()
    assert load_latest(three).step == 30


def test_stale_temporaries_are_removed(three: Path) -> None:
    (three / ".tmp-ckpt-000040.pt.abc").write_bytes(b"half")
    assert [p.name for p in remove_stale_temporaries(three)] == [".tmp-ckpt-000040.pt.abc"]
    assert load_latest(three).step == 30


def test_checkpointer_keeps_training_when_a_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr, warned = FakeTrainer(), Warnings()
    ck = Checkpointer(tmp_path, every=2, warn=warned)
    ck.begin(tr)
    monkeypatch.setattr("ulfmtrain.checkpoint.checkpointer.write_checkpoint",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    tr.train_step(), tr.train_step()
    ck.after_step(tr)
    assert warned == [f"checkpoint of step 2 was not written (OSError: [Errno 28] No space left on device); "
                      f"the latest good one stays '{tmp_path / 'ckpt-000000.pt'}'"]
    assert tr.comm.agreed[-1] == 0                        # every rank learns the write failed
    assert load_latest(tmp_path).step == 0


# --------------------------------------------------------------------------- the checkpointer


def test_fresh_start_writes_step_zero_and_saves_every_k(tmp_path: Path) -> None:
    tr = FakeTrainer()
    ck = Checkpointer(tmp_path / "c", every=3, keep=2)
    assert ck.begin(tr) is False                          # nothing restored: fit() broadcasts rank 0's state
    for _ in range(7):
        tr.train_step()
        ck.after_step(tr)
    ck.close()
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [6, 3]   # keep=2 pruned 0
    saves = [r for r in tr.records if r["event"] == "checkpoint"]
    assert [(r["step"], r["initial"]) for r in saves] == [(0, True), (3, False), (6, False)]
    assert all(r["stall_ms"] >= r["snapshot_ms"] > 0 for r in saves)


def test_epoch_checkpoints(tmp_path: Path) -> None:
    tr = FakeTrainer(spe=4)
    ck = Checkpointer(tmp_path, epoch=True)
    ck.begin(tr)
    for _ in range(4):
        tr.train_step()
        ck.after_step(tr)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 0]


def test_fresh_start_refuses_a_directory_with_checkpoints(three: Path) -> None:
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(step 30\).*pass --resume"):
        Checkpointer(three, every=5).begin(FakeTrainer())


def test_resume_with_another_world_size_hands_the_state_over(tmp_path: Path) -> None:
    """The replicated state (sampler included) is restored whatever the world size; the sampler re-plans itself."""
    tr = FakeTrainer(size=4, spe=20)
    tr.position = [2, 10]
    write_checkpoint(tmp_path, capture(tr))
    other = FakeTrainer(size=3, spe=30)
    other.comm.size = 3
    assert Checkpointer(tmp_path, every=5, resume=True).begin(other) is True
    assert other.position == [2, 10] and other.opt.checksum() == tr.opt.checksum()
    assert [r for r in other.records if r["event"] == "resume"][0]["remapped"] is True


def test_prune_keeps_files_newer_than_the_committed_one(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        write_checkpoint(tmp_path, _snap(s)[1])
    prune(tmp_path, 20, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 30, 20, 10]
    prune(tmp_path, 40, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 30]


# --------------------------------------------------------------------------- overlapped


def test_overlapped_writes_what_was_captured_not_what_training_did_next(tmp_path: Path) -> None:
    tr = FakeTrainer()
    ck = Checkpointer(tmp_path, every=2, strategy="overlapped")
    ck.begin(tr)
    tr.train_step(), tr.train_step()
    at_capture = tr.opt.checksum()
    ck.after_step(tr)
    for _ in range(5):                                    # training runs on while the writer works
        tr.train_step()
    ck.close()
    back = FakeTrainer(seed=3)
    back.opt.job.load(read_checkpoint(tmp_path / "ckpt-000002.pt").sections["replica"])
    assert back.opt.checksum() == at_capture
    written = [r for r in tr.records if r["event"] == "checkpoint_written"]
    assert [r["step"] for r in written] == [0, 2] and all(r["write_ms"] > 0 for r in written)
    assert read_pointer(tmp_path)["step"] == 2


def test_overlapped_writer_bounds_writes_in_flight() -> None:
    gate, started = threading.Event(), []

    def slow(snap: Any) -> WriteResult:
        started.append(snap)
        gate.wait(5)
        return WriteResult(snap.step, "x", 1.0, 1, time.time())

    w = OverlappedWriter(slow, max_inflight=2)
    snaps = [SimpleNamespace(step=i) for i in range(3)]
    assert w.submit(snaps[0]) < 50 and w.submit(snaps[1]) < 50   # two slots: no wait
    third = threading.Thread(target=w.submit, args=(snaps[2],))
    third.start()
    third.join(0.3)
    assert third.is_alive()                               # the third waits for a free slot
    gate.set()
    third.join(5)
    assert [r.step for r in w.close()] == [0, 1, 2]


# --------------------------------------------------------------------------- flags


def _job(**kw: Any) -> TrainJob:
    """The train job of the command line with these flags (flag name: value)."""
    argv = ["train"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        for x in (v if isinstance(v, list) else [v]):
            argv += [flag] if x is True else [flag, str(x)]
    return TrainJob.from_args(build_parser().parse_args(argv))


def _checkpointer(job: TrainJob, resume: bool = False) -> Checkpointer | None:
    job.validate()
    return job.checkpointer(resume)


@pytest.mark.parametrize("kw, msg", [
    ({"recovery": "restart"}, "--recovery restart rolls back to a checkpoint: add --ckpt-dir DIR"),
    ({"recovery": "reinit"}, "--recovery reinit rolls back to a checkpoint: add --ckpt-dir DIR"),
    ({"ckpt_every": 5}, "--ckpt-every needs a checkpoint directory: add --ckpt-dir DIR"),
    ({"resume": True}, "--resume needs a checkpoint directory: add --ckpt-dir DIR"),
    ({"ckpt_dir": "c", "ckpt_every": -1}, "--ckpt-every must be 0 (off) or a positive number"),
    ({"ckpt_dir": "c", "ckpt_keep": 1}, "--ckpt-keep must be at least 2"),
    ({"ckpt_dir": "c", "kill": ["1@40:checkpoint"]}, "only rank 0 writes checkpoints (use 0@STEP:checkpoint)"),
])
def test_bad_flags_are_one_line_errors(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError) as exc:
        _checkpointer(_job(**kw))
    assert msg in str(exc.value) and "\n" not in str(exc.value)


def test_flags_build_a_checkpointer() -> None:
    assert _checkpointer(_job()) is None
    ck = _checkpointer(_job(ckpt_dir="c", recovery="restart"))
    assert (ck.every, ck.epoch, ck.strategy) == (0, True, "blocking")   # no cadence given: every epoch
    ck = _checkpointer(_job(ckpt_dir="c", ckpt_every=20, ckpt_strategy="overlapped"), resume=True)
    assert (ck.every, ck.epoch, ck.strategy, ck.resume) == (20, False, "overlapped", True)


def test_checkpoint_kill_phase_parses() -> None:
    assert str(parse_kill("0@40:checkpoint")) == "0@40:checkpoint"


def test_a_rank_of_an_earlier_supervise_attempt_writes_no_more(tmp_path: Path) -> None:
    """A rank can outlive its mpirun (a host lost: seconds of teardown) and go on checkpointing while supervise
    relaunches: once the next attempt claimed the directory, its writes are refused and the pointer stays."""
    from ulfmtrain.checkpoint.format import claim, read_owner

    assert claim(tmp_path) == 1 and read_owner(tmp_path) == 1
    tr, warned = FakeTrainer(), Warnings()
    ck = Checkpointer(tmp_path, every=2, warn=warned)
    ck.begin(tr)                                          # attempt 1: step 0 written
    tr.train_step(), tr.train_step()
    ck.after_step(tr)                                     # step 2 written
    assert claim(tmp_path) == 2                           # supervise relaunches
    tr.train_step(), tr.train_step()
    ck.after_step(tr)
    assert warned == ["checkpoint of step 4 was not written (attempt 2 of `ulfmtrain supervise` writes there now, "
                      f"not this one (1)); the latest good one stays '{tmp_path / 'ckpt-000002.pt'}'"]
    assert load_latest(tmp_path).step == 2 and [s for s, _ in list_checkpoints(tmp_path)] == [2, 0]
    fresh, tr2 = Checkpointer(tmp_path, every=2, resume=True), FakeTrainer()    # attempt 2 resumes and writes
    assert fresh.begin(tr2) is True and tr2.step == 2
    tr2.train_step(), tr2.train_step()
    fresh.after_step(tr2)
    assert load_latest(tmp_path).step == 4


class PlantsAFile:
    """What an attacker puts in a checkpoint: loading it with pickle runs a command that creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def tampered(directory: Path, section: str, how: str, planted: Path) -> Path:
    """A checkpoint whose `section` is a pickle (`how`: as torch.save writes it, or plain as format 1's random
    state was) that would create `planted`, written with a valid checksum (the writer's own code computes it: the
    checksum detects corruption, not tampering)."""
    import io
    import pickle

    _, snap = _snap(3)
    payload = {"model": {}, "optimizer": PlantsAFile(planted), "step": 3, "extra": {}, "python": PlantsAFile(planted)}
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(payload, buf)
        snap.sections[section] = buf.getvalue()
    else:
        snap.sections[section] = pickle.dumps(payload)
    directory.mkdir()
    return write_checkpoint(directory, snap)


@pytest.mark.parametrize("section, how", [("replica", "torch.save"), ("rng", "torch.save"), ("rng", "pickle")])
def test_a_checkpoint_that_would_run_code_is_refused_with_one_line(tmp_path: Path, section: str, how: str) -> None:
    """The review's attack: whoever can write the checkpoint directory puts in a pickle that runs a command.
    Resuming refuses it with one line, and the command never runs (before: torch.load(weights_only=False) and
    pickle.loads ran it, and created the file)."""
    planted = tmp_path / "planted"
    path = tampered(tmp_path / "ckpt", section, how, planted)
    assert read_checkpoint(path).step == 3                    # a valid checksum: it passes the format's checks
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path / "ckpt", every=1, resume=True).begin(FakeTrainer(seed=1))
    assert not planted.exists()
    msg = str(err.value)
    assert "\n" not in msg and f"'{path}' is refused: its {section} section holds what a safe load refuses (" in msg
    assert "restore the directory from a copy you trust" in msg
    assert how == "pickle" or "GLOBAL posix.system" in msg, msg      # the zip's pickle names what it would call


def test_a_registered_state_that_needs_pickle_opts_in(tmp_path: Path) -> None:
    """An object whose state holds more than data is refused when registered, with the fix; pickle=True takes
    it (documented: whoever can write the checkpoints can then run code), and it survives a checkpoint."""
    from fractions import Fraction

    class Odd:
        def __init__(self) -> None:
            self.value = Fraction(1, 3)

        def state_dict(self) -> dict:
            return {"value": self.value}

        def load_state_dict(self, state: dict) -> None:
            self.value = state["value"]

    tr = FakeTrainer()
    with pytest.raises(TypeError, match=r"comm.track\(odd=\.\.\.\): its state_dict\(\) holds what a safe "
                                        r"load refuses .*Fraction.*pickle=True"):
        tr.opt.register_state("odd", Odd())
    odd = Odd()
    odd.value = Fraction(2, 7)
    tr.opt.register_state("odd", odd, pickle=True)
    write_checkpoint(tmp_path, capture(tr))
    back, again = FakeTrainer(seed=1), Odd()
    back.opt.register_state("odd", again, pickle=True)
    Checkpointer(tmp_path, every=1, resume=True).begin(back)
    assert again.value == Fraction(2, 7)


@pytest.mark.parametrize("value", [np.zeros(0, dtype=np.uint8), np.packbits(np.zeros(0, dtype=bool)),
                                   np.zeros((0, 3), dtype=np.int64), np.arange(5), np.ones(4, dtype=bool)],
                         ids=["empty-uint8", "empty-packbits", "empty-2d", "int64", "bool"])
def test_the_safe_load_takes_every_numpy_array_the_state_holds(value: np.ndarray) -> None:
    """numpy pickles an empty array's data as a call of bytes(): the safe load must take it (the sampler's books
    hold packed bits that are empty before any record is seen; a spare refused the hand-over with "GLOBAL bytes
    was not an allowed global" and died)."""
    from ulfmtrain.training import serialize

    back = serialize.loads(serialize.dumps({"v": value}))["v"]
    assert back.dtype == value.dtype and back.shape == value.shape and (back == value).all()
