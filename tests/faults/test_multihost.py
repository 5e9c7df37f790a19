"""Two or three hosts on one machine (network namespaces with their own hostnames), TCP between them: hosts
killed, cut off and frozen, under the normal launch (a daemon on every host) and under `launch --agent`.

The hosts are created by each test and removed after it; no traffic leaves them.  Where ssh is the point (the
login directory, the ssh sessions of a cut host, ssh giving up), each host runs a real sshd with keys made for the
test (`ssh_hosts`); elsewhere the ranks are started in a host's namespace directly (`agent.sh`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]
SUBNET = "10.213.0"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def namespace_hosts(tmp_path: Path, n: int, sshd: bool = False):
    """n hosts, each a network namespace on one bridge, plus mpirun's "ssh HOST CMD" for them and a hostfile.

    Each host's stderr goes to tmp_path/HOST.err, as a real host's would stay on it.  sshd: each host runs
    sshd too, and the third item is the ssh command that reaches them (start_sshd) instead of agent.sh.
    """
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"ulfm{os.getpid() % 100000}"
    bridge = f"{tag}br"
    hosts = {f"{SUBNET}.{i + 1}": f"{tag}{chr(ord('a') + i)}" for i in range(n)}
    try:
        sh("ip", "netns", "add", bridge)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (addr, ns) in enumerate(hosts.items()):
            sh("ip", "netns", "add", ns)
            veth, peer = f"v{tag}{i}", f"p{tag}{i}"
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "link", "set", peer, "netns", bridge)
            sh("ip", "-n", bridge, "link", "set", peer, "master", "br0")
            sh("ip", "-n", bridge, "link", "set", peer, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # mpirun's "ssh HOST CMD": run CMD in HOST's namespace, under HOST as hostname, in a session of
        # its own: signals that PRRTE sends the process group of a rank's agent stay on the head, as with ssh.
        agent = tmp_path / "agent.sh"
        cases = "\n".join(f"  {a}) ns={n};;" for a, n in hosts.items())
        agent.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n  *) exit 1;;\nesac\n'
                         'exec setsid ip netns exec $ns unshare --uts sh -c "hostname $host; $*"'
                         f' 2>>{tmp_path}/$host.err\n')
        agent.chmod(0o755)
        hostfile = tmp_path / "hosts"
        hostfile.write_text("".join(f"{a} slots=2\n" for a in hosts))
        yield hosts, (start_sshd(tmp_path, hosts) if sshd else agent), hostfile
    finally:
        for ns in hosts.values():       # what a test left running on its hosts (a frozen host included)
            signal_host(ns, "KILL")
        for ns in [*hosts.values(), bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    yield from namespace_hosts(tmp_path, 2)


@pytest.fixture
def three_hosts(tmp_path):
    yield from namespace_hosts(tmp_path, 3)


@pytest.fixture
def ssh_hosts(tmp_path):
    """Two hosts, each running sshd; (hosts, the ssh command that reaches them, hostfile)."""
    yield from namespace_hosts(tmp_path, 2, sshd=True)


SSHD_CONFIG = """HostKey {d}/host_key
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The test's temporary folder has the permissions of its parents, which sshd's checks would refuse.
StrictModes no
PidFile none
LogLevel ERROR
"""
SSH_CONFIG = """Host *
  IdentityFile {d}/id
  IdentitiesOnly yes
  UserKnownHostsFile {d}/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
"""


def start_sshd(tmp_path: Path, hosts: dict) -> str:
    """Start sshd on every namespace host (under the host's name, so sessions see it) with a host key and a login
    key made for this test, and return the ssh command that reaches the hosts, host keys checked."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or not shutil.which("ssh-keygen"):
        pytest.skip("no sshd here: apt-get install openssh-server")
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    for key in ("host_key", "id"):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key))
    (d / "authorized_keys").write_text((d / "id.pub").read_text())
    host_key = " ".join((d / "host_key.pub").read_text().split()[:2])
    (d / "known_hosts").write_text("".join(f"{a} {host_key}\n" for a in hosts))
    (d / "sshd_config").write_text(SSHD_CONFIG.format(d=d))
    (d / "ssh_config").write_text(SSH_CONFIG.format(d=d))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)     # sshd's privilege-separation folder
    for addr, ns in hosts.items():
        with open(tmp_path / f"{addr}.sshd.log", "ab") as log:
            subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                              f"hostname {addr}; exec {sshd} -D -e -f {d}/sshd_config -o ListenAddress={addr}"],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    rsh = f"ssh -F {d}/ssh_config"
    first = hosts[next(iter(hosts))]
    for addr in hosts:                  # sshd is up, and the key and host key work
        for _ in range(100):
            if subprocess.run(["ip", "netns", "exec", first, *rsh.split(), addr, "true"], capture_output=True,
                              timeout=30).returncode == 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"sshd on {addr} never answered: {(tmp_path / f'{addr}.sshd.log').read_text()}")
    return rsh


def signal_host(ns: str, sig: str) -> list[str]:
    """Send sig to every process of the namespace host (by pid, in one kill: they stop together); return the
    pids."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
    if pids:
        subprocess.run(["kill", f"-{sig}", *pids], capture_output=True)
    return pids


def links_down(ns: str) -> None:
    """Every link of the host but loopback down: it neither sends nor answers (`ip link set ... down`)."""
    links = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True, text=True).stdout
    for name in (line.split(":")[1].strip().split("@")[0] for line in links.splitlines()):
        if name != "lo":
            subprocess.run(["ip", "-n", ns, "link", "set", name, "down"], capture_output=True)


def power_cut(hosts: dict, host: str, silent: bool = False) -> list[str]:
    """The namespace host stops at once: it neither runs nor answers.

    By default every process of it is SIGKILLed, then its links go down once the other hosts have heard its
    sockets close, as when a host's processes die.  silent: its links go down first and its processes are frozen
    (SIGSTOP), so nothing of it is heard again, as with real power loss; the fixture kills them at the end.
    (Killed processes would be seen at once by their parents, which in these tests are on the head host.)
    """
    ns = hosts[host]
    if silent:
        links_down(ns)
        return signal_host(ns, "STOP")
    pids = signal_host(ns, "KILL")
    # Links taken down before the kernel has sent and delivered the sockets' FIN (or RST) swallow it, and the cut
    # is silent: PRRTE then waits for its keep-alives and the ranks for a peer that never answers (the normal
    # launch's test ran on for 150 s in CI).  Waiting for the leader thread to be a zombie was not enough: the
    # other threads (torch's, PRRTE's) close the sockets when the last of them exits, later under load.  So wait
    # for every thread, and then until no other host holds a connection to this one for established.
    peers = [n for h, n in hosts.items() if h != host]
    deadline = time.monotonic() + 10
    while (unheard := any(_alive(pid) for pid in pids) or _heard_of(peers, host)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not unheard, f"host {host}'s end did not reach the others in 10 s: {_heard_of(peers, host)}"
    links_down(ns)
    return pids


def _heard_of(peers: list[str], host: str) -> list[str]:
    """The TCP connections to host that the peer hosts still hold for established (they have not heard it
    close)."""
    return [line for ns in peers for line in subprocess.run(
        ["ss", "-N", ns, "-H", "-t", "-n", "state", "established", "dst", host],
        capture_output=True, text=True, timeout=30).stdout.splitlines()]


def _alive(pid: str) -> bool:
    """Whether any thread of the process still runs.  (Its leader can be a zombie while other threads still
    exit, holding its sockets open: 54 kills in 100 of a process with 8 threads, on the loaded machine.)"""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            continue                  # ended meanwhile
    return False


def daemon_args(agent: Path) -> list[str]:
    """mpirun's arguments for a daemon on every namespace host: started through the agent, TCP on the bridge."""
    return ["--prtemca", "plm_ssh_agent", str(agent), "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24", "--prtemca", "oob_tcp_if_include", f"{SUBNET}.0/24"]


def test_losing_every_rank_of_a_host(two_hosts, digits_dir, tmp_path):
    hosts, agent, hostfile = two_hosts
    first = next(iter(hosts))
    out = tmp_path / "out"
    extra = daemon_args(agent)
    launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", "4", "--hostfile", str(hostfile),
              *[f"--mpirun-arg={a}" for a in extra], "--",
              "train", "--data", str(digits_dir), "--out", str(out), "--epochs", "3", "--model", "mlp",
              "--no-progress", "--kill", "2@30", "--kill", "3@30"]
    inner = " ".join(f"'{a}'" for a in launch)
    proc = subprocess.run(["ip", "netns", "exec", hosts[first], "unshare", "--uts", "sh", "-c",
                           f"hostname {first}; exec {inner}"], capture_output=True, text=True, timeout=150)
    logs = read_rank_logs(out)
    diag = proc.stdout[-2000:] + proc.stderr[-3000:]
    starts = {r: next(x for x in recs if x["event"] == "start") for r, recs in logs.items()}
    assert sorted(starts) == [0, 1, 2, 3], diag
    a, b = list(hosts)
    assert [starts[r]["host"] for r in range(4)] == [a, a, b, b]     # ranks 2 and 3 lived on the other host
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    assert sorted(r for r, e in ends.items() if e) == [0, 1], diag
    for r in (0, 1):
        end = ends[r][0]
        assert end["world_history"] == [4, 2] and end["consistent"], end
        rec = [x for x in logs[r] if x["event"] == "recovery"]
        assert len(rec) == 1 and rec[0]["removed"] == [2, 3]
    assert ends[0][0]["checksum"] == ends[1][0]["checksum"]
    assert json.loads((out / "summary.json").read_text())["test_acc"] > 0.8


def test_agent_launch_survives_a_whole_host_killed(two_hosts, digits_dir, tmp_path):
    """No daemon on host b (launch --agent): every process of host b is SIGKILLed, as a power cut would;
    host a's ranks train on with identical replicas and every record seen once per epoch."""
    import time

    from ulfmtrain.tools.audit import audit_logs

    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out = tmp_path / "out"
    launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", "4", "--hostfile", str(hostfile),
              "--agent", str(agent), "--net", f"{SUBNET}.0/24", "--",
              "train", "--data", str(digits_dir), "--out", str(out), "--epochs", "8", "--model", "mlp",
              "--no-progress", "--audit"]
    inner = " ".join(f"'{x}'" for x in launch)
    proc = subprocess.Popen(["ip", "netns", "exec", hosts[a], "unshare", "--uts", "sh", "-c",
                             f"hostname {a}; exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, killed = time.monotonic(), []
    while time.monotonic() - t0 < 100 and proc.poll() is None and not killed:
        logs = read_rank_logs(out) if out.exists() else {}
        if sum(x["event"] == "step" for x in logs.get(0, [])) >= 30:     # mid-training
            pids = subprocess.run(["ip", "netns", "pids", hosts[b]], capture_output=True, text=True).stdout.split()
            t_kill = time.time()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            killed = pids
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=150)
    diag = stdout[-2000:] + stderr[-3000:]
    assert killed, "training never reached step 30: " + diag
    logs = read_rank_logs(out)
    starts = {r: next(x for x in recs if x["event"] == "start") for r, recs in logs.items()}
    assert [starts[r]["host"] for r in range(4)] == [a, a, b, b], diag
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    assert sorted(r for r, e in ends.items() if e) == [0, 1], diag
    for r in (0, 1):
        end = ends[r][0]
        assert end["world_history"] == [4, 2] and end["consistent"], end
    assert ends[0][0]["checksum"] == ends[1][0]["checksum"]
    rows = audit_logs(logs)
    assert rows and all(r.exact for r in rows if r.finished), rows
    print(f"\nevery process of host {b} killed: " + "; ".join(timings(logs, 0, t_kill)))


def start_supervise(hosts: dict, hostfile: Path, agent: Path, out: Path, ckpt: Path, digits_dir: Path,
                    *sup: str, epochs: int = 6) -> subprocess.Popen:
    """`supervise -n 4 --hostfile` (a daemon on every host), started on the first host, shrink in place."""
    head = next(iter(hosts))
    extra = daemon_args(agent)
    cmd = [sys.executable, "-P", "-m", "ulfmtrain", "supervise", "-n", "4", "--hostfile", str(hostfile),
           "--probe-port", "9", "--max-attempts", "3", "--timeout", "120", *sup,
           *[f"--mpirun-arg={x}" for x in extra],
           "--", "train", "--data", str(digits_dir), "--out", str(out), "--epochs", str(epochs), "--model", "mlp",
           "--no-progress", "--recovery", "shrink", "--ckpt-dir", str(ckpt), "--ckpt-every", "20"]
    inner = " ".join(f"'{x}'" for x in cmd)
    return subprocess.Popen(["ip", "netns", "exec", hosts[head], "unshare", "--uts", "sh", "-c",
                             f"hostname {head}; exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_supervise_drops_a_dead_host_and_resumes(two_hosts, digits_dir, tmp_path):
    """A daemon on every host: a host lost with its daemon ends the job; supervise --hostfile probes the
    hosts, relaunches on the one that answers, resumes from the checkpoint and finishes."""
    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = start_supervise(hosts, hostfile, agent, out, ckpt, digits_dir)
    t0, killed = time.monotonic(), []
    first = out / "attempt-1"
    while time.monotonic() - t0 < 100 and proc.poll() is None and not killed:
        logs = read_rank_logs(first) if first.exists() else {}
        if sum(x["event"] == "step" for x in logs.get(0, [])) >= 45:     # past the step-40 checkpoint
            t_cut = time.time()
            # b is silent to the head first, so the supervisor's probe cannot find it answering in the
            # moment between the kill and its links going down; what b's kernel sends still arrives.
            sh("ip", "-n", hosts[a], "route", "add", "blackhole", f"{b}/32")
            killed = power_cut(hosts, b)
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=200)
    diag = stdout[-2000:] + stderr[-3000:]
    assert killed and proc.returncode == 0, diag
    sup = json.loads((out / "supervisor.json").read_text())
    assert [x["ranks"] for x in sup["attempts"]] == [4, 2] and sup["completed"], sup
    second = sup["attempts"][1]
    assert second["resumed_from"] and f"hosts down, left out: {b}" in stderr, diag
    assert (Path(second["hostfile"]).read_text().split()[0]) == a
    logs = read_rank_logs(out / "attempt-2")
    assert {next(x for x in recs if x["event"] == "start")["host"] for recs in logs.values()} == {a}
    resume = next(x for x in logs[0] if x["event"] == "resume")
    # Mostly step 40 or 60 at world 4; once (CI), rank 0 outlived mpirun by 2 s, trained on alone (world 1) and
    # checkpointed until supervise claimed the directory for attempt 2 (format.claim).
    written = [x["step"] for x in read_rank_logs(first)[0] if x["event"] == "checkpoint_written"]
    assert resume["step"] >= 40 and resume["step"] in written and resume["world"] == 2, (resume, written)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 6
    first_step = next(x for x in logs[0] if x["event"] == "step")["t"]
    lost = max(x["step"] for x in read_rank_logs(first)[0] if x["event"] == "step") + 1 - resume["step"]
    print(f"\nsupervise, host {b} lost: job ended {sup['attempts'][0]['t_exit'] - t_cut:.2f} s after the cut, "
          f"probe {second['t_launch'] - sup['attempts'][0]['t_exit']:.2f} s, relaunch to the first step "
          f"{first_step - second['t_launch']:.2f} s, {lost} steps redone")


def test_supervise_relaunches_without_a_host_lost_during_the_launch(two_hosts, digits_dir, tmp_path):
    """Host b loses power while the first attempt's daemons start: the launch would wait for b's daemon until
    --start-timeout (600 s by default); the supervisor, probing the hosts until a rank starts, finds b gone within
    about a second, ends the attempt, says so, and relaunches on host a instead of giving up.  (Before, the test
    passed --start-timeout 20, which a cold start at a load of 30 outran: 40 s.)"""
    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = start_supervise(hosts, hostfile, agent, out, ckpt, digits_dir, epochs=3)
    cut = wait_for(lambda: bool(signal_host(hosts[b], "0")), proc, 60)    # the first process of b: the launch
    assert cut, "no process ever started on host b"
    power_cut(hosts, b, silent=True)
    stdout, stderr = proc.communicate(timeout=150)
    diag = stdout[-2000:] + stderr[-3000:]
    assert proc.returncode == 0, diag
    sup = json.loads((out / "supervisor.json").read_text())
    assert [x["ranks"] for x in sup["attempts"]] == [4, 2] and sup["completed"], sup
    first = sup["attempts"][0]
    assert not any(x["event"] == "start" for recs in read_rank_logs(out / "attempt-1").values() for x in recs)
    assert f"host(s) {b} went down during its launch: relaunching without them" in stderr, diag
    assert f"hosts down, left out: {b}" in stderr, diag
    logs = read_rank_logs(out / "attempt-2")
    assert {next(x for x in recs if x["event"] == "start")["host"] for recs in logs.values()} == {a}
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3
    # The probe ends the attempt, or mpirun ends it first, having lost b's daemon itself: b is found down either way.
    assert first["lost_in_launch"] == [b] or (not first["start_timed_out"] and first["rc"] is not None), first
    how = "the probe" if first["lost_in_launch"] else f"mpirun exit status {first['rc']}"
    print(f"\nsupervise, host {b} lost during the launch: attempt 1 ended by {how} "
          f"{first['t_exit'] - first['t_launch']:.1f} s after it began; attempt 2 on {a} completed")


# -- the agent launch: hosts lost, cut off and frozen -------------------------
KEEPALIVE = 3.0      # the bound the tests launch with: short, yet no false alarm on a loaded 2-core machine


def start_agent_job(hosts: dict, agent: Path | str, hostfile: Path, head: str, n: int, out: Path | str,
                    train: list[str], digits_dir: Path | str, *, keepalive: float = KEEPALIVE,
                    cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """`launch --agent` run from the head host's namespace (mpirun and its daemon live there only)."""
    launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", str(n), "--hostfile", str(hostfile),
              "--agent", str(agent), "--net", f"{SUBNET}.0/24", "--keepalive", str(keepalive), "--",
              "train", "--data", str(digits_dir), "--out", str(out), "--model", "mlp", "--no-progress", *train]
    inner = " ".join(f"'{x}'" for x in launch)
    return subprocess.Popen(["ip", "netns", "exec", hosts[head], "unshare", "--uts", "sh", "-c",
                             f"hostname {head}; exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env=None if env is None else {**os.environ, **env})


def steps_of(out: Path, rank: int) -> int:
    logs = read_rank_logs(out) if out.exists() else {}
    return sum(x["event"] == "step" for x in logs.get(rank, []))


def wait_for(cond, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll cond() every 50 ms while the job runs; True once it holds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if cond():
            return True
        time.sleep(0.05)
    return False


def finished(proc: subprocess.Popen, tmp_path: Path, timeout: float = 150) -> str:
    """Wait for mpirun; return its output's tail and every host's stderr, for assertion messages.  Past the
    timeout, end the launcher (its job ends with it: stopping.py) and fail with the same."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        ran_on = False
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate(timeout=30)
        ran_on = True
    errs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.err")))
    diag = stdout[-1500:] + stderr[-2500:] + errs
    if ran_on:
        pytest.fail(f"the job still ran {timeout:g} s later: {diag}")
    return diag


def check_survivors(logs: dict, survivors: list[int], history: list[int]) -> dict:
    """The survivors finished with the given world history and one replica; return the lowest one's end."""
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    assert sorted(r for r, e in ends.items() if e) == survivors
    for r in survivors:
        assert ends[r][0]["world_history"] == history and ends[r][0]["consistent"], ends[r][0]
    assert len({ends[r][0]["checksum"] for r in survivors}) == 1
    return ends[survivors[0]][0]


def timings(logs: dict, rank: int, t_fault: float) -> list[str]:
    """Per loss: detection (the fault to the moment the survivor learned of it: its failed attempt or the
    commit agree that returned the failure) and repair (revoke, shrink, agree, head confirm, redo)."""
    parts = ("revoke_ms", "shrink_ms", "agree_ms", "head_confirm_ms", "redo_ms")
    rows = []
    for rec in (x for x in logs[rank] if x["event"] == "recovery"):
        repair = sum(rec.get(k, 0.0) for k in parts)
        rows.append(f"removed {rec['removed']}: detected {learned(rec) - t_fault:.2f} s after the fault, "
                    f"repaired in {repair:.1f} ms (" + ", ".join(f"{k[:-3]} {rec.get(k, 0.0):.1f}" for k in parts)
                    + ")")
    return rows


def learned(rec: dict) -> float:
    """When a survivor learned of a failure: its attempt failed (wall_error), or the commit agree said so."""
    return rec["wall_error"] + rec["commit_agree_ms"] / 1e3


def audit_ok(out: Path) -> str:
    """`python -m ulfmtrain audit OUT` passes (every record exactly once per epoch); return its table."""
    proc = subprocess.run([sys.executable, "-P", "-m", "ulfmtrain", "audit", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "every record exactly once per epoch" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_agent_launch_survives_a_power_cut_of_one_of_three_hosts(three_hosts, digits_dir, tmp_path):
    """6 ranks on 3 hosts; host c loses power (links first: no peer hears anything): the head drops it after
    the keep-alive bound, and hosts a and b finish with one replica and an exact audit."""
    hosts, agent, hostfile = three_hosts
    a, b, c = list(hosts)
    out = tmp_path / "out"
    proc = start_agent_job(hosts, agent, hostfile, a, 6, out, ["--epochs", "8", "--audit"], digits_dir)
    assert wait_for(lambda: steps_of(out, 0) >= 30, proc, 100), "training never reached step 30"
    t_cut = time.time()
    power_cut(hosts, c, silent=True)
    # On a cluster the head's ssh clients to the dead host hold mpirun's output pipes, which mpirun waits for at a
    # clean end: each agent kills its ssh client as it drops the host.  Here the host's own frozen processes hold
    # those pipes: they end the same bound later.
    threading.Timer(KEEPALIVE + 1.0, signal_host, (hosts[c], "KILL")).start()
    diag = finished(proc, tmp_path)
    logs = read_rank_logs(out)
    starts = {r: next(x for x in recs if x["event"] == "start") for r, recs in logs.items()}
    assert [starts[r]["host"] for r in range(6)] == [a, a, b, b, c, c], diag
    check_survivors(logs, [0, 1, 2, 3], [6, 4])
    rows = timings(logs, 0, t_cut)
    assert len(rows) == 1, rows
    detected = learned(next(x for x in logs[0] if x["event"] == "recovery")) - t_cut
    assert KEEPALIVE * 2 / 3 - 0.2 <= detected <= KEEPALIVE + 3, (detected, diag)    # silent: only the keep-alive tells
    audit_ok(out)
    print(f"\npower cut of 1 of 3 hosts (keep-alive {KEEPALIVE:g} s): " + "; ".join(rows))


@pytest.mark.slow
def test_agent_launch_survives_two_hosts_lost_in_turn(three_hosts, digits_dir, tmp_path):
    """6 ranks on 3 hosts; every process of host c killed, then every process of host b: world 6 -> 4 -> 2."""
    hosts, agent, hostfile = three_hosts
    a, b, c = list(hosts)
    out = tmp_path / "out"
    proc = start_agent_job(hosts, agent, hostfile, a, 6, out, ["--epochs", "10", "--audit"], digits_dir)
    t_kill = []
    for host, at in ((c, 25), (b, 55)):
        assert wait_for(lambda at=at: steps_of(out, 0) >= at, proc, 100), f"training never reached step {at}"
        t_kill.append(time.time())
        assert power_cut(hosts, host)
    diag = finished(proc, tmp_path)
    logs = read_rank_logs(out)
    check_survivors(logs, [0, 1], [6, 4, 2])
    recs = [x for x in logs[0] if x["event"] == "recovery"]
    assert [x["removed"] for x in recs] == [[4, 5], [2, 3]], diag
    audit_ok(out)
    print("\nhosts c then b killed: " + "; ".join(timings(logs, 0, t_kill[0])[:1] + timings(logs, 0, t_kill[1])[1:]))


def _cut_off_side_stopped(hosts: dict, ns: str, tmp_path: Path, logs: dict, cut_ranks: list[int],
                          ckpt: Path, deadline: float) -> None:
    """The cut-off ranks are gone, each with its one line, and committed nothing that the head's side did not."""
    while signal_host(ns, "0") and time.time() < deadline:
        time.sleep(0.2)
    assert not signal_host(ns, "0"), "the cut-off host still runs processes"
    host = next(h for h, n in hosts.items() if n == ns)
    lines = [x for x in (tmp_path / f"{host}.err").read_text().splitlines() if " stopped: " in x]
    # Every line names a cut-off rank.  A rank whose MPI peers went away first may leave without its line
    # (seen once for a frozen host); that it is gone, and committed nothing, is checked above and below.
    named = {int(x.split("rank ")[1].split()[0]) for x in lines}
    assert named and named <= set(cut_ranks), lines
    assert all("only the side that reaches the head node goes on" in x for x in lines)
    survivors = sorted(set(logs) - set(cut_ranks))
    last_whole = max(x["step"] for x in logs[survivors[0]] if x["event"] == "step" and x["world"] == len(logs))
    for r in cut_ranks:
        kinds = {x["event"] for x in logs[r]}
        assert not kinds & {"recovery", "end"}, (r, kinds)
        assert max(x["step"] for x in logs[r] if x["event"] == "step") <= last_whole
    from ulfmtrain.checkpoint.format import list_checkpoints, read_checkpoint
    for step, path in list_checkpoints(ckpt):     # a checkpoint of the whole world predates the cut
        world = read_checkpoint(path).header["world_size"]
        assert world == len(survivors) or step <= last_whole + 1, (step, world)


def _writers_on_b(two_hosts, digits_dir, tmp_path, epochs: int):
    """An agent launch from host a with ranks 0 and 1 (the writers) on host b, once it has trained 30 steps."""
    hosts, agent, _ = two_hosts
    a, b = list(hosts)
    hostfile = tmp_path / "hosts-b-first"
    hostfile.write_text(f"{b} slots=2\n{a} slots=2\n")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = start_agent_job(hosts, agent, hostfile, a, 4, out,
                           ["--epochs", str(epochs), "--ckpt-dir", str(ckpt), "--ckpt-every", "10"], digits_dir)
    assert wait_for(lambda: steps_of(out, 2) >= 30, proc, 100), "training never reached step 30"
    return hosts, a, b, out, ckpt, proc


def test_agent_launch_cut_link_only_the_head_side_goes_on(two_hosts, digits_dir, tmp_path):
    """Ranks 0 and 1 (the writers) on host b, mpirun on host a; b's link is cut: a's ranks go on after the
    keep-alive bound and write the summary; b's ranks stop with one line each and commit nothing more."""
    hosts, a, b, out, ckpt, proc = _writers_on_b(two_hosts, digits_dir, tmp_path, epochs=6)
    t_cut = time.time()
    links_down(hosts[b])
    diag = finished(proc, tmp_path)
    logs = read_rank_logs(out)
    end = check_survivors(logs, [2, 3], [4, 2])
    assert end["alive"] == [2, 3], diag
    summary = json.loads((out / "summary.json").read_text())
    assert summary["alive"] == [2, 3] and summary["epochs"] == 6
    detected = learned(next(x for x in logs[2] if x["event"] == "recovery")) - t_cut
    assert KEEPALIVE * 2 / 3 - 0.2 <= detected <= KEEPALIVE + 3, (detected, diag)
    _cut_off_side_stopped(hosts, hosts[b], tmp_path, logs, [0, 1], ckpt, t_cut + 2 * KEEPALIVE + 10)
    print(f"\nlink of host b cut (keep-alive {KEEPALIVE:g} s): " + "; ".join(timings(logs, 2, t_cut)))


def test_agent_launch_frozen_host_is_dropped_and_stops_when_it_wakes(two_hosts, digits_dir, tmp_path):
    """Every process of host b (ranks 0 and 1) SIGSTOPped: a's ranks go on after the keep-alive bound; when b
    wakes (SIGCONT) in mid-training, its ranks stop with one line each and commit nothing more."""
    hosts, a, b, out, ckpt, proc = _writers_on_b(two_hosts, digits_dir, tmp_path, epochs=8)
    t_freeze = time.time()
    assert signal_host(hosts[b], "STOP")
    repaired = wait_for(lambda: any(x["event"] == "recovery" for x in read_rank_logs(out).get(2, [])), proc, 60)
    t_wake = time.time()
    signal_host(hosts[b], "CONT")
    diag = finished(proc, tmp_path)
    assert repaired, "host a's ranks never repaired: " + diag
    logs = read_rank_logs(out)
    check_survivors(logs, [2, 3], [4, 2])
    assert json.loads((out / "summary.json").read_text())["alive"] == [2, 3]
    assert max(x["step"] for x in logs[2] if x["event"] == "step") > 30 + 20, "b woke up after the end"
    detected = learned(next(x for x in logs[2] if x["event"] == "recovery")) - t_freeze
    assert KEEPALIVE * 2 / 3 - 0.2 <= detected <= KEEPALIVE + 3, (detected, diag)
    _cut_off_side_stopped(hosts, hosts[b], tmp_path, logs, [0, 1], ckpt, t_wake + KEEPALIVE + 10)
    print(f"\nhost b frozen (keep-alive {KEEPALIVE:g} s): " + "; ".join(timings(logs, 2, t_freeze)))


@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_agent_launch_stopped_leaves_nothing_on_any_host(two_hosts, digits_dir, tmp_path, sig):
    """`launch --agent` told to stop (SIGTERM: status 143 and one line), or SIGKILLed (nothing can run in it):
    no process is left on either host, the head (mpirun, the agents) or the other (the ranks, their tethers),
    within the keep-alive bound."""
    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out = tmp_path / "out"
    proc = start_agent_job(hosts, agent, hostfile, a, 4, out, ["--epochs", "1000"], digits_dir)
    assert wait_for(lambda: steps_of(out, 0) >= 10 and steps_of(out, 2) >= 10, proc, 120), "training never began"
    running = {ns: signal_host(ns, "0") for ns in hosts.values()}
    assert all(running.values()), running
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    t0 = time.monotonic()
    while any((left := {ns: signal_host(ns, "0") for ns in hosts.values()}).values()) and \
            time.monotonic() - t0 < KEEPALIVE + 5:
        time.sleep(0.1)
    assert not any(left.values()), (left, stderr[-3000:])
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
        assert stderr.count("ulfmtrain launch: stopped by SIGTERM") == 1, stderr[-3000:]
    print(f"\nlaunch --agent, {sig.name}: nothing left on either host {time.monotonic() - t0:.2f} s after launch "
          f"ended ({sum(map(len, running.values()))} processes before)")


def test_a_repair_the_head_refuses_stops_the_survivors(digits_dir, tmp_path):
    """The survivors' side of the rule, on one host: each rank runs under the real tether, whose "head" is
    a stand-in that answers pings and refuses every repair (as the head would for ranks that removed others
    it still counts).  Rank 2 is killed: ranks 0 and 1 repair, are refused, and stop with one line each
    before they log the repair or any further step."""
    import socket
    import threading

    from ulfmtrain.launching import agent as agent_mod
    from ulfmtrain.launching.launch import mpirun_prefix
    from ulfmtrain.transport import link

    head = socket.create_server(("127.0.0.1", 0))
    refused: list[str] = []
    secret = link.new_secret()

    def serve(conn: socket.socket, rank: int) -> None:
        """The head's end of one tether's link (it cannot tell the ranks apart before their proof: one try each)."""
        with conn:
            greeting, up = link.Greeting(conn, secret, rank), None
            while up is None:
                try:
                    up = greeting.feed(conn.recv(4096))
                except link.LinkError:
                    return
            while data := conn.recv(4096):
                for line in up.feed(data)[0]:
                    if line.startswith("c "):
                        refused.append(line)
                        up.send("c no 2")
                    elif line == "p":
                        up.send("p")

    def accept() -> None:
        while True:
            try:
                conn, _ = head.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn, rank_of(conn)), daemon=True).start()

    def rank_of(conn: socket.socket) -> int:
        """The rank of the tether at the other end, from its process (this machine's /proc)."""
        port = conn.getpeername()[1]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].split(":")[1], 16) == port and f[3] == "01":
                inode = f[9]
                break
        else:
            raise AssertionError(f"no socket of port {port}")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in fds):
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    return int(next(x for x in env if x.startswith(b"PMIX_RANK=")).split(b"=")[1])
            except (OSError, StopIteration):
                continue
        raise AssertionError(f"no process holds the socket of port {port}")

    threading.Thread(target=accept, daemon=True).start()
    out = tmp_path / "out"
    tether = Path(agent_mod.__file__).parent.parent / "transport" / "tether.py"
    cmd = [*mpirun_prefix(3), sys.executable, "-P", str(tether), sys.executable, "-P", "-m", "ulfmtrain", "train",
           "--data", str(digits_dir), "--out", str(out), "--epochs", "3", "--model", "mlp", "--no-progress",
           "--kill", "2@20"]
    env = {**os.environ, "ULFMTRAIN_HEAD": f"127.0.0.1:{head.getsockname()[1]}",
           "ULFMTRAIN_KEEPALIVE": str(KEEPALIVE), link.SECRET_ENV: secret}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    finally:
        head.close()
    diag = proc.stdout[-1500:] + proc.stderr[-2500:]
    lines = [x for x in proc.stderr.splitlines() if " stopped: " in x]
    assert sorted(x.split("rank ")[1].split()[0] for x in lines) == ["0", "1"], diag
    assert all("the head node still counts rank(s) 2 that this side's repair removed" in x for x in lines), lines
    assert sorted(refused) == ["c 2", "c 2"], refused
    logs = read_rank_logs(out)
    for r in (0, 1):
        assert not {x["event"] for x in logs[r]} & {"recovery", "end"}, logs[r][-3:]
        assert max(x["step"] for x in logs[r] if x["event"] == "step") < 21
    assert not (out / "summary.json").exists()


# -- real ssh: the login directory, the host's own record of a cut, the ssh sessions --------------------------
def job_processes(ns: str) -> list[str]:
    """The command lines of the namespace host's processes, but its sshd daemon (which serves every login)."""
    procs = []
    for pid in signal_host(ns, "0"):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue                  # ended meanwhile
        if line and not (" -D -e -f " in line and "sshd" in line.split()[0]):
            procs.append(f"{pid} {line}")
    return procs


def cut_off(ns: str, within: float) -> tuple[float, float, list[str]]:
    """Cut every link of the namespace host; poll its job's processes until none is left or `within` seconds
    passed: (the time of the cut, the time polling ended, what was left)."""
    t_cut = time.time()
    links_down(ns)
    left = ["?"]
    while time.time() < t_cut + within and left:
        time.sleep(0.1)
        left = job_processes(ns)
    return t_cut, time.time(), left


def test_ssh_agent_launch_relative_paths_and_a_cut_host(ssh_hosts, digits_dir, tmp_path):
    """`launch --agent ssh` to real sshd: relative --data and --out work on every host, the head's too (the ranks
    start in the launching directory, not the login one).  Host b's link is cut: a's ranks go on within the bound;
    b's ranks stop with their lines in b's own log (its ssh channel is gone), and nothing of the job stays on b
    (its ssh sessions included) past the bound; launch exits 0."""
    hosts, rsh, _ = ssh_hosts
    a, b = list(hosts)
    hostfile = tmp_path / "one-each"           # a rank per host: the head's, and the one cut off
    hostfile.write_text(f"{a} slots=1\n{b} slots=1\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "digits").symlink_to(digits_dir)
    host_log = tmp_path / "host.log"          # the hosts share this machine's files: one log, lines by host
    proc = start_agent_job(hosts, rsh, hostfile, a, 2, "out", ["--epochs", "4"], "digits", cwd=work,
                           env={"ULFMTRAIN_HOST_LOG": str(host_log)})
    out = work / "out"
    reached = wait_for(lambda: steps_of(out, 0) >= 30, proc, 100)
    t_cut, t_gone, lingering = cut_off(hosts[b], KEEPALIVE + 4)
    diag = finished(proc, tmp_path)
    assert reached, "training never reached step 30: " + diag
    logs = read_rank_logs(out)
    starts = {r: next(x for x in recs if x["event"] == "start") for r, recs in logs.items()}
    assert [starts[r]["host"] for r in range(2)] == [a, b], diag
    check_survivors(logs, [0], [2, 1])
    assert proc.returncode == 0, diag
    detected = learned(next(x for x in logs[0] if x["event"] == "recovery")) - t_cut
    assert KEEPALIVE * 2 / 3 - 0.2 <= detected <= KEEPALIVE + 3, (detected, diag)
    assert not lingering, f"still on host {b} {t_gone - t_cut:.1f} s after the cut: {lingering}"
    lines = [x for x in host_log.read_text().splitlines() if f" on {b} stopped: " in x] if host_log.exists() else []
    assert [x.split("rank ")[1].split()[0] for x in lines] == ["1"], (lines, diag)
    assert all("no answer from the head node" in x for x in lines), lines
    print(f"\nssh, link of host b cut (keep-alive {KEEPALIVE:g} s): " + "; ".join(timings(logs, 0, t_cut))
          + f"; nothing of the job on b {t_gone - t_cut:.1f} s after the cut")


@pytest.mark.long
@pytest.mark.parametrize("keepalive", [2.0, 5.0, 10.0])
def test_ssh_cut_link_is_detected_within_the_bound(ssh_hosts, digits_dir, tmp_path, keepalive):
    """`launch --agent ssh --keepalive S`, host b's link cut: a's ranks learn of it between 2S/3 and S after the
    cut (plus PRRTE's notice), whichever of the agent and ssh gives up first (3 of 4 runs at S = 10 took
    10.6-10.9 s before), and nothing of the job stays on b past S."""
    hosts, rsh, hostfile = ssh_hosts
    a, b = list(hosts)
    out = tmp_path / "out"
    proc = start_agent_job(hosts, rsh, hostfile, a, 4, out, ["--epochs", "3"], digits_dir, keepalive=keepalive)
    reached = wait_for(lambda: steps_of(out, 0) >= 20, proc, 100)
    t_cut, t_gone, lingering = cut_off(hosts[b], keepalive + 3)
    diag = finished(proc, tmp_path)
    assert reached, "training never reached step 20: " + diag
    logs = read_rank_logs(out)
    check_survivors(logs, [0, 1], [4, 2])
    detected = learned(next(x for x in logs[0] if x["event"] == "recovery")) - t_cut
    print(f"\nssh --keepalive {keepalive:g}: detected {detected:.2f} s after the cut; nothing of the job on b "
          f"{t_gone - t_cut:.1f} s after it")
    assert keepalive * 2 / 3 - 0.2 <= detected <= keepalive + 0.5, (detected, diag)
    assert not lingering, f"still on host {b} {t_gone - t_cut:.1f} s after the cut: {lingering}"


# -- the normal launch: a lost host ends the job, and says so ---------------------------------------------------
def rank_processes(ns: str) -> list[str]:
    """The ranks of a train job still running on the namespace host (pid and command line).  (The test's
    directory is in every rank's command line, and its name has "launch" in it: match the command itself.)"""
    return [p for p in job_processes(ns) if " -m ulfmtrain train " in p]


def test_normal_launch_a_lost_host_ends_the_job_with_a_true_status(three_hosts, digits_dir, tmp_path):
    """A daemon on every host: host c loses power (its daemon with it), which PRRTE cannot survive (NODE_LOSS.md).
    launch ends with status 4 and one line that names c and suggests --agent, and the ranks of a (mpirun's host)
    and b are gone within 15 s.  (Before, launch exited 0; the review saw ranks run on for up to 10 s, here
    they were gone in 1.1-3.0 s: no bound tighter than the loop's, since the suite loads the machine.)"""
    hosts, agent, _ = three_hosts
    a, b, c = list(hosts)
    out, hostfile = tmp_path / "out", tmp_path / "one-each"
    hostfile.write_text(f"{a} slots=1\n{b} slots=1\n{c} slots=1\n")
    launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", "3", "--hostfile", str(hostfile),
              *[f"--mpirun-arg={x}" for x in daemon_args(agent)], "--",
              "train", "--data", str(digits_dir), "--out", str(out), "--epochs", "30", "--model", "mlp",
              "--no-progress"]
    inner = " ".join(f"'{x}'" for x in launch)
    proc = subprocess.Popen(["ip", "netns", "exec", hosts[a], "unshare", "--uts", "sh", "-c",
                             f"hostname {a}; exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reached = wait_for(lambda: steps_of(out, 0) >= 30, proc, 100)
    t_cut = time.time()
    power_cut(hosts, c)
    left = {"?": ["?"]}
    while time.time() < t_cut + 15 and any(left.values()):
        time.sleep(0.1)
        left = {h: rank_processes(hosts[h]) for h in (a, b)}
    t_gone = time.time()
    diag = finished(proc, tmp_path)
    assert reached, "training never reached step 30: " + diag
    print(f"\nnormal launch, host {c} lost: launch's status {proc.returncode}, the other hosts' ranks gone "
          f"{t_gone - t_cut:.1f} s after the cut")
    assert not any(left.values()), f"ranks still ran {t_gone - t_cut:.1f} s after the cut: {left}"
    lines = [x for x in diag.splitlines() if x.startswith("ulfmtrain: error: ")]
    assert proc.returncode == 4 and len(lines) == 1, diag
    assert f"host {c}" in lines[0] and "--agent" in lines[0], lines


@pytest.mark.long
@pytest.mark.parametrize("how", ["hostfile", "agent"])
def test_torchrun_variables_on_two_hosts(two_hosts, tmp_path, how):
    """An unchanged torchrun script (tests/scripts/ddp_torchrun.py: gloo, DDP) on 2 x 2 ranks: each rank gets
    RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE of its host (under the agent, its true locality, not
    Open MPI's), and MASTER_ADDR is rank 0's host; gloo's rendezvous there works and the replicas agree."""
    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out = tmp_path / "out"
    out.mkdir()
    how_args = ([f"--mpirun-arg={x}" for x in daemon_args(agent)] if how == "hostfile"
                else ["--agent", str(agent), "--net", f"{SUBNET}.0/24"])
    launch = [sys.executable, "-P", "-m", "ulfmtrain", "launch", "-n", "4", "--hostfile", str(hostfile), *how_args,
              "--", "python", str(Path(__file__).parents[1] / "scripts" / "ddp_torchrun.py"), str(out),
              "--epochs", "1"]
    inner = " ".join(f"'{x}'" for x in launch)
    proc = subprocess.run(["ip", "netns", "exec", hosts[a], "unshare", "--uts", "sh", "-c",
                           f"hostname {a}; exec {inner}"], capture_output=True, text=True, timeout=150)
    diag = proc.stdout[-2000:] + proc.stderr[-3000:]
    res = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert proc.returncode == 0 and sorted(res) == [0, 1, 2, 3], diag
    env = {r: x["env"] for r, x in res.items()}
    assert [env[r]["RANK"] for r in range(4)] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in env.values()} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in env.values()} == {"2"}
    assert sorted(env[r]["LOCAL_RANK"] for r in (0, 1)) == sorted(env[r]["LOCAL_RANK"] for r in (2, 3)) == ["0", "1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env.values()} == {(a, env[0]["MASTER_PORT"])}
    assert len({x["checksum"] for x in res.values()}) == 1


def test_agent_launch_evicts_a_hung_rank_on_another_host(two_hosts, digits_dir, tmp_path):
    """Rank 2, on host b, SIGSTOPped (its host and its tether run on): its agent on the head stops hearing from
    its hang watch while a's ranks wait for it, so the agents judge it hung after the bound and its agent dies by
    SIGKILL (the process Open MPI knows for it); the survivors repair and finish, and the tether, its link to the
    head closed, SIGKILLs the stopped rank.  Before, the peers' step watchdog ended them with status 3."""
    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out = tmp_path / "out"
    bound = 3.0
    proc = start_agent_job(hosts, agent, hostfile, a, 4, out, ["--epochs", "6", "--step-timeout", str(bound)],
                           digits_dir)
    assert wait_for(lambda: steps_of(out, 0) >= 30, proc, 100), "training never reached step 30"
    pid = next(x for x in read_rank_logs(out)[2] if x["event"] == "start")["pid"]
    assert str(pid) in signal_host(hosts[b], "0")           # the rank's own process, on host b
    t_stop = time.time()
    os.kill(pid, 19)                                        # SIGSTOP
    diag = finished(proc, tmp_path)
    logs = read_rank_logs(out)
    check_survivors(logs, [0, 1, 3], [4, 3])
    line = next((x for x in diag.splitlines() if "world rank 2 (pid" in x and "SIGKILLed" in x), None)
    assert line is not None and f"on {a})" in line, diag     # its agent, on the head, is what was killed
    detected = learned(next(x for x in logs[0] if x["event"] == "recovery")) - t_stop
    used = float(line.split("bound ")[1].split(" s")[0])
    assert bound - 0.5 <= detected <= used + 10, (detected, diag)
    assert not os.path.exists(f"/proc/{pid}"), "the stopped rank outlived its eviction"
    assert not [x for x in logs[2] if x["t"] > t_stop + 0.2]
    print(f"\nrank 2 on host b stopped (bound {used:g} s): " + "; ".join(timings(logs, 0, t_stop)))
