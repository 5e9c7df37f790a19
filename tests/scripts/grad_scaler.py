"""AMP's GradScaler and an LR scheduler drive DistributedOptimizer through an overflow and a failure.

Under mpirun --with-ft ulfm on 3 ranks.  At step 1 only rank 2's loss is
infinite: after the reduction every rank holds inf gradients, so the scaler
must skip that step on every rank alike.  At step 3 rank 1 dies inside the
reduction; the survivors redo the step and go on.  Each survivor writes its
checksum, the scaler's scale, the LR, which steps changed the weights, and
the world history.  With the argument `overlap`, buckets are reduced while
backward runs.
"""
import json
import os
import sys

import torch

from ulfmtrain import DistributedOptimizer, FaultTolerantComm
from ulfmtrain.transport import faults

out = sys.argv[1]
overlap = sys.argv[2:] == ["overlap"]
comm = FaultTolerantComm()
w = comm.world_rank
torch.manual_seed(w)                       # different seeds: the initial broadcast must even them out
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), comm, model=model, bucket_bytes=256,
                           overlap=overlap)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
faults.arm(faults.parse_kills(["1@3:allreduce"]), w)
changed = []
g = torch.Generator().manual_seed(100 + w)
for step in range(6):
    x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
    opt.zero_grad()
    opt._begin_step(samples=len(y))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if step == 1 and w == 2:
        loss = loss * float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss).backward()
    opt.synchronize(samples=len(y))
    scaler.step(opt)
    scaler.update()
    sched.step()
    changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
with open(os.path.join(out, f"rank{w}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "scale": scaler.get_scale(), "lr": opt.param_groups[0]["lr"],
               "changed": changed, "history": comm.world_history, "steps": opt.step_count}, f)
comm.finalize()
