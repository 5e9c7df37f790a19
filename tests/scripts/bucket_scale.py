"""A rank dies between gradient buckets: every bucket must be the mean over the same survivors.

Under mpirun --with-ft ulfm on 4 ranks.  Every parameter's gradient on world
rank r is r + 1; rank 3 dies after the first buckets are reduced.  The step
is redone as a whole on the survivors, so every gradient must be
mean(1, 2, 3) = 2 (the old code scaled buckets reduced over 4 ranks by 1/3).
"""
import json
import os
import sys

import torch

from ulfmtrain.training.optim import FTSGD
from ulfmtrain.transport import faults
from ulfmtrain.transport.comm import FaultTolerantComm

out = sys.argv[1]
ft = FaultTolerantComm()
w = ft.world_rank
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
opt = FTSGD(model.parameters(), ft, lr=0.0, bucket_bytes=80, model=model)
faults.arm(faults.parse_kills(["3@0:allreduce"]), w)
for p in model.parameters():
    p.grad = torch.full_like(p, float(w + 1))
opt.synchronize()
with open(os.path.join(out, f"rank{w}.json"), "w") as f:
    json.dump({"buckets": len(opt.buckets), "history": ft.world_history,
               "grads": [float(b.grad.unique().item()) if b.grad.unique().numel() == 1 else -1 for b in opt.buckets]},
              f)
os._exit(0)
