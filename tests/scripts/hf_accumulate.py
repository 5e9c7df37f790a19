"""A Hugging-Face-style training loop with gradient accumulation, run by
`python -m ulfmtrain launch -n 3 [--spares 1] -- python hf_accumulate.py OUT [options]`.

The loop every large-model script has: k micro-batches per optimizer step, `(i + 1) % k == 0 or i + 1 ==
len(loader)`, the loss divided by k, gradient clipping of the global mean, a linear warm-up, bf16 autocast,
an evaluation between epochs whose metric is summed over the ranks.  A batch-norm layer makes a one-record
batch an error, as it is in PyTorch.  ExactlyOnceSampler(..., accumulate=k) plans k micro-batches a step
(--no-plan leaves accumulate out, the mistake the sampler must catch).  Kills come from $ULFMTRAIN_KILL;
each training rank that ends writes OUT/rank<slot>.json.
"""
import argparse
import contextlib
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ulfmtrain

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--records", type=int, default=240)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
p.add_argument("--no-plan", action="store_true", help="do not tell the sampler about k")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--loop", choices=["epochs", "set_epoch", "range"], default="epochs")
p.add_argument("--overlap", action="store_true")
p.add_argument("--no-sync", action="store_true", help="wrap the first k-1 backwards in opt.no_sync()")
p.add_argument("--drop-last", action="store_true")
p.add_argument("--bf16", action="store_true")
p.add_argument("--workers", type=int, default=2)
p.add_argument("--metric", choices=["dist", "none"], default="dist")
p.add_argument("--sampler-first", action="store_true", help="make the sampler before the optimizer (no opt given)")
p.add_argument("--finalize", action="store_true", help="MPI.Finalize() at the end (mpi4py imported after ulfmtrain)")
p.add_argument("--cap", action="store_true",
               help="Hugging Face's max_train_steps = epochs x ceil(len(loader) / k), fixed at the start: the loop "
                    "breaks once that many steps completed")
p.add_argument("--skip", default="", metavar="SLOT@I",
               help="slot SLOT's loss is not finite at micro-batch I of the first epoch, and the loop skips the "
                    "batch (`if not torch.isfinite(loss): continue`), with no step for it")
args = p.parse_args()

comm = ulfmtrain.connect()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(args.records + 64, 12, generator=g)
y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0.5).long()
train_set, test_set = TensorDataset(x[:args.records], y[:args.records]), TensorDataset(x[args.records:],
                                                                                       y[args.records:])
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                            torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
plan = {} if args.no_plan else {"accumulate": args.k}
if args.drop_last:
    plan["drop_last"] = True
if args.sampler_first:           # the data first, as examples/dcgan does: the sampler follows the job's optimizers
    sampler = ulfmtrain.ExactlyOnceSampler(len(train_set), comm, batch_size=args.batch, seed=5, **plan)
opt = ulfmtrain.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), comm, model=model,
                                     overlap=args.overlap, bucket_bytes=1024, seed=3)
if not args.sampler_first:
    sampler = ulfmtrain.ExactlyOnceSampler(len(train_set), comm, opt, batch_size=args.batch, seed=5, **plan)
loader = DataLoader(train_set, batch_sampler=sampler, num_workers=args.workers)
warmup = 4
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
comm.track(sched=sched)
autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
norms, accuracy = [], []
max_train_steps = args.epochs * math.ceil(len(loader) / args.k)
completed_steps = 0
skip_slot, skip_at = map(int, args.skip.split("@")) if args.skip else (-1, -1)


def evaluate():
    model.eval()
    with torch.no_grad():
        correct = (model(test_set.tensors[0]).argmax(1) == test_set.tensors[1]).sum()
    model.train()
    total = torch.tensor([float(correct), float(len(test_set))])
    if args.metric == "dist":
        torch.distributed.all_reduce(total)      # the metric over the ranks training now
    return float(total[0] / total[1])


def train_epoch():
    global completed_steps
    for i, (xb, yb) in enumerate(loader):
        last = (i + 1) % args.k == 0 or i + 1 == len(loader)
        quiet = opt.no_sync() if args.no_sync and not last else contextlib.nullcontext()
        with quiet:
            with autocast():
                loss = F.cross_entropy(model(xb), yb) / args.k
            if comm.world_rank == skip_slot and i == skip_at and not accuracy:
                loss = loss * float("nan")
            if args.skip and not torch.isfinite(loss):
                continue
            loss.backward()
        if last:
            if not args.overlap:
                opt.synchronize()                # the mean gradient (with overlap, backward made it)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
            completed_steps += 1
        if args.cap and completed_steps >= max_train_steps:
            break


if args.loop == "epochs":
    for epoch in sampler.epochs(0, args.epochs):
        train_epoch()
        accuracy.append(evaluate())
        print(f"epoch {epoch}: accuracy {accuracy[-1]:.3f}")
else:
    for epoch in range(args.epochs):
        if args.loop == "set_epoch":
            sampler.set_epoch(epoch)
        train_epoch()
        accuracy.append(evaluate())
        print(f"epoch {epoch}: accuracy {accuracy[-1]:.3f}")

with open(os.path.join(args.out, f"rank{comm.world_rank}.json"), "w") as f:
    json.dump({"checksum": opt.checksum(), "steps": opt.step_count, "history": comm.world_history,
               "lr": opt.param_groups[0]["lr"], "norms": norms, "accuracy": accuracy,
               "joined": getattr(comm, "takeover", None) is not None}, f)
if args.finalize:
    from mpi4py import MPI
    slot = comm.world_rank
    MPI.Finalize()
    print(f"slot {slot} after MPI.Finalize()", flush=True)
