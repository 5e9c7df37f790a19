"""DDP's gradient semantics with overlap=True, under mpirun --with-ft ulfm on 3 ranks.

argv: OUT.  Each rank weights its gradient by its own batch size (5 + rank).
Before backward it computes its local gradient (torch.autograd.grad, which
fills no .grad); after backward it records p.grad (the global mean, if the
step finished inside backward), then clips it to 1e-3 right there, as a DDP
user would, and records the norm and the clipped gradient.  Rank 1 dies
inside the overlapped reduction of step 3; the survivors redo that step
inside backward's final callback.  One JSON line per step in OUT/rank<N>.jsonl
(written before the next step, so the dead rank's first steps are there).
With ULFMTRAIN_STAGING=standin the buckets take the staged (GPU) path.
"""
import json
import os
import sys

import torch

from ulfmtrain import DistributedOptimizer, FaultTolerantComm
from ulfmtrain.training.streams import StandInStreams
from ulfmtrain.transport import faults

out = sys.argv[1]
comm = FaultTolerantComm()
w = comm.world_rank
torch.manual_seed(w)                      # different seeds: the initial broadcast must even them out
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 4))
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), comm, model=model, bucket_bytes=256,
                           overlap=True)
streams = opt.buckets[0].streams
standin = isinstance(streams, StandInStreams)
faults.arm(faults.parse_kills(["1@3:allreduce"]), w)
g = torch.Generator().manual_seed(100 + w)
params = list(model.parameters())
with open(os.path.join(out, f"rank{w}.jsonl"), "w") as f:
    for step in range(6):
        n = 5 + w
        x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
        opt.zero_grad()
        opt._begin_step(samples=n)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        local = torch.autograd.grad(loss, params, retain_graph=True)
        # the line goes out before backward: the dead rank's contribution to the steps it finished is known
        f.write(json.dumps({"step": step, "n": n, "local": torch.cat([v.reshape(-1) for v in local]).tolist()})
                + "\n")
        f.flush()
        loss.backward()
        committed = opt.step_count                       # the step committed inside backward
        after = torch.cat([p.grad.reshape(-1) for p in params]).tolist()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1e-3))
        clipped = torch.cat([p.grad.reshape(-1) for p in params]).tolist()
        opt.step(samples=n)
        f.write(json.dumps({"step": step, "committed": committed, "after_backward": after, "norm": norm,
                            "clipped": clipped, "history": comm.world_history, "checksum": opt.checksum(),
                            "standin": standin, "standin_errors": streams.errors if standin else [],
                            "standin_ops": len(streams.log) if standin else 0}) + "\n")
        f.flush()
opt.close()
comm.finalize()
