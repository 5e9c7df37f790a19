"""ulfmtrain under a real Slurm (slurmctld, one slurmd per namespace host; conftest.py builds it): jobs
submitted with sbatch and salloc train inside their allocation, survive a rank and a node lost, relaunch
with supervise, and stop when cancelled.

Each test prints its figures (detection times: docs/node-loss.md, "Slurm").  `make test-slurm` runs them.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs

# The multi-host tests' judges of a survived run (one replica, the world's history; the audit), shared.
_spec = importlib.util.spec_from_file_location("test_multihost", Path(__file__).parents[1] / "faults" /
                                               "test_multihost.py")
assert _spec is not None and _spec.loader is not None
_multihost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_multihost)
check_survivors, audit_ok = _multihost.check_survivors, _multihost.audit_ok

pytestmark = [pytest.mark.slurm, pytest.mark.faults, pytest.mark.timeout(300)]
KEEPALIVE = 3.0                       # the keep-alive bound the agent launches use (as test_multihost.py)
ULFM = [sys.executable, "-P", "-m", "ulfmtrain"]


def train(digits_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(digits_dir), "--out", str(out), "--model", "mlp", "--no-progress", *extra]


def batch_script(cluster, *cmd: str) -> str:
    """A batch script that runs cmd and records its exit status (the job may outlive it: a dead node's steps)."""
    return (f"#!/bin/sh\n{shlex.join(cmd)}\necho $? > {cluster.root}/status\n")


def status(cluster) -> int | None:
    path = cluster.root / "status"
    return int(path.read_text()) if path.exists() and path.read_text().strip() else None


def steps_of(out: Path, rank: int) -> int:
    logs = read_rank_logs(out) if out.exists() else {}
    return sum(x["event"] == "step" for x in logs.get(rank, []))


def training_reached(cluster, out: Path, step: int, timeout: float = 150) -> bool:
    """Wait until rank 0 has logged `step` steps; False if the job's script ended first, or after timeout."""
    wait_for(lambda: steps_of(out, 0) >= step or status(cluster) is not None, timeout)
    return steps_of(out, 0) >= step


def wait_for(cond, timeout: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.05)
    return False


def diag(cluster) -> str:
    """The job's output and the Slurm daemons' last lines, for assertion messages."""
    parts = []
    logs = [p.name for p in cluster.root.glob("ulfmtrain-*.out")]        # the example script's output
    for name in ["job.out", *logs, "slurmctld.log", *(f"slurmd-{n}.log" for n in cluster.nodes)]:
        p = cluster.root / name
        if p.exists():
            parts.append(f"--- {name}\n{p.read_text()[-2500:]}")
    return "\n".join(parts)


def starts(logs: dict) -> dict[int, str]:
    return {r: next(x for x in recs if x["event"] == "start")["host"] for r, recs in logs.items()}


def detected(logs: dict, rank: int, t_fault: float) -> float:
    """Seconds from the fault to the moment the survivor learned of it (its failed attempt, or the commit agree)."""
    rec = next(x for x in logs[rank] if x["event"] == "recovery")
    return rec["wall_error"] + rec["commit_agree_ms"] / 1e3 - t_fault


def no_job_left(cluster, timeout: float, nodes=None) -> dict[str, list[str]]:
    """Wait until no process of a job is left on the nodes (and the login node); return what is left."""
    left: dict[str, list[str]] = {}

    def gone() -> bool:
        nonlocal left
        left = cluster.job_processes(nodes)
        return not left
    wait_for(gone, timeout)
    return left


def netns_agent(cluster) -> Path:
    """The namespace agent of test_multihost.py for the Slurm nodes: `AGENT NODE CMD` runs CMD on NODE
    without Slurm (ip netns exec), for detection times next to `--agent slurm` on the same hosts."""
    agent = cluster.root / "netns-agent.sh"
    cases = "\n".join(f"  {n}) ;;" for n in cluster.nodes)
    agent.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n  *) exit 1;;\nesac\n'
                     'exec setsid ip netns exec $host unshare --uts sh -c "hostname $host; $*"'
                     f' 2>>{cluster.root}/$host.err\n')
    agent.chmod(0o755)
    return agent


def agent_launch(cluster, agent: str, *rest: str) -> list[str]:
    which = "slurm" if agent == "slurm" else str(netns_agent(cluster))
    return [*ULFM, "launch", "--agent", which, "--net", f"{cluster.subnet}.0/24", "--keepalive", str(KEEPALIVE),
            *rest]


# -- inside the allocation -----------------------------------------------------
def test_launch_takes_the_allocation_and_a_spare_takes_a_killed_ranks_slot(slurm_cluster, digits_dir):
    """sbatch -N2 --ntasks-per-node=2: `launch --spares 1` with no -n runs 3 training ranks and a spare on the
    allocation's 4 slots (mpirun's own Slurm launcher starts its daemon on the second node with srun); rank 1
    is SIGKILLed, the spare takes its slot, and every record is seen once per epoch."""
    c = slurm_cluster
    out = c.root / "out"
    job = c.sbatch(batch_script(c, *ULFM, "launch", "--spares", "1", "--",
                                *train(digits_dir, out, "--epochs", "3", "--audit", "--kill", "1@30")),
                   "-N2", "--ntasks-per-node=2", "--no-kill", "-o", str(c.root / "job.out"))
    info = c.wait_job(job, 200)
    assert info["JobState"] == "COMPLETED" and status(c) == 0, (info, diag(c))
    logs = read_rank_logs(out)                # one log per slot (a training rank's place)
    n1, n2 = c.nodes
    hosts = {r: [x["host"] for x in recs if x["event"] == "start"] for r, recs in logs.items()}
    # Slot 1 began on node 1, then the spare (the 4th rank, on the allocation's last slot: node 2) took it.
    assert hosts == {0: [n1], 1: [n1, n2], 2: [n2]}, diag(c)
    end = check_survivors(logs, [0, 1, 2], [3, 3])
    assert end["alive"] == [0, 1, 2]
    audit_ok(out)
    assert not no_job_left(c, 10)


# -- what the design relies on: Slurm's --no-kill ---------------------------------------------
@pytest.mark.parametrize("no_kill", [True, False])
def test_a_failed_node_ends_the_job_unless_it_was_allocated_no_kill(slurm_cluster, no_kill):
    """Two one-task steps (one per node, as --agent slurm starts ranks) and node 2 marked down: with --no-kill
    only node 2's step ends and the job runs on; without it Slurm ends the whole job (why the example scripts
    and docs allocate with --no-kill)."""
    c = slurm_cluster
    n1, n2 = c.nodes
    steps = " & ".join(f"srun --overlap -N1 -n1 -w {n} --no-kill --mpi=none sh -c 'echo up > {c.root}/{n}; "
                       f"sleep 120'" for n in (n1, n2))
    job = c.sbatch(f"#!/bin/sh\n{steps}\nwait\n", "-N2", *(["--no-kill"] if no_kill else []),
                   "-o", str(c.root / "job.out"))
    assert wait_for(lambda: all((c.root / n).exists() for n in c.nodes), 60), diag(c)
    c.run("scontrol", "update", f"nodename={n2}", "state=down", "reason=failed in the test")
    time.sleep(3)
    info = c.job(job)
    if no_kill:
        assert info["JobState"] == "RUNNING", info
        assert any("sleep 120" in p for p in c.job_processes([n1]).get(n1, [])), "node 1's step was ended"
        c.run("scancel", job)
    else:
        assert info["JobState"] in ("NODE_FAIL", "CANCELLED", "FAILED", "PENDING", "REQUEUED"), info
        left = no_job_left(c, 15, [n1])
        assert not any("sleep 120" in p for procs in left.values() for p in procs), left


# -- node loss with --agent slurm (and the namespace agent, for its detection times) --------------------------
@pytest.mark.parametrize("agent", ["slurm", "netns"])
def test_agent_launch_survives_a_nodes_slurmd_and_ranks_killed(slurm_cluster, digits_dir, agent):
    """Every process of node 2 (its slurmd, its job steps, its ranks) SIGKILLed mid-training: node 1's
    ranks train on with one replica and an exact audit, and the batch script ends 0."""
    c = slurm_cluster
    n1, n2 = c.nodes
    out = c.root / "out"
    job = c.sbatch(batch_script(c, *agent_launch(c, agent, "--", *train(digits_dir, out, "--epochs", "6",
                                                                         "--audit"))),
                   "-N2", "--ntasks-per-node=2", "--no-kill", "-o", str(c.root / "job.out"))
    assert training_reached(c, out, 30), "training never reached step 30: " + diag(c)
    t_kill = time.time()
    c.kill_node(n2)
    # Slurm learns of it too (here at once, as a node health check would say; else after SlurmdTimeout): the
    # job, allocated with --no-kill, is not ended with the node.
    c.run("scontrol", "update", f"nodename={n2}", "state=down", "reason=killed by the test")
    assert wait_for(lambda: status(c) is not None, 150), diag(c)
    assert status(c) == 0, diag(c)
    logs = read_rank_logs(out)
    assert starts(logs) == {0: n1, 1: n1, 2: n2, 3: n2}, diag(c)
    check_survivors(logs, [0, 1], [4, 2])
    audit_ok(out)
    info = c.wait_job(job, 30, ("COMPLETING", "COMPLETED"))     # the script wrote its status just before it ended
    assert info["JobState"] in ("COMPLETING", "COMPLETED"), info
    assert c.node_states()[n2].startswith("down"), c.node_states()
    assert not no_job_left(c, 15, [n1]), "a process of the job outlived it on node 1"
    print(f"\n{agent} agent, node {n2} killed (slurmd and ranks): detected "
          f"{detected(logs, 0, t_kill):.2f} s after the kill")


@pytest.mark.parametrize("agent", ["slurm", "netns"])
def test_agent_launch_survives_a_cut_link(slurm_cluster, digits_dir, agent):
    """Node 2's link cut (`ip link set DEV down`): node 1's ranks go on after the keep-alive bound; node 2's
    ranks stop (their tethers lose the head), and no rank is left running there."""
    c = slurm_cluster
    n1, n2 = c.nodes
    out = c.root / "out"
    c.sbatch(batch_script(c, *agent_launch(c, agent, "--", *train(digits_dir, out, "--epochs", "6", "--audit"))),
             "-N2", "--ntasks-per-node=2", "--no-kill", "-o", str(c.root / "job.out"))
    assert training_reached(c, out, 30), "training never reached step 30: " + diag(c)
    t_cut = time.time()
    c.cut_link(n2)
    assert wait_for(lambda: status(c) is not None, 150), diag(c)
    assert status(c) == 0, diag(c)
    logs = read_rank_logs(out)
    check_survivors(logs, [0, 1], [4, 2])
    audit_ok(out)
    took = detected(logs, 0, t_cut)
    assert KEEPALIVE * 2 / 3 - 0.2 <= took <= KEEPALIVE + 3, (took, diag(c))    # only the keep-alive tells
    left = no_job_left(c, 2 * KEEPALIVE + 10, [n2])
    assert not any("python" in p for procs in left.values() for p in procs), left
    print(f"\n{agent} agent, link of node {n2} cut (keep-alive {KEEPALIVE:g} s): detected {took:.2f} s after the cut")


# -- supervise inside the allocation ----------------------------------------------
def test_supervise_relaunches_on_the_live_nodes_after_a_node_loss(slurm_cluster, digits_dir):
    """supervise in an sbatch job (no -n, no hostfile: the allocation's 4 slots); node 2 killed past a
    checkpoint ends the attempt (a PRRTE daemon lost); supervise finds node 2's slurmd gone, leaves it out,
    and resumes from the checkpoint with 2 ranks on node 1."""
    c = slurm_cluster
    n1, n2 = c.nodes
    out, ckpt = c.root / "out", c.root / "ckpt"
    job = c.sbatch(batch_script(c, *ULFM, "supervise", "--max-attempts", "3", "--timeout", "150", "--",
                                *train(digits_dir, out, "--epochs", "6", "--recovery", "shrink", "--ckpt-dir",
                                       str(ckpt), "--ckpt-every", "20")),
                   "-N2", "--ntasks-per-node=2", "--no-kill", "-o", str(c.root / "job.out"))
    first = out / "attempt-1"
    assert training_reached(c, first, 45), "training never reached step 45: " + diag(c)
    t_kill = time.time()
    c.kill_node(n2)
    assert wait_for(lambda: status(c) is not None, 200), diag(c)
    assert status(c) == 0, diag(c)
    sup = json.loads((out / "supervisor.json").read_text())
    assert [x["ranks"] for x in sup["attempts"]] == [4, 2] and sup["completed"], sup
    joblog = (c.root / "job.out").read_text()
    assert f"hosts down, left out: {n2}" in joblog, diag(c)
    assert starts(read_rank_logs(first)) == {0: n1, 1: n1, 2: n2, 3: n2}
    logs = read_rank_logs(out / "attempt-2")
    assert set(starts(logs).values()) == {n1}
    resume = next(x for x in logs[0] if x["event"] == "resume")
    written = [x["step"] for x in read_rank_logs(first)[0] if x["event"] == "checkpoint_written"]
    assert resume["step"] >= 40 and resume["step"] in written, (resume, written)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 6
    assert c.job(job)["JobState"] in ("COMPLETING", "COMPLETED", "RUNNING")
    second = sup["attempts"][1]
    first_step = next(x for x in logs[0] if x["event"] == "step")["t"]
    print(f"\nsupervise, node {n2} killed: attempt 1 ended {sup['attempts'][0]['t_exit'] - t_kill:.2f} s after, "
          f"probe {second['t_launch'] - sup['attempts'][0]['t_exit']:.2f} s, relaunch to the first step "
          f"{first_step - second['t_launch']:.2f} s")


# -- requeue ------------------------------------------------------------------------
@pytest.mark.timeout(480)
def test_a_requeued_batch_job_resumes_from_its_checkpoint(slurm_cluster, digits_dir):
    """The example batch script requeued mid-training (`scontrol requeue`, as Slurm does after a preemption or
    the batch node's loss): Slurm ends it and runs the script again under the same job id, which finds its
    checkpoint and resumes from it (Slurm holds a requeued job back for about its credential lifetime:
    cred_expire, 30 s here, 120 s by default)."""
    c = slurm_cluster
    out = c.root / "out"
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
    env = {"PYTHON": sys.executable, "DATA": str(digits_dir), "OUT": str(out), "EPOCHS": "4",
           "TRAIN_ARGS": "--model mlp --ckpt-every 20"}
    job = c.sbatch(script, "-N2", "--ntasks-per-node=2", env=env)
    latest = out / "ckpt" / "latest"
    assert wait_for(lambda: latest.exists() and json.loads(latest.read_text())["step"] >= 40, 200), diag(c)
    c.run("scontrol", "requeue", job)
    info = c.wait_job(job, 400, ("COMPLETED", "FAILED", "CANCELLED"))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, diag(c))
    events = read_rank_logs(out)[0]              # both runs log to OUT: the script keeps it under the job id
    resumes = [x for x in events if x["event"] == "resume"]
    written = [x["step"] for x in events if x["event"] == "checkpoint_written"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 40 and resumes[0]["step"] in written, (resumes, written)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 4
    t_requeue = max(x["t"] for x in events if x["event"] == "step" and x["t"] < resumes[0]["t"])
    print(f"\nrequeue: resumed from step {resumes[0]['step']}, {resumes[0]['t'] - t_requeue:.0f} s after the last "
          "step before it")


# -- stopping ------------------------------------------------------------------------
def test_scancel_stops_every_process_of_the_job(slurm_cluster, digits_dir):
    """The example batch script (examples/slurm/train.sbatch, as a user submits it, on 2 nodes of 2 tasks,
    --net left to launch): it trains on the allocation's slots with a spare; scancel then stops it: within
    seconds nothing of it runs on any node or on the login node, and Slurm records it CANCELLED."""
    c = slurm_cluster
    out = c.root / "out"
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
    env = {"PYTHON": sys.executable, "DATA": str(digits_dir), "OUT": str(out), "TRAIN_ARGS": "--model mlp"}
    job = c.sbatch(script, "-N2", "--ntasks-per-node=2", env=env)
    assert wait_for(lambda: steps_of(out, 0) >= 20, 150), "training never reached step 20: " + diag(c)
    logs = read_rank_logs(out)
    assert sorted(logs) == [0, 1, 2] and set(starts(logs).values()) == set(c.nodes), diag(c)   # and a spare
    assert (c.root / f"ulfmtrain-{job}.out").exists()      # where the script says the output goes
    t0 = time.monotonic()
    c.run("scancel", job)
    left = no_job_left(c, 30)
    took = time.monotonic() - t0
    assert not left, left
    info = c.wait_job(job, 30)
    assert info["JobState"] == "CANCELLED", info
    assert not any(x["event"] == "end" for recs in read_rank_logs(out).values() for x in recs)
    print(f"\nscancel: every process of the job gone {took:.1f} s after it")


def test_ctrl_c_on_salloc_stops_every_process(slurm_cluster, digits_dir):
    """The example salloc script (examples/slurm/train-salloc.sh) at a terminal (a pseudo-terminal: salloc
    gives the command the foreground), then Ctrl-C typed there: within seconds nothing of the job runs
    anywhere, the allocation is released, and salloc's status says the command was interrupted."""
    c = slurm_cluster
    out = c.root / "out"
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train-salloc.sh"
    env = {"PYTHON": sys.executable, "DATA": str(digits_dir), "OUT": str(out), "NODES": "2", "TASKS_PER_NODE": "2",
           "EPOCHS": "20", "TRAIN_ARGS": "--model mlp", "SALLOC_DEBUG": "1"}
    # script(1) runs salloc on a terminal of its own and passes what we write to it as typed keys.
    proc = c.popen(["script", "-qefc", str(script), "/dev/null"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, cwd=c.root, env={**c.env, **env})
    try:
        assert training_reached(c, out, 20), "training never reached step 20: " + diag(c)
        t0 = time.monotonic()
        assert proc.stdin is not None
        proc.stdin.write(b"\x03")             # Ctrl-C
        proc.stdin.flush()
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
    left = no_job_left(c, 30)
    took = time.monotonic() - t0
    assert not left, (left, output[-3000:])
    # launch ends its job and exits 130 on SIGINT, which salloc passes on; a launch that dies by the SIGINT
    # itself (Python's default) makes salloc exit 0, as it does for any command a user interrupted: both are
    # "interrupted at the terminal" (salloc -v, SALLOC_DEBUG=1, says which).
    assert proc.returncode == 130 or (proc.returncode == 0 and "terminated by signal 2" in output), \
        (proc.returncode, output[-3000:])
    # Released: slurmctld passes the job through COMPLETING (CG) first, for a moment (seen once, 7 s after start).
    end = time.monotonic() + 30
    while (held := c.run("squeue", "-h").stdout.strip()) and time.monotonic() < end:
        time.sleep(0.5)
    released = time.monotonic() - t0
    assert not held, f"the allocation is still held 30 s on: {held}"
    assert not any(x["event"] == "end" for recs in read_rank_logs(out).values() for x in recs)
    print(f"\nCtrl-C on salloc: status {proc.returncode}, every process gone {took:.1f} s after it, the allocation "
          f"released {released:.1f} s after it")
