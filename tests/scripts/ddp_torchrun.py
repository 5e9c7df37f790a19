"""A DistributedDataParallel script as torchrun runs it (`torchrun --nproc-per-node 3 ddp_torchrun.py OUT`), left
unchanged: `python -m ulfmtrain launch -n 3 -- python ddp_torchrun.py OUT` runs it too (launch sets torchrun's
variables), without fault tolerance.  ddp_fault_tolerant.py is this script with the lines that make it
fault-tolerant.

The habits of such scripts: init_process_group, LOCAL_RANK, DDP, a DistributedSampler with shuffle, seed,
drop_last and set_epoch, gradient accumulation under model.no_sync(), bf16 autocast, clip_grad_norm_ right
after backward, an evaluation whose metric is summed with dist.all_reduce, model.module saved by rank 0.
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
from torch.utils.data.distributed import DistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    args = p.parse_args()

    dist.init_process_group("gloo")
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
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=2)
    accuracy = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
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
