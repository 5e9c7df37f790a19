"""A real Slurm on network-namespace hosts: munged, slurmctld, and one slurmd per host.

Each compute node is a network namespace with its own hostname and address on one bridge; the bridge's own
namespace is the login node and holds slurmctld.  Node names resolve through /etc/netns/NS/hosts (what `ip
netns exec` mounts over /etc/hosts), as a cluster's names do.  munged runs on this machine with a socket of
its own.  Everything the fixture made is removed after the test, whether it passed or not: processes,
namespaces, the hosts files, Slurm's state and spool directories.  Traffic stays on the namespaces' bridge.

Slurm cannot run here (not root, no Slurm, no namespaces): every test skips with one line.  `make test-slurm`
installs Slurm where it can (apt-get as root) and runs these tests.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SUBNET = "10.214.0"                   # the bridge's network; test_multihost.py uses 10.213.0
LOGIN_ADDR = f"{SUBNET}.254"          # the login node: slurmctld, sbatch, salloc
NEEDED = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "salloc", "srun", "scontrol", "ip", "unshare",
          "nsenter")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "Slurm's test cluster needs root (network namespaces, slurmd)"
    gone = [d for d in NEEDED if not shutil.which(d)]
    if gone:
        return f"{', '.join(gone)} not installed (`make test-slurm` installs Slurm and munge with apt-get)"
    return None


def sh(*cmd: str, ns: str | None = None) -> str:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    return subprocess.run(full, check=True, capture_output=True, text=True, timeout=30).stdout


def ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def signal_ns(ns: str, sig: int) -> list[int]:
    """Send sig to every process of the namespace (by pid); return the pids signalled."""
    done = []
    for pid in ns_pids(ns):
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


def links_down(ns: str) -> None:
    """Every link of the namespace but loopback down: it neither sends nor answers."""
    out = sh("ip", "-o", "link", "show", ns=ns)
    for name in (line.split(":")[1].strip().split("@")[0] for line in out.splitlines()):
        if name != "lo":
            sh("ip", "link", "set", name, "down", ns=ns)


class Cluster:
    """The test's Slurm: nodes (name -> address), the login namespace, and what it takes to use them."""

    def __init__(self, root: Path, n: int) -> None:
        self.root = root
        tag = f"u{os.getpid() % 100000}"
        self.login = f"{tag}login"
        self.prefix = f"{tag}n"
        self.nodes = {f"{self.prefix}{i + 1:02d}": f"{SUBNET}.{i + 1}" for i in range(n)}
        self.state = root / "state"       # Slurm's state and spool, munge's key and socket
        self.conf = self.state / "slurm.conf"
        # (not the suite's fork server: its address is this machine's)
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("ULFMTRAIN_")},
                    "SLURM_CONF": str(self.conf)}
        self.subnet = SUBNET
        self.procs: list[subprocess.Popen] = []
        self.slurmd: dict[str, subprocess.Popen] = {}

    # -- building and tearing down -------------------------------------------
    def build(self) -> None:
        """The namespaces (the login node's made already), munged, slurmctld and the slurmds; nodes idle."""
        sh("ip", "link", "add", "br0", "type", "bridge", ns=self.login)
        sh("ip", "addr", "add", f"{LOGIN_ADDR}/24", "dev", "br0", ns=self.login)
        sh("ip", "link", "set", "br0", "up", ns=self.login)
        sh("ip", "link", "set", "lo", "up", ns=self.login)
        for node, addr in self.nodes.items():
            sh("ip", "netns", "add", node)
            veth, peer = f"v{node}", f"p{node}"      # 10 characters: interface names hold 15
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", veth, "netns", node)
            sh("ip", "link", "set", peer, "netns", self.login)
            sh("ip", "link", "set", peer, "master", "br0", ns=self.login)
            sh("ip", "link", "set", peer, "up", ns=self.login)
            sh("ip", "addr", "add", f"{addr}/24", "dev", veth, ns=node)
            sh("ip", "link", "set", veth, "up", ns=node)
            sh("ip", "link", "set", "lo", "up", ns=node)
        hosts = f"127.0.0.1 localhost\n{LOGIN_ADDR} {self.login}\n" + "".join(
            f"{a} {n}\n" for n, a in self.nodes.items())
        for ns in [self.login, *self.nodes]:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)
        self.state.mkdir(parents=True)
        self.state.chmod(0o700)
        key = self.state / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.munge_socket = self.state / "munge.socket"
        self._start(["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={self.state / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                     f"--seed-file={self.state / 'munged.seed'}"])
        self.conf.write_text(self.slurm_conf())
        self._start(["ip", "netns", "exec", self.login, "unshare", "--uts", "sh", "-c",
                     f"hostname {self.login}; exec slurmctld -D -i -f {self.conf}"])
        for node in self.nodes:
            self.start_slurmd(node)
        self.wait_idle(60)

    def slurm_conf(self) -> str:
        st = self.state
        nodes = "".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs=2 State=UNKNOWN\n"
                        for n, a in self.nodes.items())
        return f"""ClusterName=ulfmtest
SlurmctldHost={self.login}({LOGIN_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=30
StateSaveLocation={st}/ctld
SlurmdSpoolDir={st}/spool-%n
SlurmctldPidFile={st}/slurmctld.pid
SlurmdPidFile={st}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
KillWait=5
MinJobAge=600
InactiveLimit=0
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{Path(cmd[0]).name}-{len(self.procs)}.out", "w")
        proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start_slurmd(self, node: str) -> None:
        """slurmd -N NODE in the node's namespace, under its hostname, with the node's /etc/hosts.

        Entered with nsenter rather than `ip netns exec`, which mounts a /sys of its own where no cgroup
        file system is mounted: slurmd 22.05 will not start without one."""
        (self.state / f"spool-{node}").mkdir(exist_ok=True)
        self.slurmd[node] = self._start(
            ["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "--mount", "sh", "-c",
             f"mount --bind /etc/netns/{node}/hosts /etc/hosts && hostname {node} && "
             f"exec slurmd -D -N {node} -f {self.conf}"])

    def teardown(self) -> None:
        for ns in [*self.nodes, self.login]:     # slurmd, slurmstepd, the jobs, slurmctld, salloc/sbatch
            for _ in range(3):
                if not signal_ns(ns, signal.SIGKILL):
                    break
                time.sleep(0.2)
        for proc in self.procs:                  # munged, and what the namespaces no longer hold
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for ns in [*self.nodes, self.login]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)

    # -- using it --------------------------------------------------------------
    def run(self, *cmd: str, timeout: float = 60, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A command on the login node (sbatch, scontrol, scancel, ...), with env added to the environment."""
        return subprocess.run(["ip", "netns", "exec", self.login, *cmd], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """A process on the login node (salloc, a launch there), in a session of its own."""
        kw.setdefault("env", self.env)
        return subprocess.Popen(["ip", "netns", "exec", self.login, *cmd], start_new_session=True, **kw)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines())

    def wait_idle(self, timeout: float) -> None:
        t0 = time.monotonic()
        states: dict[str, str] = {}
        while time.monotonic() - t0 < timeout:
            try:
                states = self.node_states()
            except subprocess.CalledProcessError:
                states = {}
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm's nodes never came up idle within {timeout:g} s: {states}; "
                           f"see {self.root}/slurmctld.log")

    def sbatch(self, script: str | Path, *opts: str, env: dict[str, str] | None = None) -> str:
        """Submit a batch script (its text, or a file) with sbatch's options and env; return the job id."""
        if isinstance(script, str):
            path = self.root / f"job-{len(list(self.root.glob('job-*.sh')))}.sh"
            path.write_text(script)
            script = path
        out = self.run("sbatch", "--parsable", f"--chdir={self.root}", *opts, str(script), env=env).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_job(self, job_id: str, timeout: float, states: tuple[str, ...] = ("COMPLETED", "FAILED",
                 "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        """The job once it is in one of `states` (by default, ended), or as it is after timeout seconds."""
        t0 = time.monotonic()
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states or time.monotonic() - t0 > timeout:
                return info
            time.sleep(0.3)

    def job_processes(self, nodes=None) -> dict[str, list[str]]:
        """What runs of jobs on the nodes (all by default) and the login node: every process but Slurm's daemons."""
        left = {}
        for ns in [*(nodes or self.nodes), self.login]:
            procs = []
            for pid in ns_pids(ns):
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                except OSError:
                    continue
                if comm not in ("slurmd", "slurmctld", "slurmscriptd"):
                    procs.append(f"{pid} {line}")
            if procs:
                left[ns] = procs
        return left

    def kill_node(self, node: str) -> None:
        """SIGKILL every process of the node, its slurmd first (so that no probe finds it answering)."""
        os.kill(self.slurmd[node].pid, signal.SIGKILL)
        for _ in range(3):
            if not signal_ns(node, signal.SIGKILL):
                break

    def cut_link(self, node: str) -> None:
        links_down(node)


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two Slurm nodes of two CPUs each (namespace hosts), a login node with slurmctld, and munged."""
    why = missing()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = Cluster(tmp_path, 2)
    try:
        try:
            subprocess.run(["ip", "netns", "add", cluster.login], check=True, capture_output=True, timeout=30)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"no Slurm here: cannot create network namespaces ({exc.stderr.decode().strip()})")
        cluster.build()
        yield cluster
    finally:
        cluster.teardown()
