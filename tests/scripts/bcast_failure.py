"""The root of a fault-tolerant broadcast dies before any survivor has its data.

Under mpirun --with-ft ulfm on N >= 3 ranks.  Rank 0 SIGKILLs itself before
the broadcast (its payload never leaves it); the survivors must all end with
the new lowest rank's payload, not None.  `large_payload` sends 8 MB (as the
initial state or a checkpoint restore does).  Each survivor writes
OUT/rank<N>.json.
"""
import json
import os
import signal
import sys

from ulfmtrain.transport import handles as comm_module
from ulfmtrain.transport.comm import FaultTolerantComm

out, case = sys.argv[1], sys.argv[2]
ft = FaultTolerantComm()
w = ft.world_rank
first = ft.comm
if w == 0:
    os.kill(os.getpid(), signal.SIGKILL)
pad = "x" * (8 << 20) if case == "large_payload" else ""
payload = ft.bcast_obj(lambda: {"from": ft.world_rank, "values": [1, 2, 3], "pad": pad})
payload["pad"] = len(payload["pad"])
with open(os.path.join(out, f"rank{w}.json"), "w") as f:
    # The old communicator is kept, not freed (comm.retire), and no longer used.
    json.dump({"payload": payload, "history": ft.world_history, "comm_retired": ft.comm != first
               and any(c == first for c in comm_module._retired)}, f)
os._exit(0)   # skip MPI_Finalize, which can hang after a failure
