"""DDP habits that cannot survive a failure, each refused with one line: `python -m ulfmtrain launch -n 3 --
python ddp_refusals.py OUT CASE` (OUT names the job; nothing is written).

sampler: a DistributedSampler left in (status 2).  init-first: dist.init_process_group("gloo") before
connect() (status 2).  bare-ddp: a DDP module whose optimizer is not wrapped, so DDP would reduce its own
gradients (status 1, at the first backward).  syncbn: a SyncBatchNorm layer (status 2).  broadcast:
dist.broadcast between steps (status 1).
"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ulfmtrain

case = sys.argv[2]
if case == "init-first":
    dist.init_process_group("gloo")
comm = ulfmtrain.connect()
layers = [torch.nn.Linear(4, 8), torch.nn.SyncBatchNorm(8) if case == "syncbn" else torch.nn.BatchNorm1d(8),
          torch.nn.Linear(8, 2)]
model = DDP(torch.nn.Sequential(*layers))
if case == "bare-ddp":
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
else:
    opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
if case == "sampler":
    sampler = torch.utils.data.distributed.DistributedSampler(list(range(30)), shuffle=True, seed=0)
if case == "broadcast":
    dist.broadcast(torch.zeros(3), src=0)
model(torch.randn(6, 4)).sum().backward()
opt.step()
print("trained: not refused", file=sys.stderr)
