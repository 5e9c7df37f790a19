"""A user's own loop with a hot spare (3 slots + 1 spare, 4 ranks) or respawn (3 ranks), under mpirun --with-ft ulfm.

argv: OUT MODE [KILL].  MODE "dies": the spare SIGKILLs itself while it waits
(a timer thread); "takes-over": it takes the slot of the rank KILL kills; "dies-at-start": rank 1 is SIGKILLed
inside SpareComm's constructor, before its first collective, and the spare takes slot 1 from the start;
"respawn": no spare, a process spawned in the background takes it (20 epochs instead of 3);
"die-first": rank 1 and the spare are SIGKILLed before SpareComm, while the others make its world;
"respawn-spare": respawn with the spare (20 epochs), and a KILL of phase `allreduce` fires inside this loop's own
comm.allreduce of the loss, between backward and the step.
KILL: a kill spec for a training rank, e.g. 1@50 (75 steps in all).  Each training rank that
ends writes OUT/rank<slot>.json: checksum, world history, recoveries, steps, samples.
"""
import json
import os
import signal
import sys
import threading
import time

import torch

from ulfmtrain import DistributedOptimizer, distributed_sampler
from ulfmtrain.membership.respawn import RespawnComm
from ulfmtrain.membership.spares import SpareComm
from ulfmtrain.transport import faults

out, mode = sys.argv[1], sys.argv[2]
if mode == "die-first" and os.environ.get("OMPI_COMM_WORLD_RANK") in ("1", "3"):
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "dies-at-start" and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    # It reads its local rank for that collective: die there.
    import ulfmtrain.membership.spares as spares
    spares.local_rank = lambda: os.kill(os.getpid(), signal.SIGKILL)
# A newcomer runs this program again, without the kills.
respawn = mode.startswith("respawn")
comm = (RespawnComm(mode == "respawn-spare", [sys.executable, "-P", __file__, out, mode]) if respawn
        else SpareComm(1))
records: list = []      # respawn records (spawning, joined, failed ...) this rank heard as a training rank
if respawn:
    comm.add_join_listener(lambda rec: records.append(rec["status"]))
if comm.is_spare:
    if mode == "dies":
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    if not comm.wait_for_slot():
        raise SystemExit(0)
joined = comm.takeover is not None      # a spare that took a slot, or a newcomer
kills = [k for k in faults.parse_kills(sys.argv[3:]) if not (joined and k.rank == comm.world_rank)]
faults.arm(kills if mode != "respawn-spare" else [], comm.world_rank)
mine = {k.step for k in kills if k.rank == comm.world_rank and mode == "respawn-spare"}
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(1200, 8, generator=g), torch.randint(0, 4, (1200,), generator=g)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
# A rank that took a slot receives the survivors' state here: model, optimizer, step, and the sampler's once it is made.
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm, model=model, bucket_bytes=256,
                           scale_lr=respawn, overlap=False if mode == "respawn-spare" else None)
sampler = distributed_sampler(comm, opt, len(y), 16, seed=3)
for epoch in range(sampler.epoch, 20 if respawn else 3):
    if epoch != sampler.epoch:
        sampler.start_epoch(epoch)
    while not sampler.epoch_done():
        ids = torch.from_numpy(sampler.batch_ids(comm.world_rank))
        faults.point(opt.step_count, "forward")
        opt.zero_grad()
        if len(ids):
            torch.nn.functional.cross_entropy(model(x[ids]), y[ids]).backward()
        if mode == "respawn-spare":
            if opt.step_count in mine:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.allreduce(float(len(ids)), op="sum")
        opt.step(samples=len(ids))
        time.sleep(0.01)        # long enough for the spare's timer to fire mid-training
comm.close() if isinstance(comm, RespawnComm) else comm.release_spares()
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "history": comm.world_history, "steps": opt.step_count,
               "removed": [e.removed for e in comm.events], "spares_left": comm.spares_left, "joined": joined,
               "samples": opt.samples_total, "lr": opt.param_groups[0]["lr"], "records": records}, f)
comm.finalize()
