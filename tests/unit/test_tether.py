"""The keep-alive link of the agent launch, without MPI: agent.py on this host, its "remote shell" a local sh.

Each test runs the agent as PRRTE would (a file, PMIX_RANK set) on loopback and checks how it ends:
with the rank's status, or by SIGKILL when the rank or its host is lost; and what it answers a repair.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulfmtrain.launching import agent as agent_mod
from ulfmtrain.launching.agent import PLAN_ENV, agent_alive, lock_path, remote_shell

pytestmark = pytest.mark.timeout(60)
AGENT = Path(agent_mod.__file__)
TETHER = AGENT.parent.parent / "transport" / "tether.py"
KEEPALIVE = 1.0


SECRET = "5e" * 32


def start(tmp_path: Path, rank_code: str, rank: int = 0, *, rsh_script: str = 'exec sh -c "$*"',
          keepalive: float = KEEPALIVE, wdir: str = "") -> subprocess.Popen:
    """The agent of `rank`, whose rank runs rank_code in Python under its tether; rsh_script is the body of its
    "ssh HOST CMD" (the host dropped: $1 is CMD), run on this host."""
    rsh = tmp_path / "rsh"
    rsh.write_text(f'#!/bin/sh\nshift\n{rsh_script}\n')
    rsh.chmod(0o755)
    plan = {"rsh": [str(rsh)], "hosts": ["127.0.0.1"] * 8, "net": "127.0.0.0/8", "keepalive": keepalive,
            "tether": [sys.executable, "-P", str(TETHER)], "dir": str(tmp_path), "wdir": wdir}
    env = {**os.environ, PLAN_ENV: json.dumps(plan), "PMIX_RANK": str(rank), "ULFMTRAIN_AGENT_SECRET": SECRET}
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


def seen(flag: Path, timeout: float = 20) -> float:
    """The monotonic time at which flag exists (the rank wrote it), polled every 20 ms."""
    t0 = time.monotonic()
    while not flag.exists() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return time.monotonic()


def running(pid: int) -> bool:
    """Process pid exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


FREEZE = "import os, time; open({flag!r}, 'w').close(); os.kill(os.getppid(), 19); time.sleep(60)"


def test_a_silent_host_is_dropped_after_the_keepalive(tmp_path):
    """The tether frozen (a frozen host, or a cut link): its agent dies by SIGKILL within the bound, and its
    remote shell with it (an ssh client to a silent host held mpirun's output pipes until it gave up)."""
    flag, shell = tmp_path / "started", tmp_path / "shell.pid"
    proc = start(tmp_path, FREEZE.format(flag=str(flag)), rsh_script=f'echo $$ > {shell}; exec sh -c "$*"')
    t_stop = seen(flag)
    try:
        proc.wait(timeout=30)
        took = time.monotonic() - t_stop
        time.sleep(0.3)
        shell_left = running(int(shell.read_text()))
    finally:
        rc, _, err = end(proc)
    assert rc == -signal.SIGKILL and f"no keep-alive for {KEEPALIVE:g} s" in err, err
    assert KEEPALIVE * 2 / 3 - 0.1 < took < KEEPALIVE + 2, took
    assert not shell_left, "the remote shell outlived its agent"


def test_a_remote_shell_that_gives_up_first_does_not_stretch_the_bound(tmp_path):
    """ssh gives up on a silent host before the agent's keep-alive deadline: the agent waits a moment for the
    tether's report, but never past that deadline (it waited a fixed second more: 10.6-10.9 s at --keepalive
    10)."""
    keepalive = 3.0
    flag = tmp_path / "started"
    gives_up = (f'exec 3<&0; sh -c "$*" <&3 & i=0; while [ ! -e {flag} ] && [ $i -lt 1000 ]; do sleep 0.02; '
                f'i=$((i + 1)); done; sleep {keepalive - 0.3}; exit 255')
    proc = start(tmp_path, FREEZE.format(flag=str(flag)), rsh_script=gives_up, keepalive=keepalive)
    t_stop = seen(flag)
    rc, _, err = end(proc)
    took = time.monotonic() - t_stop
    assert rc == -signal.SIGKILL and "its remote shell ended with status 255" in err, err
    assert keepalive - 0.4 < took < keepalive + 0.5, took


def test_a_lost_head_stops_the_rank_with_one_line(tmp_path, monkeypatch):
    """The agent gone (the head lost): the tether kills the rank and says so, once, on stderr and in the host's
    own log (a cut-off host's stderr goes nowhere)."""
    flag, host_log = tmp_path / "started", tmp_path / "host.log"
    monkeypatch.setenv("ULFMTRAIN_HOST_LOG", str(host_log))
    proc = start(tmp_path, f"import time; open({str(flag)!r}, 'w').close(); time.sleep(60)")
    seen(flag)
    os.kill(proc.pid, signal.SIGKILL)               # the agent, as if the head died
    stopped = gone(str(flag), 10)                    # the rank (asleep for 60 s) is killed by its tether
    time.sleep(0.2)
    _, _, err = end(proc)                            # the tether's stderr is the agent's: still ours
    lines = [x for x in err.splitlines() if "stopped:" in x]
    assert stopped and len(lines) == 1 and "only the side that reaches the head node goes on" in lines[0], err
    logged = host_log.read_text().splitlines() if host_log.exists() else []
    assert len(logged) == 1 and logged[0].endswith(lines[0]), logged


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
    cmd = remote_shell(["ssh", "-q"], 10)
    assert cmd[0] == "ssh" and cmd[-1] == "-q"
    opts = dict(x.split("=") for x in cmd[1:-1] if "=" in x)
    assert int(opts["ServerAliveInterval"]) * int(opts["ServerAliveCountMax"]) <= 10
    assert remote_shell(["/usr/bin/ip", "netns", "exec"], 10) == ["/usr/bin/ip", "netns", "exec"]


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


@pytest.mark.parametrize("path", [AGENT, TETHER, TETHER.with_name("link.py"),
                                  TETHER.parent.parent / "core" / "userdir.py"])
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
    remote = shlex.split(rank_command(plan, 1, ["py", "-m", "ulfmtrain", "train"], {}, head="10.0.0.1:5000")[-1])
    i = remote.index("/x/tether.py")
    assert remote[i - 2:] == ["py", "-P", "/x/tether.py", "py", "-m", "ulfmtrain", "train"]
    env = dict(x.split("=", 1) for x in remote[1:i - 2])
    assert env["ULFMTRAIN_HEAD"] == "10.0.0.1:5000" and env["ULFMTRAIN_KEEPALIVE"] == "4.0"


def listening_port(pid: int, timeout: float = 20) -> int:
    """The TCP port process pid listens on (the agent's keep-alive port), from /proc."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
            for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:         # LISTEN, one of its sockets
                    return int(f[1].split(":")[1], 16)
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never listened")


def test_strangers_on_the_keepalive_port_are_dropped_and_the_rank_runs_on(tmp_path):
    """The review's attack: strangers connect to the agent's port before the tether (which starts late here, as
    over a slow ssh) and say what a tether would (`k`: the rank was killed), or what it never would.  Each is
    dropped with one line, and the rank runs to its own end; before, `k` had the agent declare the rank dead
    and `x notanumber` crashed the agent with status 1."""
    import socket

    proc = start(tmp_path, "import time; time.sleep(0.5); print('done'); raise SystemExit(3)",
                 rsh_script='sleep 1; exec sh -c "$*"')
    port = listening_port(proc.pid)
    strangers = []
    for says in (b"k\n", b"x notanumber\n", b"c 1\n" + b"\xff" * 3000, b""):   # b"": connected, silent
        strangers.append(socket.create_connection(("127.0.0.1", port)))
        strangers[-1].sendall(says)
    try:
        rc, out, err = end(proc)
    finally:
        for s in strangers:
            s.close()
    assert (rc, out) == (3, "done\n"), err
    lines = [x for x in err.splitlines() if "dropped a connection from 127.0.0.1" in x]
    assert len(lines) == 4 and err.count("\n") == 4, err
    assert sum("not a ulfmtrain tether" in x for x in lines) == 3 and "when the rank's tether did" in lines[-1], err


def test_the_job_secret_is_on_no_command_line(tmp_path):
    """ps shows every process's command line to every user: the secret travels in the environment (the agent's)
    and on the remote shell's standard input (the tether's), and the rank never holds it."""
    flag = tmp_path / "started"
    proc = start(tmp_path, f"import os, time; open({str(flag)!r}, 'w').write(os.environ.get("
                           "'ULFMTRAIN_AGENT_SECRET', '')); time.sleep(1)")
    seen(flag)
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            pass
    rc, _, err = end(proc)
    assert rc == 0 and flag.read_text() == "", err
    assert any(str(TETHER).encode() in x for x in lines) and not any(SECRET.encode() in x for x in lines)


FAKE_TETHER = """
import os, sys
sys.path.insert(0, {here!r})
import link
secret = link.read_secret(0)
addr, _, port = os.environ["ULFMTRAIN_HEAD"].rpartition(":")
head = link.call(addr, int(port), secret, int(os.environ["PMIX_RANK"]), 5.0)
for line in ("x notanumber", "x 99999", "c 1,a", "zz", "p"):
    head.send(line)
head.sock.sendall(b"x 0 " + b"0" * 64 + b"\\n")          # a MAC that does not hold
head.send("x 5")
head.sock.recv(4096)                                   # the echo of the ping, then the end
"""


def test_a_tether_that_knows_the_secret_still_cannot_crash_the_agent(tmp_path):
    """Malformed messages that pass the HMAC check (or fail it) are dropped, a line each; the agent goes on and
    ends with the status the tether reports last."""
    fake = tmp_path / "fake_tether.py"
    fake.write_text(FAKE_TETHER.format(here=str(TETHER.parent)))
    # The remote shell runs the fake instead of the tether (the command's environment assignments kept).
    proc = start(tmp_path, "pass", rsh_script=f'eval "$(echo "$*" | sed "s| [^ ]*python[^ ]* -P .*| {sys.executable} '
                                              f'{fake}|")"')
    rc, _, err = end(proc)
    dropped = [x for x in err.splitlines() if "dropped a message of its tether" in x]
    assert rc == 5 and len(dropped) == 5 and err.count("\n") == 5, err
    for what in ("'x notanumber'", "'x 99999' (not an exit status)", "'c 1,a'", "'zz' (a kind the agent does not",
                 "fails its HMAC check"):
        assert any(what in x for x in dropped), (what, err)


def test_a_remote_shell_that_passes_no_standard_input_is_named(tmp_path):
    """The secret travels on the remote shell's standard input: an RSH that drops it (ssh -n) gets one line."""
    rc, out, err = end(start(tmp_path, "print('ran')", rsh_script='exec sh -c "$*" < /dev/null'))
    assert rc == -signal.SIGKILL and out == "", err
    assert "no job secret on standard input (the remote shell must pass the agent's standard input on" in err, err


def test_the_rank_starts_in_the_launching_directory(tmp_path):
    """As on one host, whatever the remote login's directory: plan["wdir"] (launch's own, or --wdir)."""
    wdir = tmp_path / "work"
    wdir.mkdir()
    proc = start(tmp_path, "import os; print(os.getcwd())", rsh_script='cd /; exec sh -c "$*"', wdir=str(wdir))
    rc, out, err = end(proc)
    assert (rc, out) == (0, f"{wdir}\n"), err
    rc, out, err = end(start(tmp_path, "print('ran')", wdir=str(tmp_path / "nowhere")))
    assert rc == 1 and out == "" and f"cannot start in {tmp_path / 'nowhere'} (No such file or directory)" in err, err


SYSLOG = """
import socket, sys
sys.path.insert(0, {core!r})
import userdir
log = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
log.bind("/dev/log")
log.settimeout(10)
userdir.host_log("ulfmtrain: rank 1 on h stopped: a test")
print(log.recv(4096).decode())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a private /dev needs root and unshare")
def test_the_stop_line_goes_to_syslog_where_there_is_one(tmp_path):
    """host_log also sends the line to syslog (/dev/log): here a syslog of the test's own, in a mount namespace
    with a private /dev."""
    script = tmp_path / "syslog.py"
    script.write_text(SYSLOG.format(core=str(TETHER.parent.parent / "core")))
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs none /dev && {sys.executable} -P {script}"], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "ULFMTRAIN_HOST_LOG": str(tmp_path / "log")})
    assert proc.returncode == 0 and "ulfmtrain[" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ulfmtrain: rank 1 on h stopped: a test"), proc.stdout
    assert (tmp_path / "log").read_text().endswith("ulfmtrain: rank 1 on h stopped: a test\n")
