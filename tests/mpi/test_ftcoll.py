"""Run under mpirun --with-ft ulfm at 2 and 4 ranks (no failures): the FT path equals plain MPI."""
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from ulfmtrain import _ftcoll
from ulfmtrain.comm import FaultTolerantComm, PlainComm
from ulfmtrain.data import ShardedDataset
from ulfmtrain.models import MLP, DigitsCNN
from ulfmtrain.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    c.Set_errhandler(MPI.ERRORS_RETURN)
    yield c
    c.Free()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_ft_allreduce_equals_plain(comm, dtype, n):
    rng = np.random.default_rng(comm.Get_rank() * 7919 + n)
    send = (rng.standard_normal(n) * 100).astype(dtype)
    ours, plain = np.empty_like(send), np.empty_like(send)
    status, fresh, report = _ftcoll.allreduce(comm, send, ours, MPI.SUM, 0)
    comm.Allreduce(send, plain, op=MPI.SUM)
    assert (status, fresh, report) == (_ftcoll.OK, None, None)
    assert np.array_equal(ours, plain)      # bit for bit: the same reduction


def test_ft_allreduce_max_and_agree(comm):
    send = np.array([comm.Get_rank()], dtype=np.int64)
    out = np.empty_like(send)
    assert _ftcoll.allreduce(comm, send, out, MPI.MAX, 0)[0] == _ftcoll.OK
    assert out[0] == comm.Get_size() - 1
    flag, (status, _, _) = _ftcoll.agree(comm, 0b1110 | (comm.Get_rank() == 0), 0)
    assert status == _ftcoll.OK and flag == (0b1111 if comm.Get_size() == 1 else 0b1110)


def test_buffers_are_checked(comm):
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="distinct"):
        _ftcoll.allreduce(comm, a, a, MPI.SUM, 0)
    with pytest.raises(ValueError, match="same size"):
        _ftcoll.allreduce(comm, a, np.zeros(5, np.float32), MPI.SUM, 0)


def test_world_history_without_failure():
    ft = FaultTolerantComm()
    assert ft.world_history == [MPI.COMM_WORLD.Get_size()]
    assert ft.alive == list(range(MPI.COMM_WORLD.Get_size()))


def _train(comm_cls, digits_dir, model_cls):
    torch.manual_seed(1234)
    comm = comm_cls()
    model = model_cls()
    cfg = TrainConfig(epochs=2, batch=16, progress=False)
    trainer = Trainer(model, comm, digits_dir / "train.ulfmds", digits_dir / "test.ulfmds", cfg)
    summary = trainer.fit()
    return summary, trainer.opt.checksum()


@pytest.mark.parametrize("model_cls", [MLP, DigitsCNN])
def test_training_bit_identical_to_plain_mpi(mpi_digits, model_cls):
    ft_summary, ft_sum = _train(FaultTolerantComm, mpi_digits, model_cls)
    plain_summary, plain_sum = _train(PlainComm, mpi_digits, model_cls)
    assert ft_summary["consistent"] and plain_summary["consistent"]
    assert ft_sum == plain_sum
    assert ft_summary["world_history"] == [MPI.COMM_WORLD.Get_size()]
    # and every rank ends with the same replica
    assert len(set(MPI.COMM_WORLD.allgather(ft_sum))) == 1


@pytest.fixture(scope="module")
def mpi_digits(tmp_path_factory):
    from ulfmtrain.data import digits_to_dataset

    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("d")) if MPI.COMM_WORLD.Get_rank() == 0 else None)
    if MPI.COMM_WORLD.Get_rank() == 0:
        digits_to_dataset(base)
    MPI.COMM_WORLD.Barrier()
    assert ShardedDataset(Path(base) / "train.ulfmds").count == 1437
    return Path(base)
