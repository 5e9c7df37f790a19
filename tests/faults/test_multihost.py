"""Two hosts on one machine (network namespaces with their own hostnames), TCP between them:
every rank of one host is SIGKILLed and the other host's ranks train on.

The hosts are created by this test and removed after it; no traffic leaves them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ulfmtrain.events import read_rank_logs

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]
SUBNET = "10.213.0"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"ulfm{os.getpid() % 100000}"
    bridge, hosts = f"{tag}br", {f"{SUBNET}.1": f"{tag}a", f"{SUBNET}.2": f"{tag}b"}
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
        # mpirun's "ssh HOST CMD": run CMD in HOST's namespace, under HOST as hostname.
        agent = tmp_path / "agent.sh"
        cases = "\n".join(f"  {a}) ns={n};;" for a, n in hosts.items())
        agent.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n  *) exit 1;;\nesac\n'
                         'exec ip netns exec $ns unshare --uts sh -c "hostname $host; $*"\n')
        agent.chmod(0o755)
        hostfile = tmp_path / "hosts"
        hostfile.write_text("".join(f"{a} slots=2\n" for a in hosts))
        yield hosts, agent, hostfile
    finally:
        for ns in [*hosts.values(), bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def power_cut(ns: str) -> list[str]:
    """Every process of the namespace host SIGKILLed and its links down: it neither runs nor answers."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], capture_output=True)
    links = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True, text=True).stdout
    for name in (line.split(":")[1].strip().split("@")[0] for line in links.splitlines()):
        if name != "lo":
            subprocess.run(["ip", "-n", ns, "link", "set", name, "down"], capture_output=True)
    return pids


def test_losing_every_rank_of_a_host(two_hosts, digits_dir, tmp_path):
    hosts, agent, hostfile = two_hosts
    first = next(iter(hosts))
    out = tmp_path / "out"
    extra = ["--prtemca", "plm_ssh_agent", str(agent), "--mca", "btl", "tcp,self",
             "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24", "--prtemca", "oob_tcp_if_include", f"{SUBNET}.0/24"]
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

    from ulfmtrain.audit import audit_logs

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
    rec = [x for x in logs[0] if x["event"] == "recovery"]
    parts = ("detect_ms", "commit_agree_ms", "revoke_ms", "shrink_ms", "agree_ms", "redo_ms")
    print(f"\nhost {b} killed: " + ", ".join(f"{k[:-3]} {rec[0][k]:.1f} ms" for k in parts)
          + f", total {sum(rec[0][k] for k in parts):.1f} ms")


def test_supervise_drops_a_dead_host_and_resumes(two_hosts, digits_dir, tmp_path):
    """A daemon on every host: a host lost with its daemon ends the job; supervise --hostfile probes the
    hosts, relaunches on the one that answers, resumes from the checkpoint and finishes."""
    import time

    hosts, agent, hostfile = two_hosts
    a, b = list(hosts)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    extra = ["--prtemca", "plm_ssh_agent", str(agent), "--mca", "btl", "tcp,self",
             "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24", "--prtemca", "oob_tcp_if_include", f"{SUBNET}.0/24"]
    cmd = [sys.executable, "-P", "-m", "ulfmtrain", "supervise", "-n", "4", "--hostfile", str(hostfile),
           "--probe-port", "9", "--max-attempts", "3", "--timeout", "120", *[f"--mpirun-arg={x}" for x in extra],
           "--", "train", "--data", str(digits_dir), "--out", str(out), "--epochs", "6", "--model", "mlp",
           "--no-progress", "--recovery", "shrink", "--ckpt-dir", str(ckpt), "--ckpt-every", "20"]
    inner = " ".join(f"'{x}'" for x in cmd)
    proc = subprocess.Popen(["ip", "netns", "exec", hosts[a], "unshare", "--uts", "sh", "-c",
                             f"hostname {a}; exec {inner}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, killed = time.monotonic(), []
    first = out / "attempt-1"
    while time.monotonic() - t0 < 100 and proc.poll() is None and not killed:
        logs = read_rank_logs(first) if first.exists() else {}
        if sum(x["event"] == "step" for x in logs.get(0, [])) >= 45:     # past the step-40 checkpoint
            killed = power_cut(hosts[b])
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
    assert resume["step"] >= 40 and resume["ckpt_world"] == 4 and resume["world"] == 2
    assert json.loads((out / "summary.json").read_text())["epochs"] == 6
