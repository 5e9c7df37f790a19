"""The mpirun command line that `launch` builds."""
import sys

import pytest

from ulfmtrain.launching.launch import mpirun_command, mpirun_head, mpirun_prefix, warm_start
from ulfmtrain.membership.spawn_shim import ADDRESS_ENV, ENABLE_ENV, PID_ENV


@pytest.fixture(autouse=True)
def cold(monkeypatch):
    """The commands as a user's launch builds them: no warm fork server named (the suite names its own)."""
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.delenv(PID_ENV, raising=False)


def test_a_named_fork_server_starts_the_ranks_it_can_run_as_its_forks(monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV, "/x/warm")
    train = [sys.executable, "-P", "-m", "ulfmtrain", "train"]
    shim = mpirun_command(2, ["train"], cores=8)[-10:-5]
    assert shim[:3] == [sys.executable, "-I", "-S"] and shim[3].endswith("spawn_shim.py") and shim[4] == "/x/warm"
    monkeypatch.setenv(PID_ENV, "123")          # the server's process, known: the shim checks it is the one there
    assert mpirun_command(2, ["train"], cores=8)[-12:-5][4:7] == ["--pid", "123", "/x/warm"]
    assert mpirun_command(2, ["train"], cores=8)[-5:] == train
    assert warm_start([sys.executable, "script.py"])[-2:] == [sys.executable, "script.py"]
    # What the server does not run, another host's ranks, and a disabled server: started from scratch.
    for cmd in ([sys.executable, "-c", "pass"], ["./my_program"], [sys.executable]):
        assert warm_start(cmd) == cmd
    assert mpirun_command(2, ["train"], hostfile="hosts")[-5:] == train and "/x/warm" not in mpirun_command(
        2, ["train"], hostfile="hosts")
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert warm_start(train) == train


def test_fault_tolerance_always_on():
    cmd = mpirun_command(2, ["train"], cores=8)[len(mpirun_head()) - 1:]      # from mpirun on
    assert cmd[1:3] == ["--with-ft", "ulfm"] and cmd[6:8] == ["-np", "2"]
    # Spawned jobs (respawn, reinit) recoverable too: a newcomer's death leaves mpirun's status alone.
    assert cmd[3:6] == ["--prtemca", "state_base_recoverable", "1"]
    assert cmd[-5:] == [sys.executable, "-P", "-m", "ulfmtrain", "train"]
    assert "--oversubscribe" not in cmd


def test_oversubscribed_ranks_yield():
    cmd = mpirun_command(8, ["train"], cores=2)
    assert "--oversubscribe" in cmd
    i = cmd.index("mpi_yield_when_idle")
    assert cmd[i - 1] == "--mca" and cmd[i + 1] == "1"


def test_hostfile_excludes_han():
    cmd = mpirun_command(16, ["train"], hostfile="hosts", cores=2)
    assert cmd[cmd.index("--hostfile") + 1] == "hosts"
    assert cmd[cmd.index("coll") + 1] == "^han"
    assert "--oversubscribe" not in cmd


def test_root_and_extra_args(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    cmd = mpirun_command(2, ["train"], mpirun_args=["--mca", "btl", "tcp,self"], cores=4)
    assert "--allow-run-as-root" in cmd
    assert cmd[cmd.index("btl") + 1] == "tcp,self"
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert "--allow-run-as-root" not in mpirun_command(2, ["train"], cores=4)


def test_plain_mpi_for_the_restart_baseline():
    cmd = mpirun_command(2, ["train"], cores=8, ft=False)[len(mpirun_head()) - 1:]
    assert "--with-ft" not in cmd and cmd[1:3] == ["-np", "2"]
    assert mpirun_prefix(2, cores=8) == mpirun_command(2, [], cores=8)[:-4]


def test_one_host_leaves_out_the_btl_that_sleeps_at_start(monkeypatch):
    # btl/ofi's close sleeps 1 s (Open MPI 5.0.x), and MPI_Init closes it wherever libfabric offers it
    # nothing: every process started, and every MPI_Comm_spawn, waited 1 s (bench_startup.py measures it).
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    cmd = mpirun_command(4, ["train"], cores=2)
    assert cmd[cmd.index("btl") - 1] == "--mca" and cmd[cmd.index("btl") + 1] == "^ofi"
    assert mpirun_command(4, ["train"], cores=2, ft=False).count("^ofi") == 1    # the restart baseline too


def test_a_btl_choice_of_the_user_is_kept(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    chosen = mpirun_command(2, ["train"], mpirun_args=["--mca", "btl", "tcp,self"], cores=4)
    assert chosen.count("btl") == 1 and chosen[chosen.index("btl") + 1] == "tcp,self"
    assert "^ofi" not in mpirun_command(16, ["train"], hostfile="hosts", cores=2)   # a cluster may need ofi
    monkeypatch.setenv("OMPI_MCA_btl", "self,sm,tcp")
    assert "^ofi" not in mpirun_command(2, ["train"], cores=4)


PRRTE_LOST = """#!/bin/sh
echo "a rank's output"
cat >&2 <<'END'
--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-head-1@0,0] on node head
  Remote daemon: [prterun-head-1@0,2] on node node7

This is usually due to either a failure of the TCP network
--------------------------------------------------------------------------
END
printf ' ' >&2
exit 0
"""


def test_a_job_prrte_ended_for_a_lost_host_ends_with_a_true_status_and_one_line(tmp_path, capfd):
    """mpirun exits 0 when PRRTE ends the job for a lost daemon: launch says which host, and exits 4."""
    from ulfmtrain.launching import lost_daemon, stopping

    mpirun = tmp_path / "mpirun"
    mpirun.write_text(PRRTE_LOST)
    mpirun.chmod(0o755)
    assert stopping.run("launch", [str(mpirun)]) == lost_daemon.LOST_HOST == 4
    out, err = capfd.readouterr()
    lines = [x for x in err.splitlines() if x.startswith("ulfmtrain: error:")]
    assert out == "a rank's output\n" and "PRTE has lost communication with a remote daemon." in err, err
    assert len(lines) == 1 and "host node7 was lost" in lines[0] and "launch with --agent" in lines[0], err
    mpirun.write_text("#!/bin/sh\necho 'an error' >&2\nexit 3\n")       # any other end: mpirun's own status
    assert stopping.run("launch", [str(mpirun)]) == 3 and capfd.readouterr().err == "an error\n"


def test_wdir_is_where_every_rank_starts(tmp_path, capfd):
    """--wdir on the normal launch (mpirun's own --wdir); under --agent the tether changes to it
    (tests/unit/test_tether.py)."""
    from ulfmtrain.cli import main

    assert main(["launch", "-n", "1", "--wdir", str(tmp_path), "--", "python", "-c",
                 "import os; print(os.getcwd())"]) == 0
    assert capfd.readouterr().out.splitlines()[-1] == str(tmp_path)
    # launch adopted its job's orphans while it ran, and stops once it returns: this process's later orphans (a
    # fork server's children in test_forkserver, run after this) are init's again, not zombies of the suite.
    from ulfmtrain.transport import jobtree

    assert jobtree.become_subreaper(False) is False


def test_one_host_keeps_tcp_on_loopback(monkeypatch):
    """A respawned process reaches the others over TCP: with a docker bridge beside eth0, Open MPI dropped every
    newcomer's connection (no join ever completed on such a host: tests/faults/test_respawn.py failed so).  On
    one host TCP stays on loopback; a hostfile's hosts and the user's own choice are left alone."""
    for var in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude"):
        monkeypatch.delenv(var, raising=False)
    cmd = mpirun_command(4, ["train"], cores=2)
    i = cmd.index("btl_tcp_if_include")
    assert cmd[i - 1] == "--mca" and cmd[i + 1] == "127.0.0.0/8"
    assert "btl_tcp_if_include" not in mpirun_command(4, ["train"], hostfile="hosts")
    mine = mpirun_command(4, ["train"], cores=2, mpirun_args=["--mca", "btl_tcp_if_exclude", "docker0"])
    assert "btl_tcp_if_include" not in mine
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "eth0")
    assert "btl_tcp_if_include" not in mpirun_command(4, ["train"], cores=2)


def test_a_script_without_ulfmtrain_is_not_started_as_a_fork(tmp_path, monkeypatch):
    """The suite's warm fork server gives its forks ulfmtrain's exit protocol; a script that does not use
    ulfmtrain (an unchanged torchrun script) starts as itself: forked, a rank that ended first waited 5 s for
    its peers, died by SIGKILL, and they hung in gloo (test_ddp's unchanged-torchrun test, once in a full run)."""
    from ulfmtrain.launching.launch import warm_start
    from ulfmtrain.membership import spawn_shim

    monkeypatch.setenv(spawn_shim.ADDRESS_ENV, str(tmp_path / "server"))
    monkeypatch.delenv(spawn_shim.ENABLE_ENV, raising=False)
    plain, ours = tmp_path / "plain.py", tmp_path / "ours.py"
    plain.write_text('"""Runs under `python -m ulfmtrain launch` too."""\nimport torch.distributed as dist\n')
    ours.write_text("import ulfmtrain\n")
    assert warm_start([sys.executable, "-P", str(plain)]) == [sys.executable, "-P", str(plain)]
    assert warm_start([sys.executable, "-P", str(ours)])[-3:] == [sys.executable, "-P", str(ours)]
    assert "spawn_shim" in " ".join(warm_start([sys.executable, "-P", str(ours)]))
    assert "spawn_shim" in " ".join(warm_start([sys.executable, "-P", "-m", "ulfmtrain", "train"]))
