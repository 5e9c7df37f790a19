"""Survivors that stand at different steps when a rank dies must end level.

Under mpirun --with-ft ulfm on N >= 3 ranks: rank 0 has "completed" step 1
(tag 2) while the others have not (tag 1), as happens when outcomes of a
collective are not uniform; then the last rank is SIGKILLed.  Each survivor
writes what it ended with to OUT/rank<N>.json.
"""
import json
import os
import signal
import sys
import time

import numpy as np

from ulfmtrain.comm import FaultTolerantComm, RolledForward


class Replica:
    def __init__(self) -> None:
        self.step, self.state = 0, b"initial"

    def tag(self) -> int:
        return self.step

    def get_state(self) -> bytes:
        return json.dumps([self.step, self.state.decode()]).encode()

    def set_state(self, blob: bytes) -> None:
        step, state = json.loads(blob)
        self.step, self.state = step, state.encode()


out = sys.argv[1]
ft = FaultTolerantComm()
rep = ft.replica = Replica()
w, n = ft.world_rank, ft.size
send = np.full(1024, float(w + 1), np.float32)
recv = np.empty_like(send)
ft.allreduce(send, recv)
assert recv[0] == n * (n + 1) / 2
rep.step = 1
if w == 0:                      # rank 0 went ahead: it applied step 1
    rep.step, rep.state = 2, b"after step 1 on rank 0"
if w == n - 1:
    time.sleep(0.2)             # let the others block in the next allreduce
    os.kill(os.getpid(), signal.SIGKILL)
rolled = False
while True:
    try:
        ft.allreduce(send, recv)
        break
    except RolledForward:
        rolled = True           # a trainer would recompute its gradients here
with open(os.path.join(out, f"rank{w}.json"), "w") as f:
    json.dump({"rolled": rolled, "step": rep.step, "state": rep.state.decode(), "sum": float(recv[0]),
               "alive": ft.alive, "history": ft.world_history,
               "events": [e.to_json() for e in ft.events]}, f)
os._exit(0)   # skip MPI_Finalize, which can hang after a failure
