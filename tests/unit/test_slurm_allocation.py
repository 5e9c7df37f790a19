"""Slurm's host-list and task-count syntax, and what launch and supervise take from an allocation (no Slurm
needed: tests/slurm runs the real thing)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ulfmtrain.launching import slurm
from ulfmtrain.launching.slurm import Allocation, SlurmError, expand_counts, expand_hostlist


@pytest.mark.parametrize("text,names", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("gpu[1-2],cpu[3],login", ["gpu1", "gpu2", "cpu3", "login"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a-b.c[5]", ["a-b.c5"]),
])
def test_host_lists_expand_as_slurm_does(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["node[01-04,07]", "u1n[01-03],x[7,9-10]", "r[1-2]n[3-4]"])
def test_host_lists_expand_like_scontrol_show_hostnames(text, tmp_path):
    """The same answer as Slurm's own expansion, where Slurm's client is installed (it reads a configuration
    first: a minimal one, no controller needed)."""
    if not shutil.which("scontrol"):
        pytest.skip("scontrol is not installed")
    ours = expand_hostlist(text)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=unit\nSlurmctldHost=localhost\n")
    theirs = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "SLURM_CONF": str(conf)})
    if theirs.returncode != 0:
        pytest.skip(f"scontrol show hostnames failed here: {theirs.stderr.strip()}")
    assert ours == theirs.stdout.split()


@pytest.mark.parametrize("text", ["node[01-", "node]", "n[a-b]", "n[5-2]", "", "n[1-2]]"])
def test_a_bad_host_list_is_one_clear_error(text):
    with pytest.raises(SlurmError, match="node list"):
        expand_hostlist(text)


@pytest.mark.parametrize("text,counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]),
                                         ("8(x2)", [8, 8])])
def test_task_counts_expand(text, counts):
    assert expand_counts(text) == counts


def test_a_bad_task_count_is_one_clear_error():
    with pytest.raises(SlurmError, match=r"task counts '2\(3\)'"):
        expand_counts("2(3)")


def env(nodes: str = "n[01-03]", tasks: str = "2(x2),1", job: str = "42") -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": tasks}


def test_the_allocation_comes_from_the_environment():
    assert Allocation.from_env({}) is None
    alloc = Allocation.from_env(env())
    assert alloc == Allocation("42", ("n01", "n02", "n03"), (2, 2, 1))
    assert alloc.hostfile() == "n01 slots=2\nn02 slots=2\nn03 slots=1\n"
    assert alloc.hostfile(exclude={"n02"}) == "n01 slots=2\nn03 slots=1\n"
    with pytest.raises(SlurmError, match="3 nodes .* but 2 task counts"):
        Allocation.from_env(env(tasks="2,1"))


def test_ranks_fill_the_slots_and_the_spares_take_the_last():
    alloc = Allocation.from_env(env())
    assert alloc.ranks(None, 0) == 5
    assert alloc.ranks(None, 1) == 4          # 4 training ranks, the spare on n03's one slot
    assert alloc.ranks(3, 2) == 3
    with pytest.raises(SlurmError, match="5 task slots on 3 node.*not enough for 5 rank.*and 1 spare"):
        alloc.ranks(5, 1)


def test_resolve_writes_the_allocations_hostfile(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "config", lambda: {"TaskPlugin": "task/affinity", "SlurmdPort": "7000"})
    monkeypatch.setattr(slurm, "network_to", lambda nodes: f"net to {','.join(nodes)}")
    plan = slurm.resolve(None, 1, None, None, None, str(tmp_path), env())
    assert (plan.ranks, plan.rsh, plan.mpirun_args, plan.net) == (4, None, [], None)
    assert plan.hostfile is not None and open(plan.hostfile).read() == "n01 slots=2\nn02 slots=2\nn03 slots=1\n"
    plan = slurm.resolve(2, 0, None, "slurm", None, str(tmp_path), env())
    assert plan.ranks == 2 and plan.rsh is not None and plan.rsh.endswith("slurm.py --cpu-bind=none")
    assert plan.mpirun_args == list(slurm.AGENT_MPIRUN_ARGS)   # one PRRTE daemon, on the head: not Slurm's launcher
    assert plan.net == "net to n01,n02,n03"                    # an agent's --net found, unless given
    assert slurm.resolve(2, 0, None, "slurm", "10.1.0.0/16", str(tmp_path), env()).net == "10.1.0.0/16"
    # A hostfile given by hand wins; outside Slurm nothing changes.
    assert slurm.resolve(3, 0, "hosts", None, None, str(tmp_path), env()) == slurm.LaunchPlan(3, "hosts", None, [],
                                                                                                None)
    assert slurm.resolve(3, 0, None, "ssh", "N", str(tmp_path), {}) == slurm.LaunchPlan(3, None, "ssh", [], "N")


def test_the_network_to_the_nodes_is_this_hosts_on_their_route():
    """127.0.0.1 is reached from lo's 127.0.0.1/8 (where `ip` is installed)."""
    if not shutil.which("ip"):
        pytest.skip("iproute2 is not installed")
    assert slurm.network_to(["127.0.0.1"]) == "127.0.0.0/8"


def test_resolve_refuses_what_cannot_run(tmp_path):
    with pytest.raises(SlurmError, match="--agent slurm starts each rank with srun: run launch inside sbatch"):
        slurm.resolve(2, 0, "hosts", "slurm", None, str(tmp_path), {})
    with pytest.raises(SlurmError, match="needs -n N"):
        slurm.resolve(None, 0, None, None, None, str(tmp_path), {})


def test_srun_options_follow_the_task_plugin():
    assert slurm.srun_options({"TaskPlugin": "task/none"}) == []
    assert slurm.srun_options({"TaskPlugin": "task/affinity,task/cgroup"}) == ["--cpu-bind=none"]
    cmd = slurm.srun_command("n07", ["--cpu-bind=none"])
    assert cmd[:7] == ["srun", "--overlap", "-N1", "-n1", "-w", "n07", "--no-kill"] and "--mpi=none" in cmd


def test_a_refused_slurmd_means_down():
    """Unlike the ssh probe, a node whose slurmd refuses cannot start a step: it counts as down."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]             # bound, not listening: connections are refused
        assert not slurm.node_is_up("127.0.0.1", port, 1.0)
        s.listen()
        assert slurm.node_is_up("127.0.0.1", port, 1.0)


def test_a_lost_node_stays_excluded(monkeypatch):
    alloc = Allocation.from_env(env())
    monkeypatch.setattr(slurm, "down_in_slurm", lambda nodes: {"n03"} & set(nodes))
    excluded: set[str] = set()
    up = {"n01": True, "n02": False, "n03": True}
    assert slurm.live_nodes(alloc, excluded, up.__getitem__) == (["n01"], ["n02", "n03"])
    up["n02"] = True                          # it answers again: still out for this job
    assert slurm.live_nodes(alloc, excluded, up.__getitem__) == (["n01"], [])
    assert excluded == {"n02", "n03"}


def test_launch_without_n_outside_slurm_is_one_line(capsys, monkeypatch):
    from ulfmtrain.cli import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["launch", "--", "train", "--data", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["ulfmtrain: error: launch needs -n N (the number of training ranks) outside "
                                        "a Slurm allocation"]
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    assert main(["launch", "-n", "2", "--spares", "1", "--", "train", "--data", "nowhere"]) == 2
    assert "has 2 task slots on 2 node(s), not enough for 2 rank(s) and 1 spare(s)" in capsys.readouterr().err
