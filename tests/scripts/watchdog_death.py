"""A rank's watchdog fires while its peers wait on it in a collective: are they told?

Under mpirun --with-ft ulfm.  Rank 0 starts a watchdog (0.5 s; survived=1 or 0) and
never joins the allreduce; the other ranks wait for it up to WAIT_S and each writes
OUT/rank<N>.json: the error they got (null when none), and after how long.
"""
import json
import os
import sys
import time

from mpi4py import MPI

import ulfmtrain  # noqa: F401  (MPI_Init, bounded)
from ulfmtrain.transport.stall import Watchdog

WAIT_S = 8.0
out, survived = sys.argv[1], sys.argv[2] == "1"
world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
world.Barrier()
if world.Get_rank() == 0:
    Watchdog(0.5, lambda idle: "rank 0: bounded wait over", survived=survived)
    time.sleep(60)
t0, error = time.monotonic(), None
req = world.Iallreduce(MPI.IN_PLACE, [bytearray(8), MPI.BYTE], MPI.BOR)
try:
    while not req.Test() and time.monotonic() - t0 < WAIT_S:
        time.sleep(0.01)
except MPI.Exception as exc:
    error = exc.Get_error_class()
with open(os.path.join(out, f"rank{world.Get_rank()}.json"), "w") as f:
    json.dump({"error": error, "proc_failed": error == MPI.ERR_PROC_FAILED, "waited": time.monotonic() - t0}, f)
os._exit(0)   # skip MPI_Finalize: it can hang after a failure
