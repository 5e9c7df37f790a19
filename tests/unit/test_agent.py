"""Unit tests for the agent launch's pure parts: rank placement, the rank's remote command, its hang rows."""
import json
import shlex

import pytest

from ulfmtrain.launching.agent import PLAN_ENV, rank_command
from ulfmtrain.launching.launch import agent_prefix, rank_hosts
from ulfmtrain.transport.link import SECRET_ENV


def test_ranks_fill_hosts_slot_by_slot(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=3  # big one\n\nnode3\n")
    assert rank_hosts(str(hostfile), 6) == ["node1", "node1", "node2", "node2", "node2", "node3"]
    assert rank_hosts(str(hostfile), 2) == ["node1", "node1"]
    with pytest.raises(ValueError, match="6 slots for 7 ranks"):
        rank_hosts(str(hostfile), 7)


def test_rank_command_forwards_the_environment_and_the_true_locality():
    plan = {"rsh": ["ssh", "-q"], "hosts": ["a", "a", "b", "b"], "keepalive": 3.0}
    env = {"PMIX_RANK": "3", "OMPI_MCA_x": "1 2", "HOME": "/home/someone", PLAN_ENV: json.dumps(plan),
           SECRET_ENV: "5e" * 32}
    cmd = rank_command(plan, 3, ["python", "-m", "ulfmtrain", "train"], env)
    assert cmd[0] == "ssh" and cmd[-3:-1] == ["-q", "b"] and "ServerAliveInterval=1" in cmd
    remote = shlex.split(cmd[-1])
    assert remote[0] == "env" and remote[-4:] == ["python", "-m", "ulfmtrain", "train"]
    assigned = dict(x.split("=", 1) for x in remote[1:-4])
    assert assigned["OMPI_MCA_x"] == "1 2" and assigned["PMIX_RANK"] == "3"     # quoting survives the shell
    assert assigned["ULFMTRAIN_LOCAL_RANK"] == "1" and assigned["ULFMTRAIN_LOCAL_SIZE"] == "2"
    assert "HOME" not in assigned and PLAN_ENV not in assigned
    assert SECRET_ENV not in assigned and "5e" * 32 not in " ".join(cmd)     # ps shows command lines


def test_agent_launch_keeps_shared_memory_and_han_off(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    cmd, env = agent_prefix(4, str(hostfile), "ssh", "10.0.0.0/24", "/opt/ulfm/agent")
    line = " ".join(cmd)
    for part in ("--with-ft ulfm", "--mca btl tcp,self", "--mca coll ^han", "odls_base_exec_agent /opt/ulfm/agent",
                 "ptl_tcp_if_include 10.0.0.0/24", "pmix_remote_connections 1"):
        assert part in line, part
    assert json.loads(env[PLAN_ENV])["hosts"] == ["a", "a", "b", "b"]
    # A new secret for each job, in the agents' environment: mpirun's command line names it only.
    assert len(env[SECRET_ENV]) == 64 and env[SECRET_ENV] not in line and f"-x {SECRET_ENV}" in line
    assert env[SECRET_ENV] != agent_prefix(4, str(hostfile), "ssh", "10.0.0.0/24", "/opt/ulfm/agent")[1][SECRET_ENV]


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
    w.handlers["u"]("90")                  # the tether's messages, past the link's check (test_link.py)
    w.handlers["h"](json.dumps(row))
    (written,) = boards.Board(str(tmp_path)).rows()
    assert (written["pid"], written["host"], written["cpu_now"]) == (os.getpid(), socket.gethostname(), 100)
    assert abs(written["mono"] - time.monotonic()) < 5 and written["state"] == "wait"
    w.handlers["u"]("250")
    (again,) = boards.Board(str(tmp_path)).rows()
    assert again["cpu_now"] == 250 and again["mono"] == written["mono"]
