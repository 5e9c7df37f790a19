"""The exec agent of a launch with no daemon on the hosts that can fail (`launch --agent RSH`).

mpirun and its one PRRTE daemon run on the head host, and believe every rank
runs there.  PRRTE forks this agent in place of each rank (`odls_base_exec_agent`);
it looks up the rank's host, starts the rank there through RSH (`ssh` on a
cluster; a network-namespace shell in the tests) under the tether
(ulfmtrain/transport/tether.py), with the PMIx environment forwarded and the true
per-host local rank and size, and watches the tether's keep-alive link.

When the rank or its host is lost (the rank killed, the host silent for the
keep-alive bound, the link closed), the agent **dies by a signal**: Open MPI
5.0.x's ULFM layer is told of a process killed by a signal, not of one that
exits non-zero without finalizing, and the survivors would hang.  While it
lives it holds a lock: survivors ask, before they commit a repair, that the
head still counts them and no longer counts the ranks they removed (no split
brain; see tether.py).

PRRTE runs this file by path, not as `-m ulfmtrain.launching.agent`: importing the
package in a process that PRRTE started would initialize MPI in it.  So it
imports the standard library only.
"""
from __future__ import annotations

import fcntl
import importlib.util
import ipaddress
import json
import os
import select
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import NoReturn

PLAN_ENV = "ULFMTRAIN_AGENT_PLAN"     # {"rsh", "hosts", "net", "keepalive", "tether", "dir"}
FORWARD = ("PMIX_", "OMPI_", "PRTE_", "ULFMTRAIN_", "OPAL_")
CALLBACK_TIMEOUT = 60.0               # the remote start (ssh, Python) until the tether calls back
REPORT_GRACE = 1.0                    # the remote shell ended: how long its tether's report may lag
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


def rank_command(plan: dict, rank: int, app: list[str], environ: dict[str, str],
                 head: str | None = None) -> list[str]:
    """RSH HOST 'env K=V ... [TETHER] APP': the rank's command line, run on its host.

    head (ADDR:PORT) is where the rank's tether calls back; without it the
    rank runs bare (no keep-alive: the unit tests of the command line).
    """
    hosts = plan["hosts"]
    host = hosts[rank]
    on_host = [r for r, h in enumerate(hosts) if h == host]
    env = {k: v for k, v in environ.items() if k.startswith(FORWARD) and k != PLAN_ENV}
    # Open MPI sees every rank on the head node: the true locality travels in our own variables.
    env.update(ULFMTRAIN_LOCAL_RANK=str(on_host.index(rank)), ULFMTRAIN_LOCAL_SIZE=str(len(on_host)),
               ULFMTRAIN_HOST=host)
    tether: list[str] = []
    if head is not None:
        env.update(ULFMTRAIN_HEAD=head, ULFMTRAIN_KEEPALIVE=str(plan["keepalive"]))
        tether = list(plan["tether"])
    remote = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())), *tether, *app])
    return [*plan["rsh"], host, remote]


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


def _load_board() -> types.ModuleType:
    """The hang board (ulfmtrain/transport/board.py, standard library only), loaded by path: importing the
    package would initialize MPI in this process."""
    path = Path(__file__).resolve().parent.parent / "transport" / "board.py"
    spec = importlib.util.spec_from_file_location("ulfmtrain_board", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


board = _load_board()


def die(why: str) -> NoReturn:
    """One line on stderr, then SIGKILL: the only way out that ULFM survivors are told of."""
    print(f"{PROG}: {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


class Watch:
    """The head end of one rank's keep-alive link: echoes pings, answers confirms, notes the end."""

    def __init__(self, plan: dict, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.keepalive = float(plan["keepalive"])
        self.host = plan["hosts"][rank]
        self.conn: socket.socket | None = None
        self.buf = b""
        self.confirms: list[tuple[float, list[int]]] = []   # (deadline, removed ranks) not yet answered
        self.exit_code: int | None = None                    # the rank's status, once the tether reports it
        # The rank's hang watch rows (hangs.py), written on the head's board as this agent's: a hung rank is
        # evicted by killing its agent, the process Open MPI knows (board.py).
        self.board = board.Board(plan["dir"])
        self.row: dict | None = None
        self.identity = (os.getpid(), board.start_time(os.getpid()), socket.gethostname())
        self.cpu = 0          # the rank's CPU time (clock ticks) as its tether last reported it

    def send(self, line: str) -> None:
        assert self.conn is not None
        try:
            self.conn.sendall(line.encode() + b"\n")
        except OSError:
            pass                      # the link is gone: the next read says so

    def feed(self, data: bytes) -> None:
        """Handle the tether's lines: p (ping), c R,R (confirm a repair), k (rank killed), x N (rank exited),
        h ROW (the rank's hang watch), u TICKS (the rank's CPU time)."""
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            word, _, arg = line.decode().partition(" ")
            if word == "p":
                self.send("p")
            elif word == "c":
                removed = [int(r) for r in arg.split(",") if r]
                self.confirms.append((time.monotonic() + self.keepalive, removed))
            elif word == "k":
                die(f"rank {self.rank} on {self.host} was killed by a signal")
            elif word == "x":
                self.exit_code = int(arg)
            elif word == "h":
                self.row = board.relay(self.board, arg, *self.identity, self.cpu)
            elif word == "u":
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

    def drain(self, timeout: float) -> None:
        """Read the link until the tether's exit report, its end, or timeout."""
        end = time.monotonic() + timeout
        while self.conn is not None and self.exit_code is None and time.monotonic() < end:
            ready, _, _ = select.select([self.conn], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return
            try:
                data = self.conn.recv(4096)
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


def main(app: list[str]) -> None:
    """Run the rank on its host under its tether; leave with its status, or by SIGKILL if it or its host was lost."""
    plan = json.loads(os.environ[PLAN_ENV])
    rank = int(os.environ["PMIX_RANK"])
    lock = os.open(lock_path(plan["dir"], rank), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process dies
    w = Watch(plan, rank)
    listener = socket.create_server((head_address(w.host, plan["net"]), 0))
    head = "{}:{}".format(*listener.getsockname()[:2])
    child = subprocess.Popen(rank_command(plan, rank, app, dict(os.environ), head))

    def forward(sig: int, _frame: object) -> None:   # mpirun ending the job: pass it on, to the rank too
        child.send_signal(sig)
        if w.conn is not None:
            w.send("t")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(os.pidfd_open(child.pid), selectors.EVENT_READ, "child")
    t_start = last = time.monotonic()
    while True:
        now = time.monotonic()
        if w.conn is None:
            deadline = t_start + CALLBACK_TIMEOUT
        else:
            deadline = last + w.keepalive
        wait = min(deadline - now, 0.25)    # the hang board's turn
        if w.confirms:
            wait = min(wait, 0.02)    # polling the removed ranks' locks
        for key, _ in sel.select(max(0.0, wait)):
            if key.data == "child":
                rc = child.wait()
                w.drain(REPORT_GRACE)     # the tether's report travels apart from the shell's exit
                if w.exit_code is not None:
                    sys.exit(w.exit_code)
                # No word from the tether on how the rank ended (ssh lost, the tether never started,
                # the host's processes killed): the rank is lost, and only a signal tells the survivors.
                die(f"rank {rank} on {w.host}: its remote shell ended with status {rc} before the rank "
                    "reported its exit (host lost, or the remote start failed: see the host's stderr)")
            elif key.data == "accept":
                w.conn, _ = listener.accept()
                w.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.unregister(listener)
                listener.close()
                sel.register(w.conn, selectors.EVENT_READ, "link")
                last = time.monotonic()
            else:
                assert w.conn is not None
                try:
                    data = w.conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(w.conn)
                    if w.exit_code is None:
                        die(f"rank {rank} on {w.host}: the keep-alive link closed (host or tether lost)")
                    finish(child, w.exit_code, w.keepalive)
                w.feed(data)
                last = time.monotonic()
        w.answer_confirms()
        w.judge_hangs()
        now = time.monotonic()
        if w.conn is None and now >= t_start + CALLBACK_TIMEOUT:
            die(f"rank {rank} on {w.host}: no call back from its tether to {head} within {CALLBACK_TIMEOUT:g} s "
                "(can the host reach the head on --net? is ulfmtrain installed there at the same path?)")
        if w.conn is not None and now - last > w.keepalive:
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
