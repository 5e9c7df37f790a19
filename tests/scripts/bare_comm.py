"""A script that makes its communicator with FaultTolerantComm() (the older Python API) instead of connect():
`launch -n 3 --spares 1 -- python bare_comm.py OUT`.  Each rank that trains writes OUT/rank<world rank>.json with
the number of ranks it trained with."""
import json
import os
import sys

import torch

import ulfmtrain

comm = ulfmtrain.FaultTolerantComm()
model = torch.nn.Linear(4, 2)
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
with open(os.path.join(sys.argv[1], f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"size": comm.size}, f)
