"""Command line: `python -m ulfmtrain {train,launch,demo,audit,data,supervise,compare}`."""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from .core.modes import (
    PROG,
    CheckpointStrategy,
    DataPolicy,
    Device,
    LrScaling,
    LrSchedule,
    Phase,
    Recovery,
    Reload,
    Replace,
    UsageError,
    choices,
)
from .training.config import DEFAULT_BATCH, DEFAULT_BUCKET_BYTES, TrainJob

T = TypeVar("T")


def _device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=choices(Device), default=Device.CPU.value,
                   help="cpu; cuda: each rank takes cuda:(local rank %% GPUs), several may share one; "
                        "auto: cuda when torch sees a GPU")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train under mpirun --with-ft ulfm")
    p.add_argument("--data", default=None, help="directory with train.ulfmds and test.ulfmds")
    p.add_argument("--train", dest="train_file", default=None, help="a ulfmds training file (instead of --data)")
    p.add_argument("--test", dest="test_file", default=None, help="a ulfmds test file (instead of --data)")
    p.add_argument("--model", default="cnn",
                   help="cnn, cnn-bn (with batch norm), mlp, resnet18 (32x32 images), or package.module:factory "
                        "returning an nn.Module")
    _device_flag(p)
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="batch per rank (kept after a shrink)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate at the starting world size (SGD)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay (L2)")
    p.add_argument("--lr-scaling", choices=choices(LrScaling), default=LrScaling.LINEAR.value,
                   help="linear: after a shrink or a join the learning rate follows the global batch "
                        "(lr x live ranks / ranks at the start); none: keep --lr at any world size")
    p.add_argument("--lr-schedule", choices=choices(LrSchedule), default=LrSchedule.CONSTANT.value,
                   help="constant: --lr throughout; cosine: torch's CosineAnnealingLR from --lr down to 0 over "
                        "the steps of a failure-free run (its state is handed to a spare or a newcomer)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability before the built-in model's classifier (default 0: none); each "
                        "step's masks are seeded from --seed, the slot and the step, so a replacement draws "
                        "the dead rank's masks")
    p.add_argument("--amp", action="store_true",
                   help="mixed precision: float16 autocast (on the CPU too) with a GradScaler, whose scale "
                        "travels to a replacement; a step whose gradients overflow is skipped on every rank")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initial model and the record order of every epoch (same seed, same run)")
    p.add_argument("--reload", choices=choices(Reload), default=Reload.PARTIAL.value,
                   help="after a failure read only my share of the lost records, or re-read my whole shard")
    p.add_argument("--data-policy", choices=choices(DataPolicy), default=DataPolicy.EXACTLY_ONCE.value,
                   help="exactly-once: a dead rank's uncommitted records of this epoch go to the survivors; "
                        "lossy: they are skipped this epoch (later epochs still cover every record)")
    p.add_argument("--audit", action="store_true",
                   help="log the record ids of every step (check them with `python -m ulfmtrain audit OUT`)")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, help="gradient bucket size in bytes")
    p.add_argument("--overlap", action="store_true",
                   help="reduce each gradient bucket on a communication thread while backward still runs "
                        "(bit-identical results)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP[:PHASE][/KIND]",
                   help="make a rank fail (repeatable); PHASE: "
                        + ", ".join(choices(Phase)).replace("backward", "backward[=FRAC]")
                        + " (checkpoint: rank 0 only, half-way through writing that step's checkpoint); KIND: "
                        "kill (SIGKILL, the default), raise (an uncaught exception), exit[=CODE] (sys.exit), "
                        "term (SIGTERM), int (SIGINT), stop[=S] (SIGSTOP; SIGCONT S seconds later), hang (a "
                        "deadlock), wedge (a deadlock inside the next reduction's MPI call)")
    p.add_argument("--out", default="ulfmtrain-out", help="directory for rank<N>.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0 (logs and CI)")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="the last K ranks are hot spares: they wait, and take a dead rank's slot with the "
                        "survivors' live state (launch -n N --spares K starts N + K ranks)")
    p.add_argument("--replace", choices=choices(Replace), default=Replace.NONE.value,
                   help="respawn: once no spare is left, spawn replacements in the background while the "
                        "survivors train on; they join at a step boundary with the live state (and refill "
                        "the spares)")
    p.add_argument("--finalize-timeout", type=float, default=5.0,
                   help="seconds MPI_Finalize may take before the rank exits anyway")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="the least time without progress after which a rank is hung and evicted like a killed "
                        "one (SIGSTOP, a deadlock, a stuck DataLoader); the bound is the larger of S and 10 "
                        "agreed steps (default S: $ULFMTRAIN_STEP_TIMEOUT, else 60)")
    p.add_argument("--straggler", type=float, default=None, metavar="F",
                   help="evict a rank whose own work per step takes F times its peers' median, with one line "
                        "(default: $ULFMTRAIN_STRAGGLER, else off)")
    g = p.add_argument_group("recovery mode and checkpoints (see docs/recovery-modes.md)")
    g.add_argument("--recovery", choices=choices(Recovery), default=Recovery.SHRINK.value,
                   help="shrink: survivors train on (ULFM, default); restart: a failure ends the job and "
                        "`ulfmtrain supervise` relaunches it from the latest checkpoint (plain MPI, no --with-ft); "
                        "reinit: survivors spawn replacements and every rank rolls back to the checkpoint")
    g.add_argument("--ckpt-dir", default=None, help="directory for atomic checkpoints (rank 0 writes)")
    g.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="checkpoint every K steps")
    g.add_argument("--ckpt-epoch", action="store_true",
                   help="checkpoint at every epoch end (the default when --ckpt-every is not given)")
    g.add_argument("--ckpt-strategy", choices=choices(CheckpointStrategy), default=CheckpointStrategy.BLOCKING.value,
                   help="blocking: ranks wait while rank 0 writes; overlapped: rank 0 snapshots and a "
                        "background thread writes")
    g.add_argument("--ckpt-inflight", type=int, default=2, help="overlapped writes in flight before training waits")
    g.add_argument("--ckpt-keep", type=int, default=3, help="checkpoints kept on disk (at least 2)")
    g.add_argument("--resume", action="store_true", help="start from the latest good checkpoint in --ckpt-dir")


def cmd_train(args: argparse.Namespace) -> int:
    from .job.run import run

    return run(TrainJob.from_args(args))


def cmd_launch(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from .job.script import REPLACE_ENV, SPARES_ENV
    from .launching import slurm
    from .launching.launch import COMMANDS, launch

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("launch needs a command after --, e.g. `launch -n 4 -- python train.py ARGS` "
                         "or `launch -n 4 -- train --data DIR`")
    if args.n is not None and args.n < 1:
        raise UsageError(f"-n {args.n}: give the number of training ranks, at least 1")
    if args.spares < 0:
        raise UsageError(f"--spares {args.spares}: give the number of hot spares, 0 or more")
    if argv[0] in COMMANDS:
        argv += [*(["--spares", str(args.spares)] if args.spares else []),
                 *(["--replace", args.replace] if args.replace != Replace.NONE else [])]
    else:
        # A script of your own: ulfmtrain.connect() reads these (a spare waits there; respawn reruns the script).
        os.environ[SPARES_ENV] = str(args.spares)
        os.environ[REPLACE_ENV] = args.replace
        # One thread per rank unless told otherwise (torchrun's default): ranks share the cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix="ulfmtrain-launch.") as tmp:
            # Inside a Slurm allocation the hosts and slots are the allocation's (launching/slurm.py).
            plan = slurm.resolve(args.n, args.spares, args.hostfile, args.agent, args.net, tmp)
            return launch(plan.ranks + args.spares, argv, hostfile=plan.hostfile,
                          mpirun_args=[*plan.mpirun_args, *args.mpirun_arg], rsh=plan.rsh, net=plan.net,
                          keepalive=args.keepalive, wdir=args.wdir, slots=plan.ranks)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_data(args: argparse.Namespace) -> int:
    from .data.format import DatasetFile
    from .data.sources import digits_to_dataset, records_for_bytes, synthetic_dataset

    if args.kind == "digits":
        train, test = digits_to_dataset(args.path, test_fraction=args.test_fraction, seed=args.seed)
        for p in (train, test):
            print(f"{p}: {DatasetFile(p).count} records")
    elif args.kind == "synthetic":
        features = math.prod(args.shape) if args.shape else args.features
        records = args.records or records_for_bytes(int(args.mib * 2**20), features)
        p = synthetic_dataset(args.path, records, features=args.features, classes=args.classes, seed=args.seed,
                              shape=args.shape)
        print(f"{p}: {records} records, {p.stat().st_size / 2**20:.1f} MiB")
    else:
        with DatasetFile(args.path) as ds:
            print(f"{ds.path}: {ds.count} records of {ds.record_size} bytes; fields "
                  + ", ".join(f"{n} {dt.str}{list(sh)}" for n, dt, sh in ds.fields) + f"; meta {ds.meta}")
            ds.read(0, ds.count)
            print("all record checksums match")
    return 0


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape: give sizes like 3,32,32") from None
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 1")
    return shape


def _options(cls: type[T], args: argparse.Namespace) -> T:
    """A command's typed options from its parsed flags."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def _train_job(argv: Sequence[str]) -> TrainJob:
    """The train job after supervise's `--`; without --recovery, restart (plain MPI, relaunched from checkpoints)."""
    argv = list(argv[1:] if argv and argv[0] == "--" else argv)
    if not argv or argv[0] != "train":
        raise UsageError("supervise needs a train command after --, e.g. "
                         "`supervise -n 4 -- train --data DIR --recovery restart --ckpt-dir CKPT --ckpt-every 20`")
    job = TrainJob.from_args(build_parser().parse_args(argv))
    if not any(a == "--recovery" or a.startswith("--recovery=") for a in argv):
        job.recovery = Recovery.RESTART
    return job


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Fault-tolerant data-parallel training on Open MPI ULFM")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)

    p = sub.add_parser("launch", help="run `python script.py ...` (or `train ...`) on N ranks under mpirun "
                                      "--with-ft ulfm with the right flags")
    p.add_argument("-n", type=int, default=None,
                   help="number of training ranks (inside a Slurm allocation: every task slot but the spares')")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="start K more ranks as hot spares: they wait, and take a dead rank's place with the "
                        "survivors' live state")
    p.add_argument("--replace", choices=choices(Replace), default=Replace.NONE.value,
                   help="respawn: once no spare is left, start a replacement process in the background (it runs "
                        "the same command)")
    p.add_argument("--hostfile", default=None, help="hosts for a multi-node run (adds --mca coll ^han)")
    p.add_argument("--agent", default=None, metavar="RSH",
                   help="no daemon on the hosts: start each rank through RSH (e.g. ssh), so a whole host can die; "
                        "needs --hostfile and --net; `slurm`: each rank a job step of its own (srun), inside an "
                        "allocation")
    p.add_argument("--net", default=None, metavar="CIDR",
                   help="with --agent: the cluster network, e.g. 10.0.0.0/24 (inside a Slurm allocation: by default "
                        "the network of this host's route to the nodes)")
    p.add_argument("--keepalive", type=float, default=None, metavar="S",
                   help="with --agent: a host silent for S seconds (link cut, frozen) is dropped, and stops "
                        "itself (default 10; ssh gets matching ServerAlive options)")
    p.add_argument("--wdir", default=None, metavar="DIR",
                   help="the directory every rank starts in, on every host (default: this one; it must exist at "
                        "the same path on every host)")
    p.add_argument("--mpirun-arg", action="append", default=[], help="extra mpirun argument (repeatable)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- python script.py ARGS, or -- train ...")

    p = sub.add_parser("demo", help="train on digits twice, without and with a SIGKILL, and compare")
    p.add_argument("--out", default="ulfmtrain-demo", help="directory for the runs, the report and the figure")
    p.add_argument("-n", "--ranks", type=int, default=4, help="training ranks")
    p.add_argument("--epochs", type=int, default=20, help="epochs of each run")
    p.add_argument("--kill", default=None, help="kill spec for the faulty run (default: rank 1, mid-epoch, ~60%% in)")
    p.add_argument("--model", default="cnn", help="cnn, cnn-bn, mlp or package.module:factory (as train --model)")
    _device_flag(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is killed")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="also run with K hot spares: it ends bit-identical to the failure-free run")

    p = sub.add_parser("audit", help="check from a run's logs (train --audit, or a script's ULFMTRAIN_EVENTS) that "
                                     "every record was seen exactly once per epoch (status 0; 1: not; 3: an "
                                     "unfinished epoch, not judged)")
    p.add_argument("out", type=Path, help="the --out directory of a `train --audit` run, or the ULFMTRAIN_EVENTS "
                                          "directory of a script with an ExactlyOnceSampler")

    p = sub.add_parser("supervise",
                       help="checkpoint-restart: relaunch mpirun from the latest checkpoint after a failure")
    p.add_argument("-n", type=int, default=None,
                   help="number of ranks of the first attempt (inside a Slurm allocation: every task slot)")
    p.add_argument("--max-attempts", type=int, default=5, help="launches in all, the first included")
    p.add_argument("--relaunch", choices=("same", "fewer"), default="same",
                   help="relaunch with the same number of ranks, or one fewer per failed rank")
    p.add_argument("--min-ranks", type=int, default=1, help="with --relaunch fewer: never go below this")
    p.add_argument("--timeout", type=float, default=None, help="seconds one attempt may take before it is killed")
    p.add_argument("--mpirun-arg", action="append", default=[], help="extra mpirun argument (repeatable)")
    p.add_argument("--hostfile", default=None,
                   help="run each attempt on the hosts that answer a TCP probe (a dead host is left out); inside "
                        "a Slurm allocation the default is its nodes whose slurmd answers")
    p.add_argument("--probe-port", type=int, default=22, help="the port the host probe connects to (ssh's)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="kill an attempt whose ranks have not started training after S seconds (a hung launch)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- train ... --recovery restart --ckpt-dir DIR ...")

    p = sub.add_parser("compare", help="the same job under shrink, restart, reinit and respawn: lost time per failure, "
                                       "table, JSON, PNGs")
    p.add_argument("--out", default="ulfmtrain-compare", help="directory for the runs and the report")
    p.add_argument("--data", default=None, help="dataset directory (default: digits, created in OUT/data)")
    p.add_argument("--synthetic", type=float, default=None, metavar="MIB",
                   help="use a synthetic dataset of this many MiB instead of digits")
    p.add_argument("--features", type=int, default=1024, help="features per synthetic record")
    p.add_argument("--model", default=None, help="cnn, mlp or package.module:factory (default: cnn on digits, "
                                                  "mlp on synthetic data; ulfmtrain.training.models:large_mlp is a "
                                                  "6.3 M-parameter MLP for synthetic data)")
    _device_flag(p)
    p.add_argument("-n", "--ranks", type=int, default=4, help="training ranks of every run")
    p.add_argument("--epochs", type=int, default=5, help="epochs of every run")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="batch per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and of the record order (as train --seed)")
    p.add_argument("--kill", action="append", default=None, metavar="RANK@STEP[:PHASE][/KIND]",
                   help="kill schedule (repeatable; default: rank 1 about 60%% through, half-way between checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=20, metavar="K", help="checkpoint every K steps (restart, reinit)")
    p.add_argument("--modes", default=",".join([*choices(Recovery), "respawn"]),
                   help="comma-separated subset of shrink,restart,reinit,respawn (respawn: shrink with "
                        "--replace respawn)")
    p.add_argument("--strategies", default=",".join(choices(CheckpointStrategy)),
                   help="checkpoint strategies to run restart and reinit with: blocking,overlapped")
    p.add_argument("--no-reference", action="store_true", help="skip the failure-free reference run")
    p.add_argument("--max-attempts", type=int, default=4, help="supervisor attempt limit of the restart runs")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="also a shrink run with K hot spares (its final checksum is compared with the "
                        "failure-free one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")

    p = sub.add_parser("data", help="create or check a ulfmds dataset")
    dsub = p.add_subparsers(dest="kind", required=True)
    d = dsub.add_parser("digits", help="scikit-learn's handwritten digits -> DIR/train.ulfmds, DIR/test.ulfmds")
    d.add_argument("path", help="directory to write train.ulfmds and test.ulfmds into")
    d.add_argument("--test-fraction", type=float, default=0.2, help="share of the records held out as the test set")
    d.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    d = dsub.add_parser("synthetic", help="a large learnable synthetic set -> PATH")
    d.add_argument("path", help="the .ulfmds file to write")
    d.add_argument("--records", type=int, default=None, help="number of records (default: as many as --mib holds)")
    d.add_argument("--mib", type=float, default=64.0, help="size in MiB when --records is not given")
    d.add_argument("--features", type=int, default=1024, help="float32 features per record")
    d.add_argument("--shape", type=_shape, default=None, metavar="C,H,W",
                   help="store records in this shape (e.g. 3,32,32 for CIFAR-10's); replaces --features")
    d.add_argument("--classes", type=int, default=10, help="number of labels the records fall into")
    d.add_argument("--seed", type=int, default=0, help="seed of the generator (same seed, same file)")
    d = dsub.add_parser("info", help="print a dataset's header and verify every record")
    d.add_argument("path", help="the .ulfmds file to check")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return cmd_train(args)
    from .data.format import DatasetError
    from .transport.faults import KillSpecError
    try:
        if args.command == "launch":
            return cmd_launch(args)
        if args.command == "demo":
            from .tools.demo import DemoOptions, run_demo
            return run_demo(_options(DemoOptions, args))
        if args.command == "supervise":
            from .launching import slurm, supervise
            try:       # inside a Slurm allocation, its nodes (unless a hostfile is given)
                allocation = None if args.hostfile else slurm.Allocation.from_env()
            except slurm.SlurmError as exc:
                raise UsageError(str(exc)) from None
            return supervise.main(args.n, _train_job(args.argv), max_attempts=args.max_attempts,
                                  relaunch=args.relaunch, min_ranks=args.min_ranks, timeout=args.timeout,
                                  mpirun_args=args.mpirun_arg, hostfile=args.hostfile, probe_port=args.probe_port,
                                  start_timeout=args.start_timeout, allocation=allocation)
        if args.command == "audit":
            from .tools.audit import main as audit_main
            return audit_main(args.out)
        if args.command == "compare":
            from .tools.compare import CompareOptions
            from .tools.compare import main as compare_main
            return compare_main(_options(CompareOptions, args))
        return cmd_data(args)
    except (UsageError, DatasetError, KillSpecError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
