"""A loop that evaluates between steps, in a DDP user's style: `launch -n 3 [--spares 1] -- python eval_steps.py OUT`.

`for epoch in range(E): sampler.set_epoch(epoch)`, drop_last=True, bf16 autocast, dropout with seed=, and
overlap=True so that `p.grad` is the global mean when backward returns: `clip_grad_norm_` right after backward
clips the mean, as DDP users write it.  Every EVAL steps (on the job's step, comm.step, so that a replacement
evaluates where its peers do) the model is put in eval mode and the held-out accuracy is summed over the ranks
with comm.allreduce.  Kills come from $ULFMTRAIN_KILL; each training rank that ends writes OUT/rank<slot>.json.
`OUT drift`: after the loop, slot 2 alone runs one more forward in training mode (its batch-norm statistics move
on that rank only), a bug that the end check must find.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ulfmtrain

EPOCHS, EVAL = 2, 3
out, drift = sys.argv[1], sys.argv[2:] == ["drift"]
comm = ulfmtrain.connect()
torch.manual_seed(0)
g = torch.Generator().manual_seed(4)
x = torch.randn(280, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0.3).long()
train_set, test_set = TensorDataset(x[:220], y[:220]), TensorDataset(x[220:], y[220:])
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, 4))
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
                                     overlap=True, bucket_bytes=1024, seed=11)
sampler = ulfmtrain.ExactlyOnceSampler(len(train_set), comm, batch_size=8, seed=2, drop_last=True)
loader = DataLoader(train_set, batch_sampler=sampler, num_workers=1)
accuracy = {}


def evaluate() -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(test_set.tensors[0][comm.rank::comm.size]).argmax(1)
                   == test_set.tensors[1][comm.rank::comm.size]).sum()
    model.train()
    return float(comm.allreduce(float(correct), op="sum")) / len(test_set)


for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()                                       # overlap: p.grad is the global mean now
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if comm.step % EVAL == 0:
            accuracy[comm.step] = evaluate()
if drift and comm.world_rank == 2:
    model(test_set.tensors[0])
with open(os.path.join(out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "accuracy": accuracy, "steps": opt.step_count,
               "history": comm.world_history}, f)
