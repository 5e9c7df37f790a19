"""The rank's end of the keep-alive link to the head node (`launch --agent RSH --keepalive S`), and its gate.

Each rank of an agent launch runs under a tether on its own host.  The tether
calls back its agent on the head node (ulfmtrain/launching/agent.py), pings it every
S/3 seconds and watches the rank.  The agent dies by SIGKILL when it hears
nothing for S seconds, so the survivors shrink; the tether SIGKILLs the rank
when the head does not answer for S seconds, with one line on stderr.  A
host cut off or frozen is therefore dropped by the head, and stops itself,
within the keep-alive bound S.

**No split brain.**  A cut link can make each side see the other as dead.
The rule: only ranks that the head still counts go on.  After every repair,
before the redone step can commit, each survivor asks the head (through its
tether) to confirm that (1) its own agent lives and (2) the agents of the
ranks the repair removed are dead (waiting up to S for them).  A rank that
gets no confirmation stops (one line, SIGKILL) before it writes anything
more; its agent then dies too, and the others repair again.  A cut-off side
cannot confirm, and the head never counts both sides of a cut.

The link is authenticated (link.py): the tether reads the job's secret from
its standard input and proves it to the head, which proves it back.  The rank
starts in the launching directory (or `launch --wdir`).  A stop line goes to
stderr and, since a cut-off host's stderr (an ssh channel) may go nowhere, to
the host's own log (core/userdir.py: host.log, and syslog); a tether cut off
from the head also ends the ssh session it runs in, which sshd would otherwise
keep until the link returns.

The tether runs by path, not as `-m ulfmtrain.transport.tether` (the package would
initialize MPI in it), and imports the standard library only, and its siblings from their files.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn

if not __package__:                    # run by path: link and userdir from their folders, not from the package
    sys.path += [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "core")]
link = import_module(".link" if __package__ else "link", __package__)
userdir = import_module("..core.userdir" if __package__ else "userdir", __package__)

HEAD_ENV = "ULFMTRAIN_HEAD"           # ADDR:PORT of this rank's agent on the head node
KEEPALIVE_ENV = "ULFMTRAIN_KEEPALIVE"
WDIR_ENV = "ULFMTRAIN_WDIR"           # where the rank starts (launch's directory, or --wdir)
FD_ENV = "ULFMTRAIN_TETHER_FD"        # the rank's end of its link to the tether
PROG = "ulfmtrain"


def _where() -> str:
    return f"rank {os.environ.get('PMIX_RANK', '?')} on {os.environ.get('ULFMTRAIN_HOST', socket.gethostname())}"


def say_stopped(why: str) -> None:
    """The one line of a rank that may not go on: on stderr, and in the host's own log."""
    line = f"{PROG}: {_where()} stopped: {why}; only the side that reaches the head node goes on"
    print(line, file=sys.stderr, flush=True)
    userdir.host_log(line)


def ssh_session() -> int | None:
    """The sshd process of the login this tether runs in (`--agent ssh`), if any: its nearest ancestor named
    sshd (sshd-session too), of this user."""
    if "SSH_CONNECTION" not in os.environ:
        return None
    pid = os.getppid()
    for _ in range(4):                # sshd, then the login shell, then `env`: exec'd or not
        try:                          # (status, not the folder's owner: sshd makes itself undumpable, root's)
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return None
        fields = dict(x.split(":\t", 1) for x in lines if ":\t" in x)
        if fields["Name"].startswith("sshd"):
            return pid if int(fields["Uid"].split()[1]) == os.getuid() else None
        pid = int(fields["PPid"])
    return None


def stop(why: str) -> NoReturn:
    """In the rank: the one line, then SIGKILL (nothing more is written)."""
    say_stopped(why)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


# -- the tether process, on the rank's host ----------------------------------
CPU_REPORT_S = 0.5        # how often the tether tells the head how much CPU time its rank has used

board = import_module(".board" if __package__ else "board", __package__)    # standard library only


class Tether:
    """Pings the head, relays the rank's lines (confirm requests, the hang watch's rows), reports the rank's CPU
    time (a rank that holds Python's lock runs; a stopped one does not: agent.py, board.py) and how it ended."""

    def __init__(self, head: Any, rank_end: socket.socket, child: subprocess.Popen, keepalive: float,
                 session: int | None = None) -> None:
        self.head, self.rank_end, self.child, self.keepalive = head, rank_end, child, keepalive   # head: link.Link
        self.session = session        # the sshd process of this login, if any
        self.rank_buf = b""
        # The head's messages, by kind (a new kind is one entry): a ping's echo, the answer to a confirm
        # (c ok, c no R,R), terminate the rank (mpirun ends the job).
        self.handlers = {"p": lambda _: None, "c": self.answer_rank, "t": lambda _: self.child.terminate()}

    def lost(self, why: str) -> NoReturn:
        self.child.kill()             # the rank first: it must write nothing more
        self.child.wait()
        say_stopped(why)
        if self.session is not None:  # sshd would keep it (and wait for the head) until the link returns
            try:
                os.kill(self.session, signal.SIGTERM)
            except OSError:
                pass
        sys.exit(1)

    def send_head(self, line: str) -> None:
        self.head.send(line)

    def answer_rank(self, answer: str) -> None:
        try:
            self.rank_end.sendall(answer.encode() + b"\n")
        except OSError:
            pass                      # the rank is ending: its exit comes next

    def from_head(self) -> int | None:
        """Handle what came from the head; the number of messages that passed their check, None at the link's
        end."""
        try:
            data = self.head.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            return None
        lines, bad = self.head.feed(data)
        for line in lines:
            kind, _, arg = line.partition(" ")
            if kind in self.handlers:
                self.handlers[kind](arg)
        for why in bad[:1]:
            print(f"{PROG}: {_where()}: dropped a message from the head node: {why}", file=sys.stderr, flush=True)
        return len(lines)

    def from_rank(self) -> list[str] | None:
        """The complete lines the rank sent (confirm requests); None at its end."""
        try:
            data = self.rank_end.recv(4096)
        except OSError:
            data = b""
        if not data:
            return None
        *done, self.rank_buf = (self.rank_buf + data).split(b"\n")
        return [x.decode() for x in done]

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.head.sock, selectors.EVENT_READ)
        sel.register(self.rank_end, selectors.EVENT_READ)
        pidfd = os.pidfd_open(self.child.pid)
        sel.register(pidfd, selectors.EVENT_READ)
        interval = self.keepalive / 3
        last = time.monotonic()
        next_ping = next_cpu = last
        while True:
            now = time.monotonic()
            if now >= next_ping:
                self.send_head("p")
                next_ping = now + interval
            if now >= next_cpu:
                self.send_head(f"u {board.cpu_ticks(self.child.pid)}")
                next_cpu = now + CPU_REPORT_S
            for key, _ in sel.select(max(0.0, min(next_ping, next_cpu, last + self.keepalive) - now)):
                if key.fileobj == pidfd:
                    rc = self.child.wait()
                    self.send_head("k" if rc < 0 else f"x {rc}")
                    self.head.sock.close()
                    if rc < 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    sys.exit(rc)
                elif key.fileobj is self.head.sock:
                    heard = self.from_head()
                    if heard is None:
                        self.lost("the head node closed its keep-alive link (it counts this rank as dead)")
                    if heard:
                        last = time.monotonic()
                else:
                    got = self.from_rank()
                    if got is None:           # the rank is ending: its exit comes next
                        sel.unregister(self.rank_end)
                    for line in got or ():
                        self.send_head(line)      # "c R,R": a confirm request
            if time.monotonic() - last > self.keepalive:
                self.lost(f"no answer from the head node for {self.keepalive:g} s "
                          "(link cut, head down, or this host frozen)")


def main(app: list[str]) -> None:
    """Call back the head (proving the job's secret), start the rank in the launch's directory with its end of
    our link, and watch both."""
    addr, _, port = os.environ[HEAD_ENV].rpartition(":")
    keepalive = float(os.environ[KEEPALIVE_ENV])
    try:
        # The secret comes on standard input (the agent's remote shell; ssh passes no environment on), or in the
        # environment of a tether that mpirun starts itself (tests).
        secret = os.environ.get(link.SECRET_ENV) or link.read_secret(0)
    except link.LinkError as exc:
        sys.exit(f"{PROG}: {_where()}: {exc}")
    try:
        head = link.call(addr, int(port), secret, int(os.environ["PMIX_RANK"]), keepalive)
    except (OSError, link.LinkError) as exc:
        print(f"{PROG}: {_where()}: cannot reach the head node at {addr}:{port} ({exc}): "
              "check that this host reaches the head on --net", file=sys.stderr, flush=True)
        sys.exit(1)
    head.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wdir = os.environ.get(WDIR_ENV)
    try:
        if wdir:
            os.chdir(wdir)
    except OSError as exc:
        print(f"{PROG}: {_where()}: cannot start in {wdir} ({exc.strerror}): the ranks start in the launching "
              "directory, which every host must have at the same path; or pass --wdir DIR", file=sys.stderr,
              flush=True)
        head.send("x 1")
        sys.exit(1)
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k != link.SECRET_ENV}     # the rank never holds it
    child = subprocess.Popen(app, pass_fds=(theirs.fileno(),), env={**env, FD_ENV: str(theirs.fileno())})
    theirs.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    Tether(head, ours, child, keepalive, ssh_session()).run()


# -- the gate, inside the rank -----------------------------------------------
_link: socket.socket | None = None
_sending = threading.Lock()         # the main thread's confirm requests and the hang watch's rows (hangs.py)


def _the_link() -> socket.socket:
    global _link
    if _link is None:
        _link = socket.socket(fileno=int(os.environ[FD_ENV]))
        # The head waits up to S for the removed agents of a confirm; the tether lapses after S.
        _link.settimeout(3 * float(os.environ[KEEPALIVE_ENV]))
    return _link


def send_line(line: str) -> None:
    """A line to the head node through the tether (the hang watch's row: "h {...}"); lost if the link is."""
    try:
        with _sending:
            _the_link().sendall(line.encode() + b"\n")
    except OSError:
        pass                          # the tether is gone: this rank ends with it


def confirm(removed: list[int]) -> tuple[bool, str]:
    """Ask the head, through the tether, whether this rank may commit a repair that removed `removed`.

    Returns (True, "") or (False, why).
    """
    link = _the_link()
    try:
        with _sending:
            link.sendall(("c " + ",".join(map(str, removed)) + "\n").encode())
        answer = b""
        while not answer.endswith(b"\n"):
            part = link.recv(256)
            if not part:
                return False, "its tether is gone"
            answer += part
    except OSError as exc:
        return False, f"no answer from its tether ({exc})"
    text = answer.decode().strip()
    if text == "ok":
        return True, ""
    if text.startswith("no "):
        return False, f"the head node still counts rank(s) {text[3:]} that this side's repair removed"
    return False, f"an answer the head never sends ({text!r})"


def gate(event: Any) -> None:
    """A repair listener: go on only if the head confirms this rank and the removal; else stop here."""
    t0 = time.perf_counter()
    ok, why = confirm(list(event.removed))
    if not ok:
        stop(f"the head node did not confirm this repair: {why}")
    event.extra["head_confirm_ms"] = (time.perf_counter() - t0) * 1e3


def install(comm: Any) -> None:
    """Under a tether (an agent launch), gate every repair of comm; elsewhere nothing."""
    if FD_ENV in os.environ:
        comm.add_listener(gate)


if __name__ == "__main__":
    main(sys.argv[1:])
