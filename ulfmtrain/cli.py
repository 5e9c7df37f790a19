"""Command line: `python -m ulfmtrain {train,launch,demo,data}`."""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from pathlib import Path
from typing import Sequence

PROG = "ulfmtrain"


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class _PeerFailed(Exception):
    """Another rank reported the error; this one exits quietly."""


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train under mpirun --with-ft ulfm")
    p.add_argument("--data", default=None, help="directory with train.ulfmds and test.ulfmds")
    p.add_argument("--train", dest="train_file", default=None, help="a ulfmds training file (instead of --data)")
    p.add_argument("--test", dest="test_file", default=None, help="a ulfmds test file (instead of --data)")
    p.add_argument("--model", default="cnn", help="cnn, mlp, or package.module:factory returning an nn.Module")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="batch per rank (kept after a shrink)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reload", choices=("partial", "full"), default="partial",
                   help="after a failure read only my share of the lost records, or re-read my whole shard")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP[:PHASE]",
                   help="SIGKILL a rank (repeatable); PHASE: forward, backward[=FRAC], allreduce, update, recovery")
    p.add_argument("--out", default="ulfmtrain-out", help="directory for rank<N>.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--finalize-timeout", type=float, default=10.0,
                   help="seconds MPI_Finalize may take before the rank exits anyway")


def _dataset_paths(args: argparse.Namespace) -> tuple[Path, Path | None]:
    if args.train_file:
        return Path(args.train_file), Path(args.test_file) if args.test_file else None
    if not args.data:
        raise UsageError("no dataset given: pass --data DIR (create one with `python -m ulfmtrain data digits DIR`)")
    d = Path(args.data)
    if not (d / "train.ulfmds").exists():
        raise UsageError(f"dataset directory {str(d)!r} has no train.ulfmds: "
                         f"create it with `python -m ulfmtrain data digits {d}`")
    test = d / "test.ulfmds"
    return d / "train.ulfmds", test if test.exists() else None


def cmd_train(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    from .comm import FaultTolerantComm, FaultToleranceUnavailable
    from .data import DatasetError, ShardedDataset
    from .faults import KillSpecError, parse_kills
    from .models import build_model
    from .trainer import TrainConfig, Trainer

    torch.set_num_threads(1)   # one rank per core; more threads only fight
    first = MPI.COMM_WORLD.Get_rank() == 0
    try:
        try:
            comm = FaultTolerantComm()
            kills = parse_kills(args.kill, MPI.COMM_WORLD.Get_size())
            train_path, test_path = _dataset_paths(args)
            with ShardedDataset(train_path) as ds:   # header, size and shape checks, same on every rank
                inputs = math.prod(ds.fields[0][2])
                classes = int(ds.meta.get("classes", 10))
            model = build_model(args.model, inputs=inputs, classes=classes)
        except (FaultToleranceUnavailable, KillSpecError, DatasetError, UsageError, ValueError) as exc:
            # Every rank meets these alike: one of them says it.
            if not first:
                raise _PeerFailed from exc
            raise UsageError(str(exc)) from exc
        config = TrainConfig(epochs=args.epochs, batch=args.batch, lr=args.lr, momentum=args.momentum,
                             weight_decay=args.weight_decay, seed=args.seed, reload=args.reload,
                             progress=not args.no_progress)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        error = None
        try:
            trainer = Trainer(model, comm, train_path, test_path, config, kills, args.out)
        except DatasetError as exc:   # e.g. a corrupt record in my shard only
            error = exc
        # Uniform: either every rank loaded its shard or all stop together,
        # rather than the others "recovering" from the one that exited.
        if not comm.agree(0 if error else 1):
            if error:
                raise error
            raise _PeerFailed
        summary = trainer.fit()
        if comm.rank == 0:
            acc = summary["test_acc"]
            print(f"{PROG}: {summary['steps']} steps, world {summary['world_history']}, "
                  f"test accuracy {acc:.4f}" if acc is not None else "", flush=True)
    except _PeerFailed:
        return _finalize(2, args.finalize_timeout)
    except Exception as exc:
        if isinstance(exc, (DatasetError, UsageError)):
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return _finalize(2, args.finalize_timeout)
        raise
    return _finalize(0, args.finalize_timeout)


def _finalize(code: int, timeout: float) -> int:
    """MPI_Finalize after a failure can hang (ompi #11404): results are written, so bound it."""
    from mpi4py import MPI

    def bail() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(timeout, bail)
    timer.daemon = True
    timer.start()
    MPI.Finalize()
    timer.cancel()
    return code


def cmd_launch(args: argparse.Namespace) -> int:
    from .launch import launch

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("launch needs a command after --, e.g. `launch -n 4 -- train --data DIR`")
    return launch(args.n, argv, hostfile=args.hostfile, mpirun_args=args.mpirun_arg)


def cmd_data(args: argparse.Namespace) -> int:
    from . import data

    if args.kind == "digits":
        train, test = data.digits_to_dataset(args.path, test_fraction=args.test_fraction, seed=args.seed)
        for p in (train, test):
            print(f"{p}: {data.ShardedDataset(p).count} records")
    elif args.kind == "synthetic":
        records = args.records or data.records_for_bytes(int(args.mib * 2**20), args.features)
        p = data.synthetic_dataset(args.path, records, features=args.features, classes=args.classes, seed=args.seed)
        print(f"{p}: {records} records, {p.stat().st_size / 2**20:.1f} MiB")
    else:
        with data.ShardedDataset(args.path) as ds:
            print(f"{ds.path}: {ds.count} records of {ds.record_size} bytes; fields "
                  + ", ".join(f"{n} {dt.str}{list(sh)}" for n, dt, sh in ds.fields) + f"; meta {ds.meta}")
            ds.read(0, ds.count)
            print("all record checksums match")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Fault-tolerant data-parallel training on Open MPI ULFM")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)

    p = sub.add_parser("launch", help="run a command under mpirun --with-ft ulfm with the right flags")
    p.add_argument("-n", type=int, required=True, help="number of ranks")
    p.add_argument("--hostfile", default=None, help="hosts for a multi-node run (adds --mca coll ^han)")
    p.add_argument("--mpirun-arg", action="append", default=[], help="extra mpirun argument (repeatable)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- train ...")

    p = sub.add_parser("demo", help="train on digits twice, without and with a SIGKILL, and compare")
    p.add_argument("--out", default="ulfmtrain-demo")
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--kill", default=None, help="kill spec for the faulty run (default: rank 1, mid-epoch, ~60%% in)")
    p.add_argument("--model", default="cnn")
    p.add_argument("--timeout", type=float, default=600.0)

    p = sub.add_parser("data", help="create or check a ulfmds dataset")
    dsub = p.add_subparsers(dest="kind", required=True)
    d = dsub.add_parser("digits", help="scikit-learn's handwritten digits -> DIR/train.ulfmds, DIR/test.ulfmds")
    d.add_argument("path")
    d.add_argument("--test-fraction", type=float, default=0.2)
    d.add_argument("--seed", type=int, default=0)
    d = dsub.add_parser("synthetic", help="a large learnable synthetic set -> PATH")
    d.add_argument("path")
    d.add_argument("--records", type=int, default=None)
    d.add_argument("--mib", type=float, default=64.0, help="size in MiB when --records is not given")
    d.add_argument("--features", type=int, default=1024)
    d.add_argument("--classes", type=int, default=10)
    d.add_argument("--seed", type=int, default=0)
    d = dsub.add_parser("info", help="print a dataset's header and verify every record")
    d.add_argument("path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return cmd_train(args)
    from .data import DatasetError
    from .faults import KillSpecError
    try:
        if args.command == "launch":
            return cmd_launch(args)
        if args.command == "demo":
            from .demo import run_demo
            return run_demo(args)
        return cmd_data(args)
    except (UsageError, DatasetError, KillSpecError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
