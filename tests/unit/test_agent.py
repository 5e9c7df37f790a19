"""Unit tests for the agent launch's pure parts: rank placement, the rank's remote command, its hang rows."""
import json
import shlex

import pytest

from ulfmtrain.launching.agent import PLAN_ENV, rank_command
from ulfmtrain.launching.launch import agent_prefix, rank_hosts


def test_ranks_fill_hosts_slot_by_slot(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=3  # big one\n\nnode3\n")
    assert rank_hosts(str(hostfile), 6) == ["node1", "node1", "node2", "node2", "node2", "node3"]
    assert rank_hosts(str(hostfile), 2) == ["node1", "node1"]
    with pytest.raises(ValueError, match="6 slots for 7 ranks"):
        rank_hosts(str(hostfile), 7)


def test_rank_command_forwards_the_environment_and_the_true_locality():
    plan = {"rsh": ["ssh", "-o", "ServerAliveInterval=1"], "hosts": ["a", "a", "b", "b"]}
    env = {"PMIX_RANK": "3", "OMPI_MCA_x": "1 2", "HOME": "/home/someone", PLAN_ENV: json.dumps(plan)}
    cmd = rank_command(plan, 3, ["python", "-m", "ulfmtrain", "train"], env)
    assert cmd[:4] == ["ssh", "-o", "ServerAliveInterval=1", "b"]
    remote = shlex.split(cmd[4])
    assert remote[0] == "env" and remote[-4:] == ["python", "-m", "ulfmtrain", "train"]
    assigned = dict(x.split("=", 1) for x in remote[1:-4])
    assert assigned["OMPI_MCA_x"] == "1 2" and assigned["PMIX_RANK"] == "3"     # quoting survives the shell
    assert assigned["ULFMTRAIN_LOCAL_RANK"] == "1" and assigned["ULFMTRAIN_LOCAL_SIZE"] == "2"
    assert "HOME" not in assigned and PLAN_ENV not in assigned


def test_agent_launch_keeps_shared_memory_and_han_off(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    cmd, env = agent_prefix(4, str(hostfile), "ssh", "10.0.0.0/24", "/opt/ulfm/agent")
    line = " ".join(cmd)
    for part in ("--with-ft ulfm", "--mca btl tcp,self", "--mca coll ^han", "odls_base_exec_agent /opt/ulfm/agent",
                 "ptl_tcp_if_include 10.0.0.0/24", "pmix_remote_connections 1"):
        assert part in line, part
    assert json.loads(env[PLAN_ENV])["hosts"] == ["a", "a", "b", "b"]


def test_the_agent_writes_its_ranks_hang_rows_as_its_own(tmp_path):
    """A rank's hang watch row ("h", through its tether) goes on the head's board with the agent's pid, host and
    clock (killing the agent is how the rank dies for Open MPI); its CPU time ("u") updates the row, never its
    heartbeat: a rank that runs without writing is not frozen."""
    import os
    import socket
    import time

    from ulfmtrain.launching import agent
    from ulfmtrain.transport import board as boards

    w = agent.Watch({"hosts": ["b"], "keepalive": 3.0, "dir": str(tmp_path)}, 0)
    row = {"pid": 4242, "start": 7, "host": "b", "rank": 0, "role": "member", "mono": 1.0, "cpu": 100,
           "state": "wait", "for": 0.5, "bound": 3.0}
    w.feed(b"u 90\nh " + json.dumps(row).encode() + b"\n")
    (written,) = boards.Board(str(tmp_path)).rows()
    assert (written["pid"], written["host"], written["cpu_now"]) == (os.getpid(), socket.gethostname(), 100)
    assert abs(written["mono"] - time.monotonic()) < 5 and written["state"] == "wait"
    w.feed(b"u 250\n")
    (again,) = boards.Board(str(tmp_path)).rows()
    assert again["cpu_now"] == 250 and again["mono"] == written["mono"]
