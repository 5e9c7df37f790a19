"""torchrun's variables (launch) and DistributedDataParallel on the default group connect() makes (training/ddp.py),
in one process with a fake communicator: pure logic, never proof that recovery works (tests/examples/test_ddp.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ulfmtrain.core.refusal import Refused
from ulfmtrain.launching.launch import mpirun_command, mpirun_head, torchrun_env, torchrun_warning
from ulfmtrain.training import ddp
from ulfmtrain.training.optim import DistributedOptimizer


def exported(prefix: list[str], env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run([*prefix, sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    import json

    return json.loads(out)


def test_each_rank_gets_torchruns_variables_from_mpiruns():
    mpi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PATH": "/usr/bin:/bin"}
    got = exported(torchrun_env(8, "node0", {}), mpi)
    assert {k: got[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == \
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}
    assert 0 < int(got["MASTER_PORT"]) < 65536


def test_under_the_agent_the_true_locality_wins_and_a_users_master_is_kept():
    """The agent launch: Open MPI believes every rank is on the head; the agent says where it is."""
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "ULFMTRAIN_LOCAL_RANK": "1", "ULFMTRAIN_LOCAL_SIZE": "2", "PATH": "/usr/bin:/bin"}
    got = exported(torchrun_env(4, "10.0.0.1", {"MASTER_ADDR": "head", "MASTER_PORT": "29500"}), mpi)
    assert (got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"], got["MASTER_ADDR"], got["MASTER_PORT"]) == \
        ("1", "2", "head", "29500")


def test_the_prefix_goes_before_the_ranks_program_and_a_fork_servers_shim():
    """The shim hands the fork server its environment: the variables are set before it runs."""
    prefix = torchrun_env(2, "h", {})
    cmd = mpirun_command(2, ["python", "x.py"], cores=8, torchrun=prefix)
    at = cmd.index(prefix[0], len(mpirun_head()))          # (mpirun itself starts through a shell too)
    assert cmd[at:at + len(prefix)] == prefix and cmd[at + len(prefix)] == sys.executable
    assert cmd[-2:] == [sys.executable, "x.py"]


def test_a_script_with_its_own_process_group_and_no_ulfmtrain_is_warned_about(tmp_path):
    plain, ours = tmp_path / "plain.py", tmp_path / "ours.py"
    plain.write_text('"""Runs under ulfmtrain launch."""\nimport torch.distributed as dist\n'
                     'dist.init_process_group("gloo")\n')
    ours.write_text("import ulfmtrain\ncomm = ulfmtrain.connect()\n# dist.init_process_group( no more\n")
    assert "without fault tolerance" in torchrun_warning(["python", str(plain)])
    assert torchrun_warning(["python", str(ours)]) is None
    assert torchrun_warning(["train", "--data", "d"]) is None


@pytest.fixture
def group(fake_comm):
    comm = fake_comm()
    sampler_init, hook = torch.utils.data.distributed.DistributedSampler.__init__, sys.excepthook
    ddp.init_default_group(comm)
    # torch's prefixing hook would capture the exit protocol's traceback and then the rank dies unheard.
    assert sys.excepthook is hook
    yield comm
    dist.destroy_process_group()
    torch.utils.data.distributed.DistributedSampler.__init__ = sampler_init


def test_the_default_group_is_the_communicators(group, capsys):
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 3, "ulfmtrain")
    group.size = 2                                   # a shrink: the group follows
    assert dist.get_world_size() == 2
    t = torch.tensor([1.0, 2.0])
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 4.0] and group.sent == [2]
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [2.0, 4.0]
    dist.barrier()
    assert group.barriers == 1
    with pytest.raises(Refused):
        dist.broadcast(t, src=0)
    assert "torch.distributed.broadcast in a fault-tolerant job" in capsys.readouterr().err
    with pytest.raises(Refused) as refused:
        torch.utils.data.distributed.DistributedSampler(list(range(10)))
    assert refused.value.code == 2 and "ExactlyOnceSampler" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True}])
def test_an_adopted_ddp_module_leaves_the_reduction_to_the_optimizer(group, kwargs):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)),
                **kwargs)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group, model=model, bucket_bytes=64)
    assert opt.overlap is not None                   # DDP's semantics: the mean when backward returns
    assert not model.require_backward_grad_sync and model.no_sync == opt.no_sync
    x = torch.randn(6, 4)
    with model.no_sync():                            # accumulates: nothing reduced
        model(x).sum().backward()
    assert group.sent == []
    local = [g.clone() for g in torch.autograd.grad(model(x).sum(), list(model.parameters()))]
    model(x).sum().backward()                        # the last micro-batch: reduced inside backward
    assert group.sent and opt.step_count == 1
    for p, g in zip(model.parameters(), local):      # size x (2 micro-batches) / size: the accumulated sum
        torch.testing.assert_close(p.grad, 2 * g)
    opt.step()
    opt.close()


def test_a_static_graph_is_refused_at_the_optimizer(group, capsys):
    model = DDP(torch.nn.Linear(4, 2), static_graph=True)
    with pytest.raises(Refused) as refused:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group, model=model)
    assert refused.value.code == 2 and "static_graph=True" in capsys.readouterr().err


def test_a_ddp_module_the_optimizer_never_saw_is_refused_at_its_backward(group, capsys):
    model = DDP(torch.nn.Linear(4, 2))
    with pytest.raises(Refused):
        model(torch.randn(3, 4)).sum().backward()
    assert "DistributedOptimizer(opt, comm, model=ddp_model)" in capsys.readouterr().err
