"""Does the soak's training stay stable for thousands of epochs with no failure, and no ulfmtrain, at all?

The soak's job (benchmarks/bench_soak.py) trains the digits CNN with SGD (lr 0.05, momentum 0.9, weight decay
1e-4, a constant rate, 4 ranks x 16 records a step) for tens of thousands of epochs.  Its first 1000-failure
attempt lost the model at epoch 3811 (test accuracy 0.99 -> chance) with identical replicas and an exact audit.
This runs the same model, optimizer, data and step size in one process, a plain torch loop that reshuffles the
training set each epoch, one seed per process, and reports each seed's test accuracy every --every epochs and the
epoch where it fell below half its best: whether the optimizer itself, without a failure, destroys the model.

Usage: python -P benchmarks/bench_stability.py [--seeds 0 1] [--epochs 4000]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# `python -P` leaves the script's own directory off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_soak import model_quality  # noqa: E402

from ulfmtrain.tools.plots import pyplot, save_figure  # noqa: E402

NAME = "stability"


def train(seed: int, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One seed's run: [(epoch, test accuracy)] every args.every epochs and at the last."""
    import torch
    import torch.nn.functional as F

    from ulfmtrain.data.format import DatasetFile
    from ulfmtrain.training.models import build_model

    torch.set_num_threads(1)        # one core per seed: seeds run side by side

    def tensors(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        f = DatasetFile(data / name)
        rec = f.read(0, f.count)
        return torch.from_numpy(np.array(rec["x"])), torch.from_numpy(np.array(rec["y"]))

    (x, y), (tx, ty) = tensors("train.ulfmds"), tensors("test.ulfmds")
    torch.manual_seed(seed)
    order = torch.Generator().manual_seed(seed)
    model = build_model(args.model, inputs=64, classes=10, shape=tuple(x.shape[1:]))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    accuracy, t0 = [], time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(y), generator=order)
        for i in range(0, len(y), args.batch):          # the epoch's last step is shorter, as in the job
            ids = perm[i:i + args.batch]
            opt.zero_grad()
            F.cross_entropy(model(x[ids]), y[ids]).backward()
            opt.step()
        if (epoch + 1) % args.every == 0 or epoch + 1 == args.epochs:
            model.eval()
            with torch.no_grad():
                accuracy.append((epoch, float((model(tx).argmax(1) == ty).float().mean())))
            model.train()
    return {"seed": seed, "accuracy": accuracy, "train_s": time.perf_counter() - t0,
            "steps": args.epochs * -(-len(y) // args.batch), **model_quality(accuracy)}


def plot(runs: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Test accuracy against epochs, one line per seed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in runs:
        ax.plot(*zip(*r["accuracy"]), lw=1, label=f"seed {r['seed']}" + (
            f": fell at epoch {r['fell_at_epoch']}" if r["fell_at_epoch"] is not None else ""))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{args.model}, SGD lr {args.lr:g} (constant), momentum {args.momentum:g}, weight decay "
                 f"{args.weight_decay:g}, {args.batch} a step; no failure, one process", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--epochs", type=int, default=4000)
    p.add_argument("--every", type=int, default=25, help="test the model every N epochs")
    p.add_argument("--model", default="cnn")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--batch", type=int, default=64, help="records a step (the soak: 4 ranks x 16)")
    p.add_argument("--name", default=NAME, help="results/NAME.json and NAME.png")
    p.add_argument("--results", type=Path, default=common.DEFAULT_RESULTS)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.every < 1 or args.batch < 1:
        p.error("need --epochs, --every and --batch >= 1")
    from ulfmtrain.data.sources import digits_to_dataset

    with tempfile.TemporaryDirectory(prefix="bench_stability.") as tmp:
        data = Path(tmp)
        digits_to_dataset(data)                          # the soak's split (its default seed)
        with ProcessPoolExecutor(max_workers=len(args.seeds)) as pool:
            runs = list(pool.map(train, args.seeds, [data] * len(args.seeds), [args] * len(args.seeds)))
    fell = {r["seed"]: r["fell_at_epoch"] for r in runs}
    headline = {"seeds": len(runs), "collapsed": sum(e is not None for e in fell.values()), "fell_at_epoch": fell,
                "final_accuracy": {r["seed"]: r["final"] for r in runs}}
    path = common.write_result(args.results, args.name, {
        "question": __doc__.split("\n\n")[0], "params": {k: v for k, v in vars(args).items() if k != "results"},
        "headline": headline, "runs": runs})
    png = args.results / f"{args.name}.png"
    plot(runs, args, png)
    for r in runs:
        print(f"seed {r['seed']}: final test accuracy {r['final']:.3f}, best {r['best']:.3f} at epoch "
              f"{r['best_epoch']}, fell below half of it at epoch {r['fell_at_epoch']} ({r['train_s']:.0f} s)")
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
