"""A user's own script with mixed precision, run by `launch -n 3 [--spares K] -- python scaler_spare.py OUT`.

ulfmtrain.connect(); float16 autocast with a GradScaler (a small growth interval, so its scale moves), an
AdamW with a cosine schedule and dropout, the schedule and the scaler tracked (comm.track); seed= for the
dropout masks.  At step 2 slot 2's loss is infinite: every rank skips that update and backs off alike.  Each
slot's batch is a function of (slot, step), so a replacement trains on the dead rank's data.  Kills come from
$ULFMTRAIN_KILL.  Each training rank that ends writes OUT/rank<slot>.json: checksum, the scale after each step
it ran, the scaler's and the schedule's state, the lr, the world history and whether it joined.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

import ulfmtrain

STEPS = 14
out = sys.argv[1]
comm = ulfmtrain.connect()
joined = getattr(comm, "takeover", None) is not None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))
opt = ulfmtrain.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), comm, model=model,
                                     bucket_bytes=256, seed=7)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
comm.track(lr_schedule=sched, grad_scaler=scaler)
scales = {}
while opt.step_count < STEPS:
    step, slot = opt.step_count, comm.world_rank
    g = torch.Generator().manual_seed(1000 * slot + step)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    if step == 2 and slot == 2:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    opt.synchronize(samples=len(y))     # the mean gradient: every rank sees the same overflow
    scaler.step(opt)
    scaler.update()
    sched.step()
    scales[step] = scaler.get_scale()
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "scales": scales, "scaler": scaler.state_dict(),
               "lr": opt.param_groups[0]["lr"], "schedule": sched.state_dict()["last_epoch"],
               "history": comm.world_history, "joined": joined, "steps": opt.step_count}, f)
