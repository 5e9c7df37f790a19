"""Slurm: the hosts of an allocation, and `launch --agent slurm` (each rank started by srun on its node).

Which path, and why (docs/node-loss.md, "Slurm"):

- `launch` inside an allocation without `--agent` writes the allocation's nodes and task counts as a hostfile
  and runs mpirun on it; mpirun's own Slurm launcher (PRRTE's plm/slurm) then starts one PRRTE daemon per
  node with srun, so no ssh is needed and Slurm tracks and cleans up every process.  A node lost with its
  daemon ends that job (PRRTE 3.0.x); `supervise` relaunches inside the allocation on the nodes still up.
- `launch --agent slurm` keeps mpirun's only daemon on the head (the batch host) and starts each rank as a
  one-task job step of its own on its node: `srun --overlap -N1 -n1 -w NODE --no-kill ...`, through the exec
  agent of `launch --agent` (agent.py) as ssh would.  No daemon runs on the nodes that can fail, so a lost
  node costs only its ranks, which the others survive in place.  Direct launch of the ranks with srun is not
  an option: ULFM is supported under mpirun only.

This file runs by path as the agent's remote command (`python -P slurm.py HOST CMD`: srun for ssh), in a
process that PRRTE started; so, like agent.py, it imports the standard library only.
"""
from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

JOB_ENV = "SLURM_JOB_ID"
AGENT = "slurm"                       # `launch --agent slurm`
# mpirun under `--agent slurm`: its one daemon on the head, every rank mapped there (the agent moves it).
# PRRTE's Slurm components would read the allocation's slots per node and start daemons on the nodes.
AGENT_MPIRUN_ARGS = ("--prtemca", "ras", "^slurm", "--prtemca", "plm", "^slurm")
SLURMD_PORT = 6818                    # Slurm's default SlurmdPort
PR_SET_PDEATHSIG = 1


class SlurmError(ValueError):
    """An allocation that cannot be used as asked (one line that names the fix)."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list syntax expanded, in order: `node[01-03,07],gpu1` -> node01 node02 node03 node07 gpu1.

    Several bracket groups in one name multiply (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); a range keeps its
    zero padding.  What `scontrol show hostnames` prints, without asking the controller.
    """
    names: list[str] = []
    for item in _split_top(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], text))
            elif "[" in part or "]" in part:
                raise SlurmError(f"node list {text!r}: unbalanced brackets")
            else:
                choices.append([part])
        names += ["".join(c) for c in itertools.product(*choices)]
    if not names or any(not n for n in names):
        raise SlurmError(f"node list {text!r} names no node")
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SlurmError(f"node list {text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"node list {text!r}: unbalanced brackets")
    return [*out, text[start:]]


def _expand_ranges(spec: str, text: str) -> list[str]:
    out = []
    for r in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", r.strip())
        if not m:
            raise SlurmError(f"node list {text!r}: {r!r} is not a number or a range like 01-04")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmError(f"node list {text!r}: range {r!r} runs backwards")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_counts(text: str) -> list[int]:
    """Slurm's per-node counts expanded: `2(x3),1` -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise SlurmError(f"task counts {text!r}: {item!r} is not a count like 2 or 2(x3)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


@dataclass(frozen=True)
class Allocation:
    """The nodes of a Slurm job and the tasks it may run on each, in Slurm's order."""

    job_id: str
    nodes: tuple[str, ...]
    slots: tuple[int, ...]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Allocation | None:
        """The allocation this process runs in (sbatch, salloc, srun), or None outside Slurm."""
        job = environ.get(JOB_ENV)
        if not job:
            return None
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        counts = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE")
        if not nodelist or not counts:
            raise SlurmError(f"Slurm job {job} without SLURM_JOB_NODELIST or SLURM_TASKS_PER_NODE: run inside "
                             "sbatch or salloc, or pass --hostfile")
        nodes, slots = expand_hostlist(nodelist), expand_counts(counts)
        if len(nodes) != len(slots):
            raise SlurmError(f"Slurm job {job}: {len(nodes)} nodes ({nodelist}) but {len(slots)} task counts "
                             f"({counts})")
        return cls(job, tuple(nodes), tuple(slots))

    def hostfile(self, exclude: Iterable[str] = ()) -> str:
        """`NODE slots=K` per node, in the allocation's order, the excluded ones left out."""
        gone = set(exclude)
        return "".join(f"{n} slots={k}\n" for n, k in zip(self.nodes, self.slots) if n not in gone)

    def ranks(self, n: int | None, spares: int) -> int:
        """How many training ranks to start: n, or every slot but the spares' when n is None.

        Ranks fill the slots node by node; the spares are the last ranks, so they sit on the last slots.
        """
        total = sum(self.slots)
        n = total - spares if n is None else n
        if n < 1 or n + spares > total:
            raise SlurmError(f"Slurm job {self.job_id} has {total} task slots on {len(self.nodes)} node(s), "
                             f"not enough for {n} rank(s) and {spares} spare(s): ask sbatch/salloc for more "
                             "tasks (--ntasks-per-node), or lower -n or --spares")
        return n


@dataclass(frozen=True)
class LaunchPlan:
    """What launch runs: the training ranks, the hostfile, the agent's remote command, mpirun's extra
    arguments and the cluster network (--net)."""

    ranks: int
    hostfile: str | None
    rsh: str | None
    mpirun_args: list[str]
    net: str | None


def resolve(n: int | None, spares: int, hostfile: str | None, agent: str | None, net: str | None,
            directory: str, environ: Mapping[str, str] = os.environ) -> LaunchPlan:
    """launch's ranks, hosts and agent, from the allocation where there is one.

    Inside an allocation with no --hostfile, the hosts and slots are the allocation's (a hostfile written to
    `directory`), and an agent's --net defaults to the network that connects this host to the nodes.
    `--agent slurm` needs an allocation.  Elsewhere everything is as given.
    """
    alloc = Allocation.from_env(environ)
    if agent == AGENT and alloc is None:
        raise SlurmError("--agent slurm starts each rank with srun: run launch inside sbatch or salloc "
                         "(SLURM_JOB_ID is not set), or give --agent ssh")
    rsh = agent_rsh(srun_options(config())) if agent == AGENT else agent
    extra = list(AGENT_MPIRUN_ARGS) if agent and alloc else []
    if alloc is None or hostfile:
        if n is None:
            raise SlurmError("launch needs -n N (the number of training ranks) outside a Slurm allocation")
        return LaunchPlan(n, hostfile, rsh, extra, net)
    ranks = alloc.ranks(n, spares)
    path = os.path.join(directory, "hostfile")
    with open(path, "w") as f:
        f.write(alloc.hostfile())
    if agent and net is None:
        net = network_to(alloc.nodes)
    return LaunchPlan(ranks, path, rsh, extra, net)


def network_to(nodes: Iterable[str]) -> str:
    """The network (CIDR) of this host's address on its route to the first of `nodes` that is not itself:
    where the ranks reach the head (`ip -o -4 addr`)."""
    names = list(nodes)
    here = socket.gethostname().split(".")[0]
    node = next((x for x in names if x.split(".")[0] != here), names[0])
    fix = "pass --net CIDR, the network that connects the nodes"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((node, 9))      # UDP: picks the route, sends nothing
            addr = s.getsockname()[0]
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"cannot tell the network from this host to node {node} ({exc}): {fix}") from None
    for m in re.finditer(r"\binet (\S+)/(\d+)", out):
        if m.group(1) == addr:
            return str(ipaddress.ip_network(f"{addr}/{m.group(2)}", strict=False))
    raise SlurmError(f"this host reaches node {node} from {addr}, on no interface `ip addr` shows: {fix}")


def config() -> dict[str, str]:
    """Slurm's configuration as the controller reports it (`scontrol show config`); empty if it cannot."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^(\w+)\s*=(.*)$", out, re.M)}


def srun_options(conf: Mapping[str, str]) -> list[str]:
    """srun options that depend on the cluster: --cpu-bind=none where a task plugin binds (overlapping one-task
    steps can all be given the same first CPU of their node); where none binds, srun warns about it per rank."""
    plugins = conf.get("TaskPlugin", "task/none")
    return [] if plugins in ("", "(null)", "task/none") else ["--cpu-bind=none"]


def srun_command(node: str, options: Iterable[str] = ()) -> list[str]:
    """srun for one rank on `node`: a one-task step of its own inside the allocation.

    --overlap: the steps of the ranks share the allocation's CPUs (each would otherwise wait for a free one);
    --no-kill: a node that fails takes only its own steps; --mpi=none: no PMI of Slurm's beside mpirun's PMIx
    (the rank's PMIX_ variables come from the head).
    """
    return ["srun", "--overlap", "-N1", "-n1", "-w", node, "--no-kill", "--mpi=none", "--quiet",
            "--job-name=ulfmtrain-rank", *options]


def agent_rsh(options: Iterable[str] = ()) -> str:
    """What `launch --agent slurm` gives the exec agent for ssh: this file run by path, with srun's options
    (`RSH HOST CMD`)."""
    return shlex.join([sys.executable, "-P", os.path.abspath(__file__), *options])


def remote(options: list[str], host: str, command: str) -> None:
    """The agent's `RSH HOST CMD`: run the shell command CMD on HOST as a job step of its own.

    srun dies with the agent (PR_SET_PDEATHSIG): an agent SIGKILLed for a lost node must not leave an srun
    waiting on the head for a node that never answers (mpirun waits for its output to close).  The rank on
    a node that still lives is stopped by its tether when the link to the agent closes.
    """
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:        # the agent died before the line above: nothing to run for
        os.kill(os.getpid(), signal.SIGKILL)
    argv = [*srun_command(host, options), "sh", "-c", command]
    os.execvp(argv[0], argv)


def slurmd_port(conf: Mapping[str, str]) -> int:
    return int(conf.get("SlurmdPort", SLURMD_PORT))


def node_is_up(node: str, port: int, timeout: float = 1.0) -> bool:
    """Whether the node's slurmd answers: a node that cannot start a job step (slurmd gone, node silent) is down.

    Unlike a probe of the ssh port, a refused connection means down: the node lives, but Slurm cannot run
    anything on it.
    """
    try:
        with socket.create_connection((node, port), timeout=timeout):
            return True
    except OSError:
        return False


def down_in_slurm(nodes: Iterable[str]) -> set[str]:
    """The nodes that Slurm itself holds down, drained, failing or not responding (`sinfo`); empty if unknown."""
    names = list(nodes)
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %t"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    bad = set()
    for line in out.splitlines():
        node, _, state = line.partition(" ")
        # sinfo's short states: "*" not responding, down, drain(ed/ing), fail(ing), power-down, unknown...
        if state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(("down", "drain", "drng", "fail", "pow",
                                                                         "unk", "maint", "boot", "inval")):
            bad.add(node)
    return bad


def live_nodes(alloc: Allocation, excluded: set[str], is_up: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """The allocation's nodes that can run job steps now, and those that cannot (Slurm holds them down, or
    their slurmd does not answer).  `excluded` grows by the latter: a node lost once stays out for the rest
    of the job, even if it answers again (it may fail again, and Slurm may be restarting it)."""
    candidates = [n for n in alloc.nodes if n not in excluded]
    held = down_in_slurm(candidates) if candidates else set()
    dead = [n for n in candidates if n in held or not is_up(n)]
    excluded.update(dead)
    return [n for n in candidates if n not in dead], dead


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print("usage: slurm.py [SRUN-OPTION ...] HOST COMMAND (the exec agent's remote command under "
              "`launch --agent slurm`)", file=sys.stderr)
        sys.exit(2)
    remote(sys.argv[1:-2], sys.argv[-2], sys.argv[-1])
