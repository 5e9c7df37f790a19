"""A loop that all-reduces a metric between steps, in a user's style: `launch -n 3 [--spares 1] -- python
metric_loop.py OUT [DIE]`.

After each step every rank reduces its loss over the ranks (comm.allreduce, the mean) and, every 4 steps, waits at
comm.barrier().  DIE = SLOT@STEP:WHERE: that slot SIGKILLs itself at STEP, WHERE `metric` (its peers are in the
metric's reduction) or `start` (before any step: its peers reduce a first metric before the optimizer exists);
WHERE `extra`: that slot alone reduces one more metric at STEP, a bug.
Each training rank that ends writes OUT/rank<slot>.json: a checksum, the metrics it saw, the world history.
"""
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

import ulfmtrain

STEPS = 10
out = sys.argv[1]
die = sys.argv[2] if len(sys.argv) > 2 else ""
comm = ulfmtrain.connect()
joined = getattr(comm, "takeover", None) is not None


def maybe_die(step, where):
    if die == f"{comm.world_rank}@{step}:{where}" and not joined:
        os.kill(os.getpid(), signal.SIGKILL)


maybe_die(0, "start")
ranks = comm.allreduce(1, op="sum")            # before any optimizer: how many ranks train
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = ulfmtrain.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm, model=model,
                                     bucket_bytes=512)
metrics = {}
for step in range(comm.step, STEPS):
    g = torch.Generator().manual_seed(1000 * comm.world_rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    maybe_die(step, "metric")
    if die == f"{comm.world_rank}@{step}:extra":
        comm.allreduce(loss.detach(), op="max")
    metrics[step] = comm.allreduce(loss.detach(), op="mean").item()
    if step % 4 == 3:
        comm.barrier()
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "metrics": metrics, "ranks": ranks, "joined": joined,
               "history": comm.world_history}, f)
