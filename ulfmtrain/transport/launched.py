"""What `python -m ulfmtrain launch` told a script's ranks (its environment), read below the job layer."""
from __future__ import annotations

import os
import sys

SPARES_ENV, REPLACE_ENV = "ULFMTRAIN_SPARES", "ULFMTRAIN_REPLACE"


def refuse_bare_comm() -> None:
    """A bare FaultTolerantComm() in a script that `launch --spares K` (or --replace respawn) started would make
    every spare a training rank, silently: refuse.  Every rank reads the same environment, so all refuse alike,
    before any collective (status 2); the lowest says why."""
    from mpi4py import MPI

    spares, replace = os.environ.get(SPARES_ENV, "0") or "0", os.environ.get(REPLACE_ENV, "") or "none"
    if spares == "0" and replace == "none":
        return
    if MPI.COMM_WORLD.Get_rank() == 0:
        how = f"--spares {spares}" if spares != "0" else f"--replace {replace}"
        print(f"ulfmtrain: error: the job was launched with {how}, and FaultTolerantComm() neither waits as a "
              "spare nor respawns: make the communicator with `comm = ulfmtrain.connect()`",
              file=sys.stderr, flush=True)
    raise SystemExit(2)
