"""Failure-free step time of the examples' training (examples/mnist, examples/word_language_model) under
ulfmtrain against the same model, data, batch and DataLoader (num_workers=2) under torch DDP on gloo.

    OMP_NUM_THREADS=1 python -m ulfmtrain launch -n 4 -- python benchmarks/examples_vs_ddp.py ulfmtrain mnist
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/examples_vs_ddp.py ddp mnist

Rank 0 prints one JSON line: the median and quartiles of the time between consecutive optimizer steps
(the first epoch left out: start-up), in ms.  Measured figures are in docs/your-script.md.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def build(example: str):
    """The example's model, training set, optimizer class and loss, as the port builds them."""
    torch.manual_seed(1)
    if example == "mnist":
        sys.path.insert(0, str(EXAMPLES / "mnist"))
        from main import Net  # type: ignore[import-not-found]
        from sklearn.datasets import load_digits
        digits = load_digits()
        x = F.interpolate(torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16, size=28, mode="bilinear")
        ds = torch.utils.data.TensorDataset((x[:1500] - 0.1307) / 0.3081, torch.tensor(digits.target)[:1500])
        return Net(), ds, lambda p: torch.optim.Adadelta(p, lr=1.0), lambda out, y: F.nll_loss(out, y), 64
    sys.path.insert(0, str(EXAMPLES / "word_language_model"))
    import data  # type: ignore[import-not-found]
    import pydoc_corpus  # type: ignore[import-not-found]
    from model import TransformerModel  # type: ignore[import-not-found]
    corpus = data.Corpus(pydoc_corpus.ensure("data/pydoc"))
    bptt, n = 35, len(corpus.dictionary)
    t = corpus.train
    ds = [(t[i:i + bptt], t[i + 1:i + 1 + bptt]) for i in range(0, len(t) - bptt - 1, bptt)]
    model = TransformerModel(n, 200, 2, 200, 2, 0.2)
    return model, ds, lambda p: torch.optim.AdamW(p, lr=0.001), lambda out, y: F.nll_loss(out.view(-1, n), y), 20


def batch(example: str, b):
    if example == "mnist":
        return b
    return b[0].t().contiguous(), b[1].t().reshape(-1)


def main(mode: str, example: str, epochs: int = 3) -> None:
    model, ds, make_opt, loss_fn, bs = build(example)
    if mode == "ulfmtrain":
        import ulfmtrain
        comm = ulfmtrain.connect()
        opt = ulfmtrain.DistributedOptimizer(make_opt(model.parameters()), comm, model=model)
        sampler = ulfmtrain.ExactlyOnceSampler(len(ds), comm, opt, batch_size=bs, seed=1)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2)
        rank, size, net, epochs_of = comm.rank, comm.size, model, sampler.epochs(0, epochs)
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        net = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)   # the LM's constant buffer
        opt = make_opt(net.parameters())
        dsampler = torch.utils.data.distributed.DistributedSampler(ds, seed=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=dsampler, num_workers=2)

        def plain(n):
            for e in range(n):
                dsampler.set_epoch(e)
                yield e
        epochs_of = plain(epochs)
    times: list[list[float]] = []
    net.train()
    for _ in epochs_of:
        stamps = [time.perf_counter()]
        for b in loader:
            x, y = batch(example, b)
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            if example != "mnist":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.25)
            opt.step()
            stamps.append(time.perf_counter())
        times.append(list(np.diff(stamps) * 1e3))
    if rank == 0:
        steady = [t for epoch in times[1:] for t in epoch[1:]]    # no start-up, no first step of an epoch
        q1, med, q3 = np.percentile(steady, [25, 50, 75])
        print(json.dumps({"mode": mode, "example": example, "ranks": size, "steps": len(steady),
                          "step_ms_median": round(float(med), 2), "q1": round(float(q1), 2),
                          "q3": round(float(q3), 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
