"""A user's loop for two SIGKILLs a few ms apart (tests/faults/test_pair_kill.py): `launch -n 3 --spares 1` or
`launch -n 4`, the event log in $ULFMTRAIN_EVENTS.

argv: OUT RECORDS.  Each process writes OUT/pid<launch rank> once MPI is up (before connect: the kills may
fall in the start-up too), and each training rank that ends writes OUT/end<launch rank>.json.
"""
import json
import os
import sys

import torch

import ulfmtrain

out, records = sys.argv[1], int(sys.argv[2])
me = os.environ["OMPI_COMM_WORLD_RANK"]
with open(os.path.join(out, f"pid{me}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid{me}.tmp"), os.path.join(out, f"pid{me}"))
torch.manual_seed(0)
comm = ulfmtrain.connect()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(records, 8, generator=g), torch.randint(0, 4, (records,), generator=g)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm, model=model,
                                     bucket_bytes=256)
sampler = ulfmtrain.ExactlyOnceSampler(records, comm, opt, batch_size=8, seed=3)
for _epoch in sampler.epochs(0, 2):
    for ids in sampler:
        ids = torch.as_tensor(ids)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[ids]), y[ids]).backward()
        opt.step(samples=len(ids))
crc = opt.checksum()
signed = crc - 2**32 if crc >= 2**31 else crc
consistent = comm.agree(signed) == signed and comm.agree(~signed) == ~signed
with open(os.path.join(out, f"end{me}.json"), "w") as f:
    json.dump({"checksum": crc, "consistent": consistent, "history": comm.world_history, "slot": comm.world_rank}, f)
