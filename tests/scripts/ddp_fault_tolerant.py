"""ddp_torchrun.py made fault-tolerant: `python -m ulfmtrain launch -n 3 [--spares 1] -- python
ddp_fault_tolerant.py OUT`.  The DDP module, model.no_sync(), clip_grad_norm_ after backward, dist.all_reduce,
dist.get_rank() and model.module stay; four places change (tests/examples/test_ddp.py counts them): connect()
instead of init_process_group, the optimizer wrapped, ExactlyOnceSampler instead of DistributedSampler, and
sampler.epochs() instead of range() with set_epoch (a replacement starts at the job's epoch).
"""
import argparse
import contextlib
import json
import os
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ulfmtrain


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    args = p.parse_args()

    comm = ulfmtrain.connect()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 12, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0.5).long()
    train_set, test_set = TensorDataset(x[:240], y[:240]), TensorDataset(x[240:], y[240:])
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = ulfmtrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model)
    sampler = ulfmtrain.ExactlyOnceSampler(len(train_set), comm, opt, batch_size=args.batch, seed=0, drop_last=True,
                                           accumulate=args.accumulate)
    loader = DataLoader(train_set, batch_sampler=sampler, num_workers=2)
    accuracy = []
    for epoch in sampler.epochs(0, args.epochs):
        model.train()
        for i, (xb, yb) in enumerate(loader):
            xb, yb = xb.to(device), yb.to(device)
            last = (i + 1) % args.accumulate == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(xb), yb) / args.accumulate
                loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        model.eval()
        with torch.no_grad():
            xt, yt = test_set.tensors[0].to(device), test_set.tensors[1].to(device)
            correct = torch.tensor([float((model(xt).argmax(1) == yt).sum())])
        dist.all_reduce(correct)
        accuracy.append(float(correct) / (len(test_set) * dist.get_world_size()))
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: accuracy {accuracy[-1]:.3f}")
    state = model.module.state_dict()
    crc = 0
    for k in sorted(state):
        crc = zlib.crc32(state[k].detach().cpu().contiguous().numpy().tobytes(), crc)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "checksum": crc, "accuracy": accuracy,
                   "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                          "MASTER_ADDR", "MASTER_PORT")}}, f)
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
