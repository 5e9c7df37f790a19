"""A bag-of-words classifier with a sparse embedding (nn.EmbeddingBag(sparse=True)), run by
`python -m ulfmtrain launch -n 3 [--spares 1] -- python sparse_embedding.py OUT [--overlap]`.

model.zero_grad() sets the gradients to None, so the embedding's next gradient is a sparse tensor: it is
reduced dense (before, "reshape is not implemented for sparse tensors" on every rank).  The model is a
ModuleDict whose members the loop calls: their forwards begin each step (the generators a spare receives).
Kills come from $ULFMTRAIN_KILL; each training rank that ends writes OUT/rank<slot>.json.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ulfmtrain

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--overlap", action="store_true")
args = p.parse_args()

comm = ulfmtrain.connect()
torch.manual_seed(0)
g = torch.Generator().manual_seed(2)
words = torch.randint(0, 200, (180, 6), generator=g)
labels = (words % 7 == 0).any(1).long()
dataset = TensorDataset(words, labels)
# A container never called itself, its members called one by one, dropout in one: a spare redoes the step in
# flight with the generators as that step began (before, its hook was on the dict and never fired).
model = torch.nn.ModuleDict({"embed": torch.nn.EmbeddingBag(200, 16, mode="mean", sparse=True),
                             "head": torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))})
opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), comm, model=model,
                                     overlap=args.overlap)
sampler = ulfmtrain.ExactlyOnceSampler(len(dataset), comm, opt, batch_size=10, seed=1)
loader = DataLoader(dataset, batch_sampler=sampler)
for epoch in sampler.epochs(0, 2):
    for x, y in loader:
        model.zero_grad()                     # set_to_none: the embedding's gradient comes back sparse
        loss = F.cross_entropy(model["head"](model["embed"](x)), y)
        loss.backward()
        opt.step()
    print(f"epoch {epoch}: last loss {loss.item():.3f}")
with open(os.path.join(args.out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "steps": opt.step_count, "history": comm.world_history}, f)
