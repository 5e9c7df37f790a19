"""The fork server and its shim, without MPI: what a spawned newcomer gets, and how each side ends.

One server (ulfmtrain/membership/forkserver.py, as a rank starts it) serves every test; it watches a `sleep` of the
test's own, as it watches PRRTE's daemon in a job.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulfmtrain.membership import forkserver, spawn_shim

pytestmark = pytest.mark.timeout(60)
SHIM = Path(forkserver.__file__).with_name("spawn_shim.py")
SCRIPTS = Path(__file__).parents[1] / "scripts"
CHILD = SCRIPTS / "forked_child.py"


def gone(pid: int, within: float = 10.0) -> bool:
    """The process `pid` ended (and was reaped) within `within` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def with_scripts() -> dict[str, str]:
    """This environment, with tests/scripts importable (forked_child, batching_forkserver)."""
    return {**os.environ, "PYTHONPATH": str(SCRIPTS)}


def start_server(address: str, watched: int, module: str = "ulfmtrain.membership.forkserver", **kw) -> subprocess.Popen:
    """The server as a rank starts it, once it listens (in a job the first spawn comes after a failure)."""
    return listening(subprocess.Popen([sys.executable, "-P", "-m", module, address, str(watched)], **kw), address)


def listening(proc: subprocess.Popen, address: str) -> subprocess.Popen:
    """proc, once the server listens at address."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            if s.connect_ex(address) == 0:
                return proc
        time.sleep(0.05)
    raise AssertionError(f"the fork server did not listen at {address} within 30 s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(address, watched process, server process); the server has done its imports."""
    watched = subprocess.Popen(["sleep", "600"])
    try:
        address = str(tmp_path_factory.mktemp("forkserver") / "server")
        proc = start_server(address, watched.pid, env=with_scripts())
        first = shim(address, [sys.executable, "-P", "-m", "forked_child", "exit", "0"], timeout=50)
        assert first.returncode == 0 and json.loads(first.stdout)["forked"] == "1", first
        yield address, watched, proc
    finally:
        watched.kill()          # the server ends with it
        watched.wait()
    proc.wait(timeout=10)


def shim(address: str, command: list[str], timeout: float = 20, **kw) -> subprocess.CompletedProcess:
    """Run the shim as MPI_Comm_spawn would; a shim whose streams stay open fails the test here."""
    return subprocess.run([sys.executable, "-I", "-S", str(SHIM), address, *command], capture_output=True,
                          text=True, timeout=timeout, **kw)


def start_shim(address: str, command: list[str]) -> tuple[subprocess.Popen, dict]:
    """A shim whose child sleeps, and what the child said of itself."""
    p = subprocess.Popen([sys.executable, "-I", "-S", str(SHIM), address, *command, "sleep", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def test_a_fork_runs_the_module_with_the_shims_streams_environment_and_directory(server, tmp_path):
    address, _, _ = server
    got = shim(address, [sys.executable, "-P", "-m", "forked_child", "exit", "3"], cwd=tmp_path,
               env={**os.environ, "FORKED_CHILD_TEST": "mine"})
    said = json.loads(got.stdout)
    assert got.returncode == 3, got
    assert said["cwd"] == str(tmp_path) and said["args"] == ["exit", "3"] and said["mine"] == "mine", said
    assert said["forked"] == "1" and said["torch"], said       # torch came imported with the fork
    assert got.stderr == "", got.stderr


def test_a_fork_runs_a_script_too(server):
    address, _, _ = server
    got = shim(address, [sys.executable, "-P", str(CHILD), "exit", "0"])
    assert got.returncode == 0 and json.loads(got.stdout)["forked"] == "1", got


def test_the_shim_ends_by_the_signal_that_killed_its_child(server):
    address, _, _ = server
    p, said = start_shim(address, [sys.executable, "-P", str(CHILD)])
    os.kill(said["pid"], signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL


def test_a_signal_to_the_shim_goes_on_to_its_child(server):
    address, _, _ = server
    p, said = start_shim(address, [sys.executable, "-P", str(CHILD)])
    p.terminate()
    assert p.wait(timeout=10) == -signal.SIGTERM and gone(said["pid"])


def test_a_killed_shim_takes_its_child_with_it(server):
    address, _, _ = server
    p, said = start_shim(address, [sys.executable, "-P", str(CHILD)])
    p.kill()
    p.wait()
    assert gone(said["pid"]), said


@pytest.mark.parametrize("command", [[sys.executable, "-c", "print('from scratch')"],
                                     ["/bin/sh", "-c", "echo from scratch"]])
def test_a_command_the_server_does_not_run_starts_from_scratch_and_says_so(server, command):
    """Refused, the shim execs the command; the server keeps none of its streams (PRRTE would wait for them,
    and so does this test's capture)."""
    address, _, _ = server
    got = shim(address, command)
    assert got.returncode == 0 and got.stdout == "from scratch\n", got
    assert got.stderr.startswith("ulfmtrain: warning: the fork server runs only") and got.stderr.count("\n") == 1


def test_no_server_on_the_host_starts_from_scratch_and_says_so():
    got = shim("/nonexistent/ulfmtrain-forkserver", [sys.executable, "-P", str(CHILD), "exit", "5"])
    assert got.returncode == 5 and json.loads(got.stdout)["forked"] is None, got
    assert got.stderr.startswith("ulfmtrain: warning: no fork server reached on this host"), got.stderr


def test_disabled_the_spawn_command_is_the_newcomers_own(monkeypatch):
    command = [sys.executable, "-P", "-m", "ulfmtrain", "train"]
    assert forkserver.wrap(command)[-len(command):] == command and forkserver.wrap(command)[2:4] == ["-S", str(SHIM)]
    monkeypatch.setenv(forkserver.ENABLE_ENV, "0")
    assert forkserver.wrap(command) == command


def test_the_server_and_its_children_end_with_the_process_it_watches(tmp_path):
    watched, address = subprocess.Popen(["sleep", "600"]), str(tmp_path / "server")
    try:
        proc = start_server(address, watched.pid)
        p, said = start_shim(address, [sys.executable, "-P", str(CHILD)])
    finally:
        watched.kill()
        watched.wait()
    assert proc.wait(timeout=10) == 0 and gone(said["pid"])
    # The shim ends as killed: in a job, the survivors are told of its process.
    assert p.wait(timeout=10) == -signal.SIGKILL


def test_a_shim_and_its_child_killed_at_once_leave_the_server_serving(tmp_path):
    """Both deaths in one batch of events, the child's reaped first: the shim's event that follows must not
    kill the freed pid (it ended the server, and with it every newcomer of the host)."""
    watched, address = subprocess.Popen(["sleep", "600"]), str(tmp_path / "server")
    try:
        proc = start_server(address, watched.pid, module="batching_forkserver",
                            env=with_scripts(), stderr=subprocess.PIPE, text=True)
        p, said = start_shim(address, [sys.executable, "-P", str(CHILD)])
        os.kill(said["pid"], signal.SIGKILL)
        p.kill()
        p.wait()
        assert gone(said["pid"]), said
        time.sleep(1)             # the server's batch (0.3 s) is handled
        assert proc.poll() is None, proc.stderr.read()
        got = shim(address, [sys.executable, "-P", "-m", "forked_child", "exit", "0"],
                   env=with_scripts())
        assert got.returncode == 0 and json.loads(got.stdout)["forked"] == "1" and got.stderr == "", got
    finally:
        watched.kill()
        watched.wait()
    proc.wait(timeout=10)


FAKE_SERVER = """
import json, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(1)
print("listening", flush=True)
conn, _ = listener.accept()
data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
if data or fds:
    with open(sys.argv[2], "w") as f:
        json.dump({"env": sorted(json.loads(data)["env"]), "fds": len(fds)}, f)
    conn.send(json.dumps({"pid": 1}).encode())
    conn.send(json.dumps({"status": 0}).encode())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (uid 65534) needs root")
def test_a_fork_server_of_another_user_gets_nothing(tmp_path):
    """The review's attack: a fake server run by another user (nobody, uid 65534) holds the address a newcomer's
    shim connects to.  The shim checks the server's credentials (SO_PEERCRED) before it sends anything: no
    environment, no standard streams; the newcomer starts from scratch, says so once, and ends with its own
    status (the fake server's 0 must not become it)."""
    import shutil
    import tempfile

    lair = Path(tempfile.mkdtemp(prefix="ulfmtrain-fake-"))      # a folder the stranger owns, outside ours
    try:
        os.chown(lair, 65534, 65534)
        address, loot = lair / "forkserver", lair / "loot.json"
        fake = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FAKE_SERVER, str(address), str(loot)], user=65534,
                                group=65534, extra_groups=[], stdout=subprocess.PIPE, text=True)
        try:
            assert fake.stdout.readline() == "listening\n"
            got = shim(str(address), [sys.executable, "-P", str(CHILD), "exit", "5"],
                       env={**os.environ, "SECRET_OF_THE_NEWCOMER": "x"})
        finally:
            fake.kill()
            fake.wait()
        assert not loot.exists(), loot.read_text()                # nothing was handed over
        assert got.returncode == 5 and json.loads(got.stdout)["forked"] is None, got
        lines = got.stderr.splitlines()
        assert len(lines) == 1 and "runs as uid 65534, not as this user" in lines[0], got.stderr
    finally:
        shutil.rmtree(lair)


def test_the_servers_socket_lives_in_a_folder_only_this_user_can_enter(tmp_path, monkeypatch, capsys):
    """Not the abstract namespace, where any local user can connect first or take the name: this user's private
    folder, made 0700.  A folder of that name that is someone else's, open to others, or a link is refused with
    one line, and newcomers start from scratch."""
    import tempfile

    from ulfmtrain.core import userdir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(forkserver.ADDRESS_ENV, raising=False)
    monkeypatch.setenv("PMIX_NAMESPACE", "job@1")
    monkeypatch.setattr(forkserver, "_warned", [])
    folder = tmp_path / f"ulfmtrain-{os.getuid()}"
    where = forkserver.address()
    assert where and Path(where).parent == folder and (folder.stat().st_mode & 0o777) == 0o700, where
    command = [sys.executable, "-P", "-m", "ulfmtrain", "train"]
    assert forkserver.wrap(command)[-len(command) - 1:] == [where, *command]
    folder.chmod(0o755)
    with pytest.raises(userdir.UnsafeFolder, match="mode drwxr-xr-x"):
        userdir.private_dir()
    folder.rmdir()
    folder.symlink_to(tmp_path)
    with pytest.raises(userdir.UnsafeFolder, match="a link"):
        userdir.private_dir()
    folder.unlink()
    if os.geteuid() == 0:                                   # another user took the name first
        folder.mkdir(mode=0o700)
        os.chown(folder, 65534, 65534)
    else:
        folder.mkdir(mode=0o777)
    capsys.readouterr()
    assert forkserver.wrap(command) == command and forkserver.wrap(command) == command
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder of this user's closed to others" in err, err


def test_a_fork_starts_with_the_signal_handlers_of_a_rank_that_prrte_execs():
    """PRRTE sets SIGINT, SIGTERM, SIGHUP and SIGPIPE to their defaults before it execs a rank, and Python then
    turns SIGINT into KeyboardInterrupt and ignores SIGPIPE.  A fork took the server's own, inherited from
    whoever started it: a test suite run in the background (SIGINT ignored, as a shell does for `make test &`)
    forked ranks that a SIGINT could not end (the flaky test_failure_kinds test, world [4, 4])."""
    watched, address = subprocess.Popen(["sleep", "600"]), f"@ulfmtrain-forkserver-test-sig-{os.getpid()}"
    ignore = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        proc = start_server(address, watched.pid, env=with_scripts(),
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_IGN) for s in ignore])
        got = shim(address, [sys.executable, "-P", "-m", "forked_child", "exit", "0"], env=with_scripts())
    finally:
        watched.kill()
        watched.wait()
    proc.wait(timeout=10)
    assert got.returncode == 0, got
    exec_like = {"SIGINT": "default_int_handler", "SIGTERM": "SIG_DFL", "SIGHUP": "SIG_DFL", "SIGUSR1": "SIG_DFL",
                 "SIGPIPE": "SIG_IGN"}
    assert json.loads(got.stdout)["signals"] == exec_like, got.stdout


def test_the_server_and_its_forks_share_the_ranks_session_in_a_process_group_of_their_own(tmp_path, monkeypatch):
    """A session of its own is a scheduling group of its own under Linux's autogroup (on by default): every
    newcomer the server forked then shared one core's worth of CPU with the others, beside an original rank
    that had the other to itself (the 1000-failure soak: three newcomers at 33 % each, the original at 96 %,
    every step waiting for the newcomers).  Its own process group still keeps it out of a kill of the rank's."""
    address = str(tmp_path / "server")
    monkeypatch.setattr(forkserver, "enabled", lambda: True)
    monkeypatch.setattr(forkserver, "local_rank", lambda: 0)
    monkeypatch.setattr(forkserver, "address", lambda: address)
    monkeypatch.setattr(os, "environ", {k: v for k, v in with_scripts().items()      # not the suite's server
                                        if k not in (spawn_shim.ADDRESS_ENV, spawn_shim.PID_ENV)})
    proc = forkserver.start()
    assert proc is not None
    try:
        listening(proc, address)
        assert (os.getsid(proc.pid), os.getpgid(proc.pid)) == (os.getsid(0), proc.pid)
        child = shim(address, [sys.executable, "-P", "-m", "forked_child", "exit", "0"], timeout=50)
        said = json.loads(child.stdout)
        assert child.returncode == 0 and said["forked"] == "1", child
        assert (said["sid"], said["pgid"]) == (os.getsid(0), said["pid"]), said
    finally:
        proc.kill()
        proc.wait()
