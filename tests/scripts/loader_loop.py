"""A user's script whose ranks keep DataLoader workers, training until it is stopped (tests/faults/test_stop.py).

argv: OUT.  Each rank writes OUT/pid<world rank> (its pid) once its workers have fetched a few batches.
"""
import os
import sys

import torch

import ulfmtrain

out = sys.argv[1]
torch.manual_seed(0)
comm = ulfmtrain.connect()
model = torch.nn.Linear(16, 4)
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm, model=model)
data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
sampler = ulfmtrain.ExactlyOnceSampler(len(data), comm, opt, batch_size=8, seed=0)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=2, persistent_workers=True)
steps = 0
for _epoch in sampler.epochs(0, 10**6):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
        if steps == 3:
            path = os.path.join(out, f"pid{os.environ['OMPI_COMM_WORLD_RANK']}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
