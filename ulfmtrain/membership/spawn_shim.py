"""What MPI_Comm_spawn starts for a newcomer: `python -I -S spawn_shim.py [--pid PID] ADDRESS PROGRAM ARGS...`.

It hands its arguments, environment (the spawned process's PMIx identity), working directory and standard
streams to the host's fork server (forkserver.py), which forks the newcomer, and it ends as that child ends:
by the same signal (Open MPI's ULFM layer is told of a process killed by a signal) or with the same status.
A signal sent to it (PRRTE's SIGTERM at the end of a job) goes on to the child.  ADDRESS is a socket's path
in a folder only this user can enter (core/userdir.py); before it hands anything over, the shim checks who
listens there (SO_PEERCRED): this user, and the process PID where it is known.  Without such a fork server
it says so in one line and execs PROGRAM.  Standard library only, run as a file without site-packages: it
starts in a few ms.
"""
import json
import os
import signal
import socket
import struct
import sys
from typing import Any

ADDRESS_ENV = "ULFMTRAIN_FORKSERVER_AT"    # where a newcomer's own spawns find the fork server
PID_ENV = "ULFMTRAIN_FORKSERVER_PID"       # and its process, where known
ENABLE_ENV = "ULFMTRAIN_FORKSERVER"        # 0: newcomers start from scratch
MAX_MESSAGE = 1 << 20
HOST = "{host}"    # in an address: the host where it is used (a newcomer may start on another host than its spawner)


def served(command: list[str]) -> tuple[str, str, list[str], bool]:
    """("module" or "script", its name, its arguments, -P) of `python [-P] (-m MODULE | SCRIPT) ARGS` run by
    this interpreter, what a fork server runs; ValueError for any other command."""
    safe = command[1:2] == ["-P"]
    rest = command[1 + safe:]
    module = rest[:1] == ["-m"] and len(rest) >= 2
    if command[:1] != [sys.executable] or not (module or rest and not rest[0].startswith("-")):
        raise ValueError(f"the fork server runs only `{sys.executable} [-P] (-m MODULE | SCRIPT) ...`, "
                         f"not {command[:4]}")
    if module:
        return "module", rest[1], rest[2:], safe
    return "script", rest[0], rest[1:], safe


def on_this_host(address: str) -> str:
    """The socket path of `address` here (a socket's path is short: the host name is cut to 40 characters)."""
    return address.replace(HOST, socket.gethostname()[:40])


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket, as the kernel tells them."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def untrusted(sock: socket.socket, address: str, pid: int | None) -> str:
    """Why the server at the other end must get nothing ('' when it is this user's, and process pid if given)."""
    their_pid, uid = peer(sock)
    if uid != os.getuid():
        return f"the fork server at {address} runs as uid {uid}, not as this user (uid {os.getuid()})"
    if pid is not None and their_pid != pid:
        return f"the fork server at {address} is process {their_pid}, not {pid}"
    return ""


def _mirror(status: int) -> None:
    """End as a child with wait status `status` ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)   # not forwarded to a child any more
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(address: str, command: list[str], server: int | None = None) -> None:
    os.environ[ADDRESS_ENV] = address
    if server is not None:
        os.environ[PID_ENV] = str(server)
    reply: dict[str, Any]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(on_this_host(address))
        reply = {"error": untrusted(s, address, server)}
        if not reply["error"]:
            request = {"command": command, "env": dict(os.environ), "cwd": os.getcwd()}
            socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
            reply = json.loads(s.recv(MAX_MESSAGE) or b'{"error": "the fork server closed the connection"}')
    except OSError as exc:
        reply = {"error": f"no fork server reached on this host ({exc.strerror or exc})"}
    why = reply.get("error", "")
    if why:
        print(f"ulfmtrain: warning: {why}: the newcomer starts from scratch", file=sys.stderr, flush=True)
        os.execv(command[0], command)
    pid = reply["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    data = s.recv(MAX_MESSAGE)       # the child's wait status (a signal handled here does not end the wait)
    if not data:
        # The fork server died, and its children with it (PR_SET_PDEATHSIG): end as killed, so the survivors
        # are told.
        _mirror(signal.SIGKILL)      # the wait status of a process killed by SIGKILL is its number
    _mirror(json.loads(data)["status"])


def command_line(address: str, command: list[str]) -> list[str]:
    """The command that starts `command` through the fork server at `address`, checked to be process
    $ULFMTRAIN_FORKSERVER_PID where that is known (a server named in the environment: launch.warm_server)."""
    pid = os.environ.get(PID_ENV, "")
    return [sys.executable, "-I", "-S", __file__, *(["--pid", pid] if pid.isdigit() else []), address, *command]


if __name__ == "__main__":
    if sys.argv[1] == "--pid":
        main(sys.argv[3], sys.argv[4:], int(sys.argv[2]))
    else:
        main(sys.argv[1], sys.argv[2:])
