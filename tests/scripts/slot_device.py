"""Which local rank picks the GPU of a process that takes a dead slot, under mpirun --with-ft ulfm.

argv: OUT MODE.  MODE "spare": 3 slots + 1 spare (4 ranks); "respawn": 3 ranks,
a process spawned in the background takes the slot; "size-loop": respawn, with a loop that ends on comm.size (a
newcomer that joins sees 3 before the step its peers are in; rank 1 dies at step 29, so the join comes after step 30).
Rank 1 dies at step 4.
Each launch process writes its local rank to OUT/launch<rank>.json; each
process in a slot at the end writes OUT/rank<slot>.json: the local rank
that picks its device (device.slot_local_rank), its own, and whether it joined.
"""
import json
import os
import sys

import torch
from mpi4py import MPI

import ulfmtrain
from ulfmtrain import DistributedOptimizer
from ulfmtrain.membership.respawn import RespawnComm
from ulfmtrain.membership.spares import SpareComm
from ulfmtrain.training.device import local_rank, slot_local_rank
from ulfmtrain.transport import faults

out, mode = sys.argv[1], sys.argv[2]
if mode == "size-loop":         # as a user's script: connect() (ULFMTRAIN_REPLACE=respawn), with its end check
    comm = ulfmtrain.connect()
else:
    comm = RespawnComm(0, [sys.executable, "-P", __file__, out, mode]) if mode == "respawn" else SpareComm(1)
if getattr(comm, "joined", None) is None:     # a launch process (not a newcomer): its own local rank
    with open(os.path.join(out, f"launch{MPI.COMM_WORLD.Get_rank()}.json"), "w") as f:
        json.dump({"local": local_rank()}, f)
if comm.is_spare and not comm.wait_for_slot():
    raise SystemExit(0)
joined = comm.takeover is not None
faults.arm([k for k in faults.parse_kills(["1@29" if mode == "size-loop" else "1@4"]) if not joined], comm.world_rank)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
# A rank that took a slot receives the survivors' state here (the job's state, by name).
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
g = torch.Generator().manual_seed(1)
# Respawn: train on until the newcomer has joined, bounded (30 steps of this model can end before a spawned
# process is ready on a loaded machine).  The decision is the job's state, set after a step on every rank: a
# newcomer joins the step its peers are in, so a loop on comm.size alone would end it before that step.
state = comm.track(whole=False)
while opt.step_count < 30 or (mode != "spare" and not (comm.size == 3 if mode == "size-loop" else state.whole)
                              and opt.step_count < 20000):
    faults.point(opt.step_count, "forward")
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step(samples=4)
    state.whole = comm.size == 3
if mode != "size-loop":         # (connect() arranges the end)
    comm.close() if isinstance(comm, RespawnComm) else comm.release_spares()
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"slot_local": slot_local_rank(comm), "own_local": local_rank(), "joined": joined,
               "history": comm.world_history, "checksum": opt.checksum()}, f)
if mode != "size-loop":
    comm.finalize()
