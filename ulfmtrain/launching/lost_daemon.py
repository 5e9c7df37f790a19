"""The normal launch (a PRRTE daemon on every host) when a host is lost: a true exit status, and one line.

PRRTE 3.0.x cannot survive a lost daemon (docs/node-loss.md): it prints "PRTE has lost communication with a
remote daemon", with the daemon's node, ends the job, and mpirun exits 0 (ompi #13215, prrte #1969).  Watch
passes mpirun's stderr through as it comes and notes the nodes of such reports; its status() is then
LOST_HOST, with one line naming them and the way through (`--agent`, or `supervise --hostfile`).
stopping.run watches every mpirun that launch starts so.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from typing import IO

LOST_HOST = 4                          # launch's status when PRRTE ended the job for a lost host
_REPORT = "has lost communication with a remote daemon"
_NODE = re.compile(rb"Remote daemon: *\S+ on node (\S+)")


def _relay(src: IO[bytes], dst: IO[bytes], lost: list[str]) -> None:
    """Copy mpirun's stderr through line by line; note the node of each lost-daemon report."""
    reported, line = False, b"\n"
    for line in iter(src.readline, b""):
        dst.write(line)
        dst.flush()
        if _REPORT.encode() in line:
            reported = True
        elif reported and (m := _NODE.search(line)):
            lost.append(m[1].decode(errors="replace"))
            reported = False
    if not line.endswith(b"\n"):   # PRRTE's last words can end without one: ours start on a line of their own
        dst.write(b"\n")
        dst.flush()
    src.close()


class Watch:
    """Relay a started mpirun's stderr (a pipe) as it comes, noting the nodes of lost-daemon reports."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lost: list[str] = []
        self._relay = threading.Thread(target=_relay, args=(proc.stderr, sys.stderr.buffer, self.lost), daemon=True)
        self._relay.start()

    def status(self, rc: int) -> int:
        """mpirun's status, or LOST_HOST (with one line on stderr) when PRRTE ended the job for a lost host."""
        self._relay.join(timeout=5)
        if not self.lost:
            return rc
        hosts = ", ".join(dict.fromkeys(self.lost))
        print(f"ulfmtrain: error: host {hosts} was lost (its PRRTE daemon stopped answering), and with a daemon on "
              f"every host that ends the job (mpirun's own status was {rc}): launch with --agent to survive the "
              "loss of a host, or run `ulfmtrain supervise --hostfile` to relaunch without it", file=sys.stderr,
              flush=True)
        return LOST_HOST
