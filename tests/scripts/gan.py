"""A GAN in a user's style: two models, two optimizers, one step of each per iteration (D, then G).

`launch -n 3 [--spares 1] -- python gan.py OUT [DIE]`.  Each slot's real data and noise are functions of
(slot, iteration), so a replacement trains on the dead rank's data.  DIE = SLOT@ITER:WHERE makes that slot
SIGKILL itself at iteration ITER, WHERE `d` (before D's step) or `g` (after D's step committed, before G's),
or (WHERE `swap`) step G before D there, a bug; kills of $ULFMTRAIN_KILL fire too.  Each training rank that
ends writes OUT/rank<slot>.json: a checksum of both models and both optimizers, the iterations each optimizer
committed, and whether it took a dead slot.
"""
import json
import os
import signal
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn

import ulfmtrain

ITERS = 12
out = sys.argv[1]
die = sys.argv[2] if len(sys.argv) > 2 else ""
comm = ulfmtrain.connect()
joined = getattr(comm, "takeover", None) is not None
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
D = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
opt_d = ulfmtrain.DistributedOptimizer(torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999)), comm,
                                       model=D, bucket_bytes=4096)
opt_g = ulfmtrain.DistributedOptimizer(torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999)), comm,
                                       model=G, bucket_bytes=512)


def maybe_die(it: int, where: str) -> None:
    if die and not joined and die == f"{comm.world_rank}@{it}:{where}":
        os.kill(os.getpid(), signal.SIGKILL)


def step_d(real, z, ones, zeros):
    opt_d.zero_grad()
    loss_d = (F.binary_cross_entropy_with_logits(D(real), ones)
              + F.binary_cross_entropy_with_logits(D(G(z).detach()), zeros))
    loss_d.backward()
    opt_d.step()


def step_g(z, ones):
    opt_g.zero_grad()
    F.binary_cross_entropy_with_logits(D(G(z)), ones).backward()
    opt_g.step()


for it in range(comm.step, ITERS):
    g = torch.Generator().manual_seed(1000 * comm.world_rank + it)
    real, z = torch.randn(16, 8, generator=g) * 0.5 + 1.0, torch.randn(16, 4, generator=g)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    maybe_die(it, "d")
    if die == f"{comm.world_rank}@{it}:swap":
        step_g(z, ones)
        step_d(real, z, ones, zeros)
        continue
    step_d(real, z, ones, zeros)
    maybe_die(it, "g")
    step_g(z, ones)

crc = 0
for obj in (G, D, opt_g, opt_d):
    for v in obj.state_dict().values() if isinstance(obj, nn.Module) else [obj.state_dict()["state"]]:
        for t in v.values() if isinstance(v, dict) else [v]:
            for x in t.values() if isinstance(t, dict) else [t]:
                if isinstance(x, torch.Tensor):
                    crc = zlib.crc32(x.detach().contiguous().numpy().tobytes(), crc)
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": crc, "steps": [opt_d.step_count, opt_g.step_count], "joined": joined,
               "history": comm.world_history}, f)
