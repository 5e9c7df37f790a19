"""A rank dies before a broadcast: every survivor still ends with the root's object.

Under mpirun --with-ft ulfm on N >= 3 ranks.  The broadcast is tagged -1 and
followed by an allreduce at tag 0, as in Trainer: whether the broadcast
completed on a survivor or not, all end level.  Each survivor writes
OUT/rank<N>.json.
"""
import json
import os
import signal
import sys

import numpy as np

from ulfmtrain.comm import FaultTolerantComm, RolledForward


class Replica:
    def __init__(self) -> None:
        self.step, self.payload = -1, None

    def tag(self) -> int:
        return self.step

    def get_state(self) -> bytes:
        return json.dumps([self.step, self.payload]).encode()

    def set_state(self, blob: bytes) -> None:
        self.step, self.payload = json.loads(blob)


out = sys.argv[1]
ft = FaultTolerantComm()
rep = ft.replica = Replica()
w, n = ft.world_rank, ft.size
if w == n - 1:
    os.kill(os.getpid(), signal.SIGKILL)
rolled = False
try:
    rep.payload = ft.bcast({"from": "root", "values": [1, 2, 3]} if w == 0 else None)
    rep.step = 0
except RolledForward:
    rolled = True
send = np.full(8, float(w + 1), np.float32)
recv = np.empty_like(send)
while True:
    try:
        ft.allreduce(send, recv)
        break
    except RolledForward:
        rolled = True
with open(os.path.join(out, f"rank{w}.json"), "w") as f:
    json.dump({"payload": rep.payload, "step": rep.step, "sum": float(recv[0]), "rolled": rolled,
               "history": ft.world_history}, f)
os._exit(0)   # skip MPI_Finalize, which can hang after a failure
