"""Optimizers that take a closure, in a user's style: `launch -n 3 [--spares 1] -- python closure.py OUT OPT`.

OPT `lbfgs` (torch.optim.LBFGS: up to 5 evaluations a step, the parameters move between them), `sgd` or `adam`.
Each slot fits its own fixed slice of one regression problem, full-batch; every step is `opt.step(closure)`.
Kills come from $ULFMTRAIN_KILL (`1@3:allreduce` fires inside the second evaluation of step 3: LBFGS has moved
the parameters by then).  Each training rank that ends writes OUT/rank<slot>.json: a checksum, the loss each
step returned (the global mean), the world history.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

import ulfmtrain

STEPS = 8
out, kind = sys.argv[1], sys.argv[2]
comm = ulfmtrain.connect()
joined = getattr(comm, "takeover", None) is not None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 1))
if kind == "lbfgs":
    inner = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=4)
elif kind == "sgd":
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
opt = ulfmtrain.DistributedOptimizer(inner, comm, model=model, bucket_bytes=512)
g = torch.Generator().manual_seed(100 + comm.world_rank)
x = torch.randn(32, 6, generator=g)
y = torch.sin(x.sum(dim=1, keepdim=True))
losses = {}
for step in range(comm.step, STEPS):
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    losses[step] = float(opt.step(closure))
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "losses": losses, "joined": joined, "history": comm.world_history}, f)
