"""Command line: `python -m ulfmtrain {train,launch,demo,data,supervise,compare}`."""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

PROG = "ulfmtrain"
DEFAULT_BUCKET_BYTES = 25 * 2**20      # optim.DEFAULT_BUCKET_BYTES (not imported: it pulls in torch)


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class _PeerFailed(Exception):
    """Another rank reported the error; this one exits quietly."""


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train under mpirun --with-ft ulfm")
    p.add_argument("--data", default=None, help="directory with train.ulfmds and test.ulfmds")
    p.add_argument("--train", dest="train_file", default=None, help="a ulfmds training file (instead of --data)")
    p.add_argument("--test", dest="test_file", default=None, help="a ulfmds test file (instead of --data)")
    p.add_argument("--model", default="cnn",
                   help="cnn, cnn-bn (with batch norm), mlp, or package.module:factory returning an nn.Module")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="batch per rank (kept after a shrink)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reload", choices=("partial", "full"), default="partial",
                   help="after a failure read only my share of the lost records, or re-read my whole shard")
    p.add_argument("--data-policy", choices=("exactly-once", "lossy"), default="exactly-once",
                   help="exactly-once: a dead rank's uncommitted records of this epoch go to the survivors; "
                        "lossy: they are skipped this epoch (later epochs still cover every record)")
    p.add_argument("--audit", action="store_true",
                   help="log the record ids of every step (check them with `python -m ulfmtrain audit OUT`)")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, help="gradient bucket size in bytes")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP[:PHASE]",
                   help="SIGKILL a rank (repeatable); PHASE: forward, backward[=FRAC], allreduce, commit, update, "
                        "recovery, "
                        "checkpoint (rank 0 only: half-way through writing that step's checkpoint)")
    p.add_argument("--out", default="ulfmtrain-out", help="directory for rank<N>.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--finalize-timeout", type=float, default=5.0,
                   help="seconds MPI_Finalize may take before the rank exits anyway")
    g = p.add_argument_group("recovery mode and checkpoints (see docs/recovery-modes.md)")
    g.add_argument("--recovery", choices=("shrink", "restart", "reinit"), default="shrink",
                   help="shrink: survivors train on (ULFM, default); restart: a failure ends the job and "
                        "`ulfmtrain supervise` relaunches it from the latest checkpoint (plain MPI, no --with-ft); "
                        "reinit: survivors spawn replacements and every rank rolls back to the checkpoint")
    g.add_argument("--ckpt-dir", default=None, help="directory for atomic checkpoints (rank 0 writes)")
    g.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="checkpoint every K steps")
    g.add_argument("--ckpt-epoch", action="store_true",
                   help="checkpoint at every epoch end (the default when --ckpt-every is not given)")
    g.add_argument("--ckpt-strategy", choices=("blocking", "overlapped"), default="blocking",
                   help="blocking: ranks wait while rank 0 writes; overlapped: rank 0 snapshots and a "
                        "background thread writes")
    g.add_argument("--ckpt-inflight", type=int, default=2, help="overlapped writes in flight before training waits")
    g.add_argument("--ckpt-keep", type=int, default=3, help="checkpoints kept on disk (at least 2)")
    g.add_argument("--resume", action="store_true", help="start from the latest good checkpoint in --ckpt-dir")


def _dataset_paths(args: argparse.Namespace) -> tuple[Path, Path | None]:
    if args.train_file:
        return Path(args.train_file), Path(args.test_file) if args.test_file else None
    if not args.data:
        raise UsageError("no dataset given: pass --data DIR (create one with `python -m ulfmtrain data digits DIR`)")
    from .data.format import dataset_paths
    return dataset_paths(args.data)


def cmd_train(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    from .checkpoint.checkpointer import checkpointer_from_args
    from .checkpoint.format import CheckpointError
    from .comm import FaultTolerantComm, FaultToleranceUnavailable, PlainComm
    from .data.format import DatasetError, DatasetFile
    from .faults import KillSpecError, parse_kills
    from .models import build_model
    from .trainer import TrainConfig, Trainer

    torch.set_num_threads(1)   # one rank per core; more threads only fight
    first = MPI.COMM_WORLD.Get_rank() == 0
    try:
        try:
            if args.recovery == "reinit":
                from .reinit import join_world
                comm = join_world()     # a replacement spawned by a rebuild joins its spawners here
            elif args.recovery == "restart":
                comm = PlainComm()      # classic: a failure ends the job, the supervisor relaunches it
            else:
                comm = FaultTolerantComm()
            kills = parse_kills(args.kill, comm.size)
            checkpointer_from_args(args)   # check the checkpoint flags before any rank trains
            train_path, test_path = _dataset_paths(args)
            with DatasetFile(train_path) as ds:   # header, size and shape checks, same on every rank
                inputs = math.prod(ds.fields[0][2])
                classes = int(ds.meta.get("classes", 10))
            torch.manual_seed(args.seed)   # the same --seed gives the same initial model
            model = build_model(args.model, inputs=inputs, classes=classes)
        except (FaultToleranceUnavailable, KillSpecError, DatasetError, UsageError, ValueError) as exc:
            # Every rank meets these alike: one of them says it.
            if not first:
                raise _PeerFailed from exc
            raise UsageError(str(exc)) from exc
        config = TrainConfig(epochs=args.epochs, batch=args.batch, lr=args.lr, momentum=args.momentum,
                             weight_decay=args.weight_decay, seed=args.seed, reload=args.reload,
                             data_policy=args.data_policy, audit=args.audit, bucket_bytes=args.bucket_bytes,
                             progress=not args.no_progress, recovery=args.recovery)
        Path(args.out).mkdir(parents=True, exist_ok=True)

        def build(comm, kills, resume: bool):
            error = None
            t_init, t0 = time.time(), time.perf_counter()
            try:
                trainer = Trainer(model, comm, train_path, test_path, config, kills, args.out,
                                  checkpointer=checkpointer_from_args(args, resume))
            except DatasetError as exc:   # e.g. a corrupt record in my shard only
                error = exc
            init_ms = (time.perf_counter() - t0) * 1e3
            # Uniform: either every rank loaded its shard or all stop together,
            # rather than the others "recovering" from the one that exited.
            if not comm.agree(0 if error else 1):
                if error:
                    raise error
                raise _PeerFailed
            if args.recovery != "shrink":
                # Reading the whole shard is the data reload of a restart: compare times it.
                trainer.log("ready", t_init=t_init, init_ms=init_ms, load_ms=trainer.load_ms,
                            bytes_read=trainer.train.bytes_read, recovery=args.recovery, world=comm.size)
            return trainer

        trainer = build(comm, kills, getattr(comm, "replacement", False))
        if args.recovery == "reinit":
            from .reinit import fit_with_reinit
            summary = fit_with_reinit(trainer, build, kills)
        else:
            summary = trainer.fit()
        if comm.rank == 0:
            acc = summary["test_acc"]
            tail = f", test accuracy {acc:.4f}" if acc is not None else ""
            print(f"{PROG}: {summary['steps']} steps, world {summary['world_history']}{tail}", flush=True)
    except _PeerFailed:
        return _finalize(2, args.finalize_timeout)
    except Exception as exc:
        if isinstance(exc, (DatasetError, UsageError)):
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return _finalize(2, args.finalize_timeout)
        if isinstance(exc, CheckpointError):   # raised alike on every rank: rank 0 says it
            if comm.rank == 0:
                print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return _finalize(2, args.finalize_timeout)
        traceback.print_exc()                  # unexpected: still leave through the bounded finalize
        return _finalize(1, args.finalize_timeout)
    return _finalize(0, args.finalize_timeout)


def _finalize(code: int, timeout: float) -> int:
    """MPI_Finalize after a failure can hang (ompi #11404): results are written, so bound it."""
    from .lifecycle import finalize
    return finalize(timeout, code)


def cmd_launch(args: argparse.Namespace) -> int:
    from .launch import launch

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("launch needs a command after --, e.g. `launch -n 4 -- train --data DIR`")
    return launch(args.n, argv, hostfile=args.hostfile, mpirun_args=args.mpirun_arg)


def cmd_data(args: argparse.Namespace) -> int:
    from .data.format import DatasetFile
    from .data.sources import digits_to_dataset, records_for_bytes, synthetic_dataset

    if args.kind == "digits":
        train, test = digits_to_dataset(args.path, test_fraction=args.test_fraction, seed=args.seed)
        for p in (train, test):
            print(f"{p}: {DatasetFile(p).count} records")
    elif args.kind == "synthetic":
        records = args.records or records_for_bytes(int(args.mib * 2**20), args.features)
        p = synthetic_dataset(args.path, records, features=args.features, classes=args.classes, seed=args.seed)
        print(f"{p}: {records} records, {p.stat().st_size / 2**20:.1f} MiB")
    else:
        with DatasetFile(args.path) as ds:
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

    from . import audit, compare, supervise   # light imports: no MPI, no torch
    audit.add_arguments(sub.add_parser(
        "audit", help="check from a run's logs (train --audit) that every record was seen exactly once per epoch"))
    supervise.add_arguments(sub.add_parser(
        "supervise", help="checkpoint-restart: relaunch mpirun from the latest checkpoint after a failure"))
    compare.add_arguments(sub.add_parser(
        "compare", help="the same job under shrink, restart and reinit: lost time per failure, table, JSON, PNGs"))

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
    from .data.format import DatasetError
    from .faults import KillSpecError
    try:
        if args.command == "launch":
            return cmd_launch(args)
        if args.command == "demo":
            from .demo import run_demo
            return run_demo(args)
        if args.command == "supervise":
            from .supervise import main as supervise_main
            return supervise_main(args)
        if args.command == "audit":
            from .audit import main as audit_main
            return audit_main(args.out)
        if args.command == "compare":
            from .compare import main as compare_main
            return compare_main(args)
        return cmd_data(args)
    except (UsageError, DatasetError, KillSpecError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
