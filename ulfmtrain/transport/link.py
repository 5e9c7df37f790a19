"""The authenticated keep-alive link of `launch --agent`, between a rank's tether and its agent on the head node.

`launch` makes one secret per job and hands it to its agents in their environment, and each agent hands it to
its tether on the remote shell's standard input: never on a command line, which `ps` shows to every user of a
host.  A connection proves the secret both ways by HMAC-SHA256 challenge-response (fresh nonces from each end,
bound to the rank), and every line after carries an HMAC of (direction, sequence number, line) under a key of
that connection: a line cannot be forged, replayed or reordered.  A connection that fails is dropped, the
listener still open for the real tether.

A message is a line `KIND[ ARG]`; each receiver keeps a table from kind to handler, so a new kind is one entry.
Standard library only: the agent and the tether run by path, without the package.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
import time
from typing import IO

SECRET_ENV = "ULFMTRAIN_AGENT_SECRET"  # the agents' copy (launch puts it in their environment, and -x NAME)
VERSION = "ulfmtrain-link-1"
MAX_LINE = 1024                        # longer is not ours: dropped
HANDSHAKE_TIMEOUT = 10.0               # a connection that has not proved the secret by then is dropped


class LinkError(Exception):
    """A line or a connection that failed its check (one line, for the one line the receiver prints)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def hand_secret(stream: IO[bytes], secret: str) -> None:
    """The agent's side: the secret as the first line of the remote shell's standard input, then this process's
    own standard input (what PRRTE gives the rank) passed on, from a thread, until its end."""
    try:
        stream.write(f"{secret}\n".encode())
        stream.flush()
    except OSError:
        return                         # the remote shell is gone already: its end comes next

    def pass_on() -> None:
        try:
            while chunk := os.read(0, 1 << 16):
                stream.write(chunk)
                stream.flush()
        except OSError:
            pass                       # no standard input here, or the remote shell is gone
        finally:
            try:
                stream.close()
            except OSError:
                pass

    threading.Thread(target=pass_on, daemon=True).start()


def read_secret(fd: int = 0) -> str:
    """The tether's side: the first line of standard input, a byte at a time (the rest is the rank's)."""
    line = b""
    while not line.endswith(b"\n") and len(line) <= 100:
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    secret = line.decode("ascii", "replace").strip()
    if not _is_hex(secret, 64):
        raise LinkError("no job secret on standard input (the remote shell must pass the agent's standard "
                        "input on, as ssh does without -n)")
    return secret


def _mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, "\n".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


class Link:
    """One end of an authenticated connection: send() adds each line's HMAC, feed() returns the lines that hold."""

    def __init__(self, sock: socket.socket, secret: str, nonces: tuple[str, str], ours: str, theirs: str) -> None:
        self.sock = sock
        self.key = hmac.new(secret.encode(), "\n".join(("session", *nonces)).encode(), hashlib.sha256).digest()
        self.ours, self.theirs = ours, theirs
        self.sent = self.received = 0
        self.buf = b""

    def send(self, line: str) -> None:
        mac = _mac(self.key, self.ours, self.sent, line)
        self.sent += 1
        try:
            self.sock.sendall(f"{line} {mac}\n".encode())
        except OSError:
            pass                       # the link is gone: the next read says so

    def feed(self, data: bytes) -> tuple[list[str], list[str]]:
        """(the lines that data completes and whose HMAC holds, why each other line was dropped)."""
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        good, bad = [], []
        if len(self.buf) > MAX_LINE:
            bad.append(f"a line of over {MAX_LINE} bytes")
            self.buf = b""
        for raw in lines:
            text = raw.decode("ascii", "replace")
            line, _, mac = text.rpartition(" ")
            if _is_hex(mac, 64) and hmac.compare_digest(mac, _mac(self.key, self.theirs, self.received, line)):
                self.received += 1
                good.append(line)
            else:
                bad.append(f"a line that fails its HMAC check ({text[:40]!r})")
        return good, bad


class Greeting:
    """The head's side of a new connection, fed as its bytes come (a stranger may send nothing, or anything)."""

    def __init__(self, sock: socket.socket, secret: str, rank: int) -> None:
        self.sock, self.secret, self.rank = sock, secret, rank
        self.nonce = secrets.token_hex(16)
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.buf = b""
        sock.sendall(f"{VERSION} {rank} {self.nonce}\n".encode())

    def feed(self, data: bytes) -> Link | None:
        """The link once the peer proved the secret (and got the head's proof); None while it may still."""
        if not data:
            raise LinkError("it closed before proving the job's secret")
        self.buf += data
        if b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise LinkError("not a ulfmtrain tether (a long line)")
            return None
        line, rest = self.buf.split(b"\n", 1)
        words = line.decode("ascii", "replace").split(" ")
        if len(words) != 2 or not _is_hex(words[0], 32) or not _is_hex(words[1], 64):
            raise LinkError(f"not a ulfmtrain tether ({line[:40]!r})")
        nonce, proof = words
        if not hmac.compare_digest(proof, _mac(self.secret.encode(), "tether", self.rank, self.nonce, nonce)):
            raise LinkError("it does not know the job's secret")
        self.sock.sendall((_mac(self.secret.encode(), "head", self.rank, self.nonce, nonce) + "\n").encode())
        link = Link(self.sock, self.secret, (self.nonce, nonce), "head", "tether")
        link.buf = rest
        return link


def _read_line(sock: socket.socket) -> str:
    """One line, a byte at a time (nothing after it is taken from the socket); LinkError at its end."""
    out = b""
    while not out.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte or len(out) > MAX_LINE:
            raise LinkError("the head closed the connection during the handshake")
        out += byte
    return out[:-1].decode("ascii", "replace")


def call(addr: str, port: int, secret: str, rank: int, timeout: float) -> Link:
    """The tether's side: connect to the agent of `rank`, prove the secret, check the head's proof."""
    sock = socket.create_connection((addr, port), timeout=timeout)
    try:
        words = _read_line(sock).split(" ")
        if len(words) != 3 or words[0] != VERSION or words[1] != str(rank) or not _is_hex(words[2], 32):
            raise LinkError(f"{addr}:{port} is not the agent of rank {rank} ({' '.join(words)[:60]!r})")
        theirs, ours = words[2], secrets.token_hex(16)
        sock.sendall(f"{ours} {_mac(secret.encode(), 'tether', rank, theirs, ours)}\n".encode())
        proof = _read_line(sock)
        if not (_is_hex(proof, 64) and hmac.compare_digest(proof, _mac(secret.encode(), "head", rank, theirs, ours))):
            raise LinkError(f"{addr}:{port} does not know the job's secret")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Link(sock, secret, (theirs, ours), "tether", "head")
