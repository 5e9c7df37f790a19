"""The exec agent of a launch with no daemon on the hosts that can fail (`launch --agent RSH`).

mpirun and its one PRRTE daemon run on the head host, and believe every rank
runs there.  PRRTE forks this agent in place of each rank (`odls_base_exec_agent`);
it looks up the rank's host, starts the rank there through RSH (`ssh` on a
cluster; a network-namespace shell in the tests) under the tether
(ulfmtrain/transport/tether.py), with the PMIx environment forwarded, the true
per-host local rank and size, and the launching directory, and watches the
tether's keep-alive link.  The link is authenticated (transport/link.py): the
job's secret comes in this process's environment and goes to the tether on the
remote shell's standard input; a connection that does not prove it is dropped
with one line, and no input, however malformed, ends the agent.

When the rank or its host is lost (the rank killed, the host silent for the
keep-alive bound, the link closed), the agent **dies by a signal**: Open MPI
5.0.x's ULFM layer is told of a process killed by a signal, not of one that
exits non-zero without finalizing, and the survivors would hang.  While it
lives it holds a lock: survivors ask, before they commit a repair, that the
head still counts them and no longer counts the ranks they removed (no split
brain; see tether.py).

PRRTE runs this file by path, not as `-m ulfmtrain.launching.agent`: importing the
package in a process that PRRTE started would initialize MPI in it.  So it
imports the standard library only, and the link's module from its file.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import math
import os
import select
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn

if not __package__:                    # run by path: the link from its folder, not from the package
    sys.path.append(str(Path(__file__).resolve().parent.parent / "transport"))
link = import_module("..transport.link" if __package__ else "link", __package__)
board = import_module("..transport.board" if __package__ else "board", __package__)   # standard library only

PLAN_ENV = "ULFMTRAIN_AGENT_PLAN"     # {"rsh", "hosts", "net", "keepalive", "tether", "dir", "wdir"}
FORWARD = ("PMIX_", "OMPI_", "PRTE_", "ULFMTRAIN_", "OPAL_")
CALLBACK_TIMEOUT = 60.0               # the remote start (ssh, Python) until the tether calls back
REPORT_GRACE = 1.0                    # the remote shell ended: how long its tether's report may lag (never
                                      # past the keep-alive deadline)
PENDING = 8                           # connections at once still to prove the secret: the oldest is dropped
NOTES = 5                             # lines about dropped connections and messages, at most
PROG = "ulfmtrain agent"


def head_address(host: str, net: str) -> str:
    """This host's address toward `host` (the route the kernel picks), checked to lie in the cluster network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))          # UDP: picks the route, sends nothing
        addr = s.getsockname()[0]
    if ipaddress.ip_address(addr) not in ipaddress.ip_network(net, strict=False):
        raise ValueError(f"the head reaches {host} from {addr}, outside --net {net}: name the network "
                         "that connects the hosts")
    return addr


def remote_shell(rsh: list[str], keepalive: float) -> list[str]:
    """The command that runs a command line on a host (`RSH HOST LINE`): RSH as given; ssh with its own
    keep-alives derived from the bound, so that it gives up about when the agent does."""
    if not rsh or Path(rsh[0]).name != "ssh":
        return rsh
    interval = max(1, round(keepalive / 3))
    count = max(1, int(keepalive // interval))   # ssh gives up after about interval * count s of silence
    return [rsh[0], "-o", f"ServerAliveInterval={interval}", "-o", f"ServerAliveCountMax={count}",
            "-o", f"ConnectTimeout={max(1, math.ceil(keepalive))}", *rsh[1:]]


def rank_command(plan: dict, rank: int, app: list[str], environ: dict[str, str],
                 head: str | None = None) -> list[str]:
    """RSH HOST 'env K=V ... [TETHER] APP': the rank's command line, run on its host.

    head (ADDR:PORT) is where the rank's tether calls back; without it the
    rank runs bare (no keep-alive: the unit tests of the command line).  The
    job's secret is never part of it (ps shows command lines).
    """
    hosts = plan["hosts"]
    host = hosts[rank]
    on_host = [r for r, h in enumerate(hosts) if h == host]
    env = {k: v for k, v in environ.items() if k.startswith(FORWARD) and k not in (PLAN_ENV, link.SECRET_ENV)}
    # Open MPI sees every rank on the head node: the true locality travels in our own variables.
    env.update(ULFMTRAIN_LOCAL_RANK=str(on_host.index(rank)), ULFMTRAIN_LOCAL_SIZE=str(len(on_host)),
               ULFMTRAIN_HOST=host)
    tether: list[str] = []
    if head is not None:
        env.update(ULFMTRAIN_HEAD=head, ULFMTRAIN_KEEPALIVE=str(plan["keepalive"]))
        if plan.get("wdir"):
            env.update(ULFMTRAIN_WDIR=plan["wdir"])
        tether = list(plan["tether"])
    remote = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())), *tether, *app])
    return [*remote_shell(plan["rsh"], float(plan["keepalive"])), host, remote]


def lock_path(directory: str, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}.lock"


def agent_alive(directory: str, rank: int) -> bool:
    """Whether rank's agent still lives: it holds its lock file until it dies (no pid to be reused)."""
    try:
        fd = os.open(lock_path(directory, rank), os.O_RDWR)
    except FileNotFoundError:
        return False                  # never started, or its launch is gone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                  # releases the lock if we took it


_remote: subprocess.Popen | None = None    # the remote shell (the ssh client): it dies with the agent


def die(why: str) -> NoReturn:
    """One line on stderr, then SIGKILL: the only way out that ULFM survivors are told of.  The remote shell goes
    first: an ssh client to a silent host would hold mpirun's output pipes until it gave up."""
    print(f"{PROG}: {why}", file=sys.stderr, flush=True)
    if _remote is not None:
        _remote.kill()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


_noted = [0]


def note(why: str) -> None:
    """One line for a connection or message dropped; NOTES of them at most (a stranger can send many)."""
    _noted[0] += 1
    if _noted[0] <= NOTES:
        more = "; further ones are not reported" if _noted[0] == NOTES else ""
        print(f"{PROG}: {why}{more}", file=sys.stderr, flush=True)


class Watch:
    """The head end of one rank's keep-alive link: echoes pings, answers confirms, notes the end."""

    def __init__(self, plan: dict, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.keepalive = float(plan["keepalive"])
        self.host = plan["hosts"][rank]
        self.link: Any = None         # a link.Link, once the tether proved the job's secret
        self.confirms: list[tuple[float, list[int]]] = []   # (deadline, removed ranks) not yet answered
        self.exit_code: int | None = None                    # the rank's status, once the tether reports it
        # The tether's messages, by kind (a new kind is one entry): a ping, a repair to confirm (c R,R), the
        # rank killed by a signal, the rank exited (x STATUS),
        # h ROW (its hang watch's row), u TICKS (its CPU time).
        self.handlers = {"p": lambda _: self.send("p"), "c": self.confirm, "k": self.killed, "x": self.exited,
                         "h": self.hang_row, "u": self.cpu_time}
        # The rank's hang watch rows (hangs.py), written on the head's board as this agent's: a hung rank is
        # evicted by killing its agent, the process Open MPI knows (board.py).
        self.board = board.Board(plan["dir"])
        self.row: dict | None = None
        self.identity = (os.getpid(), board.start_time(os.getpid()), socket.gethostname())
        self.cpu = 0          # the rank's CPU time (clock ticks) as its tether last reported it

    def send(self, line: str) -> None:
        self.link.send(line)

    def feed(self, data: bytes) -> int:
        """Handle the tether's messages; one that fails its check, or that no handler takes, is dropped.  The
        number of messages that passed the check (each a sign of life)."""
        lines, bad = self.link.feed(data)
        for line in lines:
            kind, _, arg = line.partition(" ")
            try:
                if kind not in self.handlers:
                    raise ValueError("a kind the agent does not know")
                self.handlers[kind](arg)
            except ValueError as exc:
                bad.append(f"{line[:40]!r} ({exc})")
        for why in bad:
            note(f"rank {self.rank}: dropped a message of its tether: {why}")
        return len(lines)

    def hang_row(self, arg: str) -> None:
        self.row = board.relay(self.board, arg, *self.identity, self.cpu)

    def cpu_time(self, arg: str) -> None:
        self.cpu = int(arg)
        if self.row is not None:      # the rank ran (or not) since its last row: the board says so
            self.row["cpu_now"] = max(self.cpu, self.row["cpu"])
            self.board.write(self.row)

    def judge_hangs(self) -> None:
        """While the rank's row is fresh, judge the board for it (board.judge): evict hung ranks' agents; when
        nobody comes, end (its tether then ends the rank) with status 3."""
        if self.row is None or time.monotonic() - self.row["mono"] > 1.0:
            return
        if self.row["state"] != "wait" and not self.row.get("straggler"):
            return                    # a rank that works reads nobody's rows
        line = board.judge(self.board, self.row)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            sys.exit(3)

    def confirm(self, arg: str) -> None:
        removed = [int(r) for r in arg.split(",") if r]
        self.confirms.append((time.monotonic() + self.keepalive, removed))

    def killed(self, _arg: str) -> None:
        die(f"rank {self.rank} on {self.host} was killed by a signal")

    def exited(self, arg: str) -> None:
        code = int(arg)
        if not 0 <= code <= 255:
            raise ValueError("not an exit status")
        self.exit_code = code

    def drain(self, until: float) -> None:
        """Read the link until the tether's exit report, its end, or the monotonic time `until`."""
        while self.link is not None and self.exit_code is None and time.monotonic() < until:
            ready, _, _ = select.select([self.link.sock], [], [], max(0.0, until - time.monotonic()))
            if not ready:
                return
            try:
                data = self.link.sock.recv(4096)
            except OSError:
                return
            if not data:
                return
            self.feed(data)

    def answer_confirms(self) -> None:
        """ok once every rank the repair removed has lost its agent (within the keep-alive bound), else no."""
        pending = []
        for deadline, removed in self.confirms:
            alive = [r for r in removed if agent_alive(self.plan["dir"], r)]
            if not alive:
                self.send("c ok")
            elif time.monotonic() >= deadline:
                self.send("c no " + ",".join(map(str, alive)))
            else:
                pending.append((deadline, removed))
        self.confirms = pending


class Door:
    """The agent's listening socket, open until its tether proves the job's secret: a connection that does not
    (a stranger, a port scan, garbage) is dropped with one line, and the rank is none the worse."""

    def __init__(self, addr: str, secret: str, rank: int, sel: selectors.BaseSelector) -> None:
        self.secret, self.rank, self.sel = secret, rank, sel
        self.listener = socket.create_server((addr, 0))
        self.address = "{}:{}".format(*self.listener.getsockname()[:2])
        self.pending: dict[socket.socket, tuple[Any, str]] = {}     # connection -> (link.Greeting, its peer)
        sel.register(self.listener, selectors.EVENT_READ, "accept")

    def accept(self) -> None:
        conn, peer = self.listener.accept()
        try:
            self.pending[conn] = (link.Greeting(conn, self.secret, self.rank), "{}:{}".format(*peer[:2]))
        except OSError:
            conn.close()
            return
        self.sel.register(conn, selectors.EVENT_READ, "greet")
        if len(self.pending) > PENDING:
            self.drop(next(iter(self.pending)), f"over {PENDING} connections at once")

    def greet(self, conn: socket.socket) -> Any:
        """Take what a pending connection sent; its link.Link once it proved the secret (the door then closes)."""
        if conn not in self.pending:
            return None               # dropped earlier in this batch of events
        greeting, _ = self.pending[conn]
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        try:
            done = greeting.feed(data)
        except (link.LinkError, OSError) as exc:
            self.drop(conn, str(exc))
            return None
        if done is not None:
            self.sel.unregister(conn)
            del self.pending[conn]
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for other in list(self.pending):
                self.drop(other, "it had not proved the job's secret when the rank's tether did")
            self.sel.unregister(self.listener)
            self.listener.close()
        return done

    def expire(self) -> float:
        """Drop the connections whose time to prove the secret is up; the next such deadline (monotonic)."""
        now = time.monotonic()
        for conn, (greeting, _) in list(self.pending.items()):
            if greeting.deadline <= now:
                self.drop(conn, f"it did not prove the job's secret within {link.HANDSHAKE_TIMEOUT:g} s")
        return min((g.deadline for g, _ in self.pending.values()), default=math.inf)

    def drop(self, conn: socket.socket, why: str) -> None:
        _, peer = self.pending.pop(conn)
        self.sel.unregister(conn)
        conn.close()
        note(f"rank {self.rank}: dropped a connection from {peer}: {why}")


def main(app: list[str]) -> None:
    """Run the rank on its host under its tether; leave with its status, or by SIGKILL if it or its host was lost."""
    global _remote
    plan = json.loads(os.environ[PLAN_ENV])
    rank = int(os.environ["PMIX_RANK"])
    secret = os.environ.get(link.SECRET_ENV, "")
    if not secret:
        sys.exit(f"{PROG}: rank {rank}: no job secret in ${link.SECRET_ENV}: start the job with "
                 "`ulfmtrain launch --agent`")
    lock = os.open(lock_path(plan["dir"], rank), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process dies
    w = Watch(plan, rank)
    sel = selectors.DefaultSelector()
    door = Door(head_address(w.host, plan["net"]), secret, rank, sel)
    env = {k: v for k, v in os.environ.items() if k != link.SECRET_ENV}     # it goes on standard input
    _remote = child = subprocess.Popen(rank_command(plan, rank, app, env, door.address), env=env,
                                       stdin=subprocess.PIPE)
    link.hand_secret(child.stdin, secret)
    # mpirun ending the job (SIGTERM): pass it on, to the rank too.  The loop sends the tether its message, not the
    # handler (which could come in the middle of another send).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _frame: child.send_signal(sig))
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    sel.register(os.pidfd_open(child.pid), selectors.EVENT_READ, "child")
    # mpirun, our parent: gone (launch SIGKILLed, mpirun with it), the job is over; our link closes with us.
    sel.register(os.pidfd_open(os.getppid()), selectors.EVENT_READ, "mpirun")
    t_start = last = time.monotonic()
    while True:
        deadline = t_start + CALLBACK_TIMEOUT if w.link is None else last + w.keepalive
        wait = min(deadline, door.expire()) - time.monotonic()
        wait = min(wait, 0.25)        # the hang board's turn
        if w.confirms:
            wait = min(wait, 0.02)    # polling the removed ranks' locks
        for key, _ in sel.select(max(0.0, wait)):
            if key.data == "mpirun":
                child.kill()
                os.kill(os.getpid(), signal.SIGKILL)
            if key.data == "child":
                rc = child.wait()
                # The tether's report travels apart from the shell's exit: wait for it a moment, never past the
                # keep-alive deadline (ssh giving up on a silent host must not stretch the bound).
                w.drain(min(time.monotonic() + REPORT_GRACE, last + w.keepalive if w.link else math.inf))
                if w.exit_code is not None:
                    sys.exit(w.exit_code)
                # No word from the tether on how the rank ended (ssh lost, the tether never started,
                # the host's processes killed): the rank is lost, and only a signal tells the survivors.
                die(f"rank {rank} on {w.host}: its remote shell ended with status {rc} before the rank "
                    "reported its exit (host lost, or the remote start failed: see the host's stderr)")
            elif key.data == "signal":
                os.read(wake_r, 64)
                if w.link is not None:
                    w.send("t")
            elif key.data == "accept":
                door.accept()
            elif key.data == "greet":
                w.link = door.greet(key.fileobj)       # type: ignore[arg-type]
                if w.link is not None:
                    sel.register(w.link.sock, selectors.EVENT_READ, "link")
                    last = time.monotonic()
            else:
                try:
                    data = w.link.sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(w.link.sock)
                    if w.exit_code is None:
                        die(f"rank {rank} on {w.host}: the keep-alive link closed (host or tether lost)")
                    finish(child, w.exit_code, w.keepalive)
                if w.feed(data):
                    last = time.monotonic()
        w.answer_confirms()
        w.judge_hangs()
        now = time.monotonic()
        if w.link is None and now >= t_start + CALLBACK_TIMEOUT:
            die(f"rank {rank} on {w.host}: no call back from its tether to {door.address} within "
                f"{CALLBACK_TIMEOUT:g} s (can the host reach the head on --net? is ulfmtrain installed there at "
                "the same path?)")
        if w.link is not None and now - last > w.keepalive:
            die(f"rank {rank} on {w.host}: no keep-alive for {w.keepalive:g} s (link cut, host frozen or down): "
                "rank lost")


def finish(child: subprocess.Popen, code: int, grace: float) -> None:
    """The rank exited with `code`: let the remote shell end (bounded), then exit with the rank's status."""
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        child.kill()
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
