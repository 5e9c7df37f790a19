"""Run under mpirun --with-ft ulfm at 2 and 4 ranks (no failures): the FT path equals plain MPI."""
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from ulfmtrain import _ftcoll
from ulfmtrain.data.format import DatasetFile
from ulfmtrain.training.models import MLP, DigitsCNN
from ulfmtrain.training.trainer import TrainConfig, Trainer
from ulfmtrain.transport.comm import FaultTolerantComm, PlainComm
from ulfmtrain.transport.handles import retire

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def comm():
    """A communicator of its own for each test, kept, not freed, as ulfmtrain keeps its own (handles.retire):
    Open MPI 5.0.11 gives a freed context id to the next communicator and keys its agreements by that id, so an
    agree run on one of these could meet a later test's communicator.  (Suspected, not shown: once in four full
    runs, with the fixture freeing it, ranks got MPI_ERR_REVOKED in the last test's plain run.)"""
    c = MPI.COMM_WORLD.Dup()
    c.Set_errhandler(MPI.ERRORS_RETURN)
    yield c
    retire(c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_ft_allreduce_equals_plain(comm, dtype, n):
    rng = np.random.default_rng(comm.Get_rank() * 7919 + n)
    send = (rng.standard_normal(n) * 100).astype(dtype)
    ours, plain = np.empty_like(send), np.empty_like(send)
    status = _ftcoll.allreduce_try(comm, send, ours, MPI.SUM)
    comm.Allreduce(send, plain, op=MPI.SUM)
    assert status == _ftcoll.OK
    assert np.array_equal(ours, plain)      # bit for bit: the same reduction


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_reduction_and_broadcast_equal_one_call(comm, chunk):
    """The 64-bit count path: a reduction sent in pieces (as one over 2**31 elements is) equals one call."""
    send = np.arange(1000, dtype=np.float64) * (comm.Get_rank() + 1)
    ours, plain = np.empty_like(send), np.empty_like(send)
    comm.Allreduce(send, plain, op=MPI.SUM)
    _ftcoll.set_max_chunk(chunk)
    try:
        assert _ftcoll.allreduce_try(comm, send, ours, MPI.SUM) == _ftcoll.OK
        buf = send.copy() if comm.Get_rank() == 0 else np.zeros_like(send)
        assert _ftcoll.bcast_try(comm, buf, 0) == _ftcoll.OK
        # Point to point (the hand-over): the last rank receives rank 0's array in pieces.
        last, got = comm.Get_size() - 1, np.zeros_like(send)
        if comm.Get_rank() == 0:
            assert _ftcoll.send_try(comm, send, last, 7) == _ftcoll.OK
        if comm.Get_rank() == last:
            assert _ftcoll.recv_try(comm, got, 0, 7) == _ftcoll.OK
            assert np.array_equal(got, np.arange(1000, dtype=np.float64))
    finally:
        _ftcoll.set_max_chunk(2**31 - 1)
    assert np.array_equal(ours, plain) and np.array_equal(buf, np.arange(1000, dtype=np.float64))


def test_ft_allreduce_max_and_agree(comm):
    send = np.array([comm.Get_rank()], dtype=np.int64)
    out = np.empty_like(send)
    assert _ftcoll.allreduce_try(comm, send, out, MPI.MAX) == _ftcoll.OK
    assert out[0] == comm.Get_size() - 1
    flag, status = _ftcoll.agree(comm, 0b1110 | (comm.Get_rank() == 0))
    assert status == _ftcoll.OK and flag == (0b1111 if comm.Get_size() == 1 else 0b1110)


def test_buffers_are_checked(comm):
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="distinct"):
        _ftcoll.allreduce_try(comm, a, a, MPI.SUM)
    with pytest.raises(ValueError, match="same size"):
        _ftcoll.allreduce_try(comm, a, np.zeros(5, np.float32), MPI.SUM)


def test_transaction_commits_once_and_bcast_takes_the_lowest_rank():
    ft = FaultTolerantComm()
    commits = []
    assert ft.transaction(lambda n: n, commits.append) == 0 and commits == [0]
    got = ft.bcast_obj(lambda: {"from": ft.rank, "big": b"x" * (3 << 20)})   # multi-MB goes as buffers
    assert got["from"] == 0 and len(got["big"]) == 3 << 20


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
    from ulfmtrain.data.sources import digits_to_dataset

    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("d")) if MPI.COMM_WORLD.Get_rank() == 0 else None)
    if MPI.COMM_WORLD.Get_rank() == 0:
        digits_to_dataset(base)
    MPI.COMM_WORLD.Barrier()
    assert DatasetFile(Path(base) / "train.ulfmds").count == 1437
    return Path(base)
