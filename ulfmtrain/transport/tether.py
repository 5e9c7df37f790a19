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

The tether runs by path, not as `-m ulfmtrain.transport.tether` (the package would
initialize MPI in it), and imports the standard library only.
"""
from __future__ import annotations

import importlib.util
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

HEAD_ENV = "ULFMTRAIN_HEAD"           # ADDR:PORT of this rank's agent on the head node
KEEPALIVE_ENV = "ULFMTRAIN_KEEPALIVE"
FD_ENV = "ULFMTRAIN_TETHER_FD"        # the rank's end of its link to the tether
PROG = "ulfmtrain"


def _where() -> str:
    return f"rank {os.environ.get('PMIX_RANK', '?')} on {os.environ.get('ULFMTRAIN_HOST', socket.gethostname())}"


def say_stopped(why: str) -> None:
    """The one line of a rank that may not go on."""
    print(f"{PROG}: {_where()} stopped: {why}; only the side that reaches the head node goes on",
          file=sys.stderr, flush=True)


def stop(why: str) -> NoReturn:
    """In the rank: the one line, then SIGKILL (nothing more is written)."""
    say_stopped(why)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


# -- the tether process, on the rank's host ----------------------------------
CPU_REPORT_S = 0.5        # how often the tether tells the head how much CPU time its rank has used

if __package__:
    from . import board
else:       # run by path (python -P): board.py, standard library only, is the file beside this one
    _spec = importlib.util.spec_from_file_location("ulfmtrain_board", os.path.join(os.path.dirname(__file__),
                                                                                   "board.py"))
    assert _spec is not None and _spec.loader is not None
    board = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(board)


class Tether:
    """Pings the head, relays the rank's lines (confirm requests, the hang watch's rows), reports the rank's CPU
    time (a rank that holds Python's lock runs; a stopped one does not: agent.py, board.py) and how it ended."""

    def __init__(self, head: socket.socket, rank_end: socket.socket, child: subprocess.Popen,
                 keepalive: float) -> None:
        self.head, self.rank_end, self.child, self.keepalive = head, rank_end, child, keepalive
        self.buf = {head: b"", rank_end: b""}

    def lost(self, why: str) -> NoReturn:
        self.child.kill()             # the rank first: it must write nothing more
        self.child.wait()
        say_stopped(why)
        sys.exit(1)

    def send_head(self, line: str) -> None:
        try:
            self.head.sendall(line.encode() + b"\n")
        except OSError:
            pass                      # a read reports the loss

    def lines(self, sock: socket.socket) -> list[str] | None:
        """The complete lines that came in on sock; None at its end."""
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            return None
        self.buf[sock] += data
        *done, self.buf[sock] = self.buf[sock].split(b"\n")
        return [x.decode() for x in done]

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.head, selectors.EVENT_READ)
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
                    self.head.close()
                    if rc < 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    sys.exit(rc)
                elif key.fileobj is self.head:
                    got = self.lines(self.head)
                    if got is None:
                        self.lost("the head node closed its keep-alive link (it counts this rank as dead)")
                    for line in got or ():
                        if line.startswith("c "):
                            try:
                                self.rank_end.sendall(line[2:].encode() + b"\n")
                            except OSError:
                                pass      # the rank is ending: its exit comes next
                        elif line == "t":
                            self.child.terminate()
                    last = time.monotonic()
                else:
                    got = self.lines(self.rank_end)
                    if got is None:           # the rank is ending: its exit comes next
                        sel.unregister(self.rank_end)
                    for line in got or ():
                        self.send_head(line)      # "c R,R": a confirm request
            if time.monotonic() - last > self.keepalive:
                self.lost(f"no answer from the head node for {self.keepalive:g} s "
                          "(link cut, head down, or this host frozen)")


def main(app: list[str]) -> None:
    """Call back the head, start the rank with its end of our link, and watch both."""
    addr, _, port = os.environ[HEAD_ENV].rpartition(":")
    keepalive = float(os.environ[KEEPALIVE_ENV])
    try:
        head = socket.create_connection((addr, int(port)), timeout=keepalive)
    except OSError as exc:
        print(f"{PROG}: {_where()}: cannot reach the head node at {addr}:{port} ({exc}): "
              "check that this host reaches the head on --net", file=sys.stderr, flush=True)
        sys.exit(1)
    head.settimeout(None)
    head.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(app, pass_fds=(theirs.fileno(),), env={**os.environ, FD_ENV: str(theirs.fileno())})
    theirs.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    Tether(head, ours, child, keepalive).run()


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
