"""The keep-alive link of the agent launch, without MPI: agent.py on this host, its "remote shell" a local sh.

Each test runs the agent as PRRTE would (a file, PMIX_RANK set) on loopback and checks how it ends:
with the rank's status, or by SIGKILL when the rank or its host is lost; and what it answers a repair.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulfmtrain.launching import agent as agent_mod
from ulfmtrain.launching.agent import PLAN_ENV, agent_alive, lock_path
from ulfmtrain.launching.launch import ssh_keepalive

pytestmark = pytest.mark.timeout(60)
AGENT = Path(agent_mod.__file__)
TETHER = AGENT.parent.parent / "transport" / "tether.py"
KEEPALIVE = 1.0


def start(tmp_path: Path, rank_code: str, rank: int = 0) -> subprocess.Popen:
    """The agent of `rank`, whose rank runs rank_code in Python under its tether."""
    rsh = tmp_path / "rsh"
    rsh.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')      # "ssh HOST CMD" on this host
    rsh.chmod(0o755)
    plan = {"rsh": [str(rsh)], "hosts": ["127.0.0.1"] * 8, "net": "127.0.0.0/8", "keepalive": KEEPALIVE,
            "tether": [sys.executable, "-P", str(TETHER)], "dir": str(tmp_path)}
    env = {**os.environ, PLAN_ENV: json.dumps(plan), "PMIX_RANK": str(rank)}
    return subprocess.Popen([sys.executable, "-P", str(AGENT), sys.executable, "-c", rank_code], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def end(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
    """The agent's status and output; whatever it left running (a frozen tether, its rank) is killed."""
    try:
        proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # the agent's session: its shell, tether and rank
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=10)
    return proc.returncode, out, err


def gone(pattern: str, timeout: float) -> bool:
    """No process whose command line holds pattern, within timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 1:
            return True
        time.sleep(0.05)
    return False


def test_the_agent_exits_with_the_rank_status(tmp_path):
    rc, out, err = end(start(tmp_path, "print('hello'); raise SystemExit(3)"))
    assert (rc, out) == (3, "hello\n"), err


def test_a_rank_killed_by_a_signal_kills_its_agent_by_sigkill(tmp_path):
    rc, _, err = end(start(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert rc == -signal.SIGKILL and "killed by a signal" in err, err


def test_a_silent_host_is_dropped_after_the_keepalive(tmp_path):
    """The tether frozen (a frozen host, or a cut link): its agent dies by SIGKILL within the bound."""
    flag = tmp_path / "started"
    proc = start(tmp_path, f"import os, time; open({str(flag)!r}, 'w').close(); os.kill(os.getppid(), 19); "
                           "time.sleep(60)")
    t0 = time.monotonic()
    while not flag.exists() and time.monotonic() - t0 < 20:
        time.sleep(0.02)
    t_stop = time.monotonic()
    rc, _, err = end(proc)
    took = time.monotonic() - t_stop
    assert rc == -signal.SIGKILL and f"no keep-alive for {KEEPALIVE:g} s" in err, err
    assert KEEPALIVE * 2 / 3 - 0.1 < took < KEEPALIVE + 2, took


def test_a_lost_head_stops_the_rank_with_one_line(tmp_path):
    """The agent gone (the head lost): the tether kills the rank and says so, once."""
    flag = tmp_path / "started"
    proc = start(tmp_path, f"import time; open({str(flag)!r}, 'w').close(); time.sleep(60)")
    t0 = time.monotonic()
    while not flag.exists() and time.monotonic() - t0 < 20:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)               # the agent, as if the head died
    stopped = gone(str(flag), 10)                    # the rank (asleep for 60 s) is killed by its tether
    time.sleep(0.2)
    _, _, err = end(proc)                            # the tether's stderr is the agent's: still ours
    lines = [x for x in err.splitlines() if "stopped:" in x]
    assert stopped and len(lines) == 1 and "only the side that reaches the head node goes on" in lines[0], err


GATE = """
import sys
sys.path.insert(0, {here!r})
import tether
print(tether.confirm([1]), tether.confirm([2]), sep="|", flush=True)
"""


def test_a_repair_is_confirmed_only_if_the_removed_ranks_are_dead_at_the_head(tmp_path):
    """Rank 1's agent is dead (no lock held), rank 2's lives (its lock held here): ok for 1, no for 2."""
    fd = os.open(lock_path(str(tmp_path), 2), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert agent_alive(str(tmp_path), 2) and not agent_alive(str(tmp_path), 1)
    t0 = time.monotonic()
    rc, out, err = end(start(tmp_path, GATE.format(here=str(TETHER.parent))))
    os.close(fd)
    assert rc == 0 and out.split("|") == ["(True, '')", "(False, \"the head node still counts rank(s) 2 that "
                                                           "this side's repair removed\")\n"], (out, err)
    assert time.monotonic() - t0 >= KEEPALIVE                  # it waited the bound for rank 2 to die


def test_ssh_gets_keepalives_within_the_bound():
    cmd = ssh_keepalive(["ssh", "-q"], 10)
    assert cmd[0] == "ssh" and cmd[-1] == "-q"
    opts = dict(x.split("=") for x in cmd[1:-1] if "=" in x)
    assert int(opts["ServerAliveInterval"]) * int(opts["ServerAliveCountMax"]) <= 10
    assert ssh_keepalive(["/usr/bin/ip", "netns", "exec"], 10) == ["/usr/bin/ip", "netns", "exec"]


@pytest.mark.parametrize("args, message", [
    (["--keepalive", "0"], "--keepalive 0.0: give a positive number of seconds"),
    (["--keepalive", "nan"], "--keepalive nan: give a positive number of seconds"),
    (["--net", "10.0.0.0/33"], "--net '10.0.0.0/33' is not a network in CIDR form"),
])
def test_bad_agent_options_are_named(tmp_path, capsys, args, message):
    from ulfmtrain.cli import main

    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n")
    opts = {"--net": "10.0.0.0/24", "--keepalive": "5"}
    opts.update(zip(args[::2], args[1::2]))
    argv = ["launch", "-n", "2", "--hostfile", str(hostfile), "--agent", "ssh",
            *[x for kv in opts.items() for x in kv], "--", "train"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_keepalive_needs_the_agent_launch(capsys):
    from ulfmtrain.cli import main

    assert main(["launch", "-n", "2", "--keepalive", "5", "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "--keepalive bounds the agent launch's detection of a silent host: add --agent RSH" in err


@pytest.mark.parametrize("path", [AGENT, TETHER])
def test_agent_and_tether_import_the_standard_library_only(path):
    """PRRTE starts them by path in a process with PMIX_RANK set: importing ulfmtrain (or mpi4py) there
    would initialize MPI in them, a second PMIx client for the rank."""
    import ast

    tree = ast.parse(path.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative and names <= set(sys.stdlib_module_names) | {"__future__"}, (names, relative)


def test_the_remote_command_runs_the_rank_under_its_tether():
    import shlex

    from ulfmtrain.launching.agent import rank_command

    plan = {"rsh": ["ssh"], "hosts": ["a", "b"], "keepalive": 4.0, "tether": ["py", "-P", "/x/tether.py"]}
    remote = shlex.split(rank_command(plan, 1, ["py", "-m", "ulfmtrain", "train"], {}, head="10.0.0.1:5000")[2])
    i = remote.index("/x/tether.py")
    assert remote[i - 2:] == ["py", "-P", "/x/tether.py", "py", "-m", "ulfmtrain", "train"]
    env = dict(x.split("=", 1) for x in remote[1:i - 2])
    assert env["ULFMTRAIN_HEAD"] == "10.0.0.1:5000" and env["ULFMTRAIN_KEEPALIVE"] == "4.0"
