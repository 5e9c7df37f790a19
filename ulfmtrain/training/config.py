"""The train job, typed: every `train` flag with its default and its cross-flag checks, and back to argv.

Everything that starts or restarts a job (`train`, `supervise`, reinit's
replacements, `compare`, `demo`, the benchmarks) builds a TrainJob; nobody
edits a train command line by hand.  Light to import: no torch, no MPI.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.modes import (
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
)
from ..transport.faults import parse_kill

if TYPE_CHECKING:
    from ..checkpoint.checkpointer import Checkpointer

DEFAULT_BUCKET_BYTES = 25 * 2**20    # gradient bucket size (torch DDP's default)
DEFAULT_BATCH = 16                   # records per rank and step


@dataclass
class TrainConfig:
    """Hyper-parameters and data policy of one run."""

    epochs: int = 20
    batch: int = DEFAULT_BATCH   # per rank; stays the same after a shrink (a short queue gives a short batch)
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    lr_scaling: LrScaling = LrScaling.LINEAR   # after a shrink or a join, lr follows the global batch
    lr_schedule: LrSchedule = LrSchedule.CONSTANT
    dropout: float = 0.0         # before the built-in models' classifier (0: no dropout layer)
    amp: bool = False            # float16 autocast and a GradScaler
    seed: int = 0
    reload: Reload = Reload.PARTIAL
    data_policy: DataPolicy = DataPolicy.EXACTLY_ONCE
    audit: bool = False          # log the record ids of every step attempt (python -m ulfmtrain audit OUT)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = False        # reduce each bucket while backward runs (bit-identical to not overlapping)
    progress: bool = True
    step_timeout: float | None = None  # the hang watch's floor (hangs.py); None: $ULFMTRAIN_STEP_TIMEOUT or 60 s
    straggler: float | None = None     # evict a rank this many times slower than its peers (hangs.py); None: off


@dataclass
class CheckpointOptions:
    """Where and when checkpoints are written, and whether to start from one."""

    directory: Path | None = None
    every: int = 0                # steps between checkpoints (0: none by count)
    epoch: bool = False           # at every epoch end (the default when `every` is 0)
    strategy: CheckpointStrategy = CheckpointStrategy.BLOCKING
    inflight: int = 2
    keep: int = 3
    resume: bool = False


@dataclass
class TrainJob:
    """One `train` run: data, model, config, kills, recovery mode, checkpoints and outputs."""

    data: Path | None = None          # a directory with train.ulfmds (and test.ulfmds)
    train_file: Path | None = None    # or the files themselves
    test_file: Path | None = None
    model: str = "cnn"
    config: TrainConfig = field(default_factory=TrainConfig)
    kill_specs: list[str] = field(default_factory=list)     # RANK@STEP[:PHASE][/KIND], checked against the world size
    recovery: Recovery = Recovery.SHRINK
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    out: Path = Path("ulfmtrain-out")
    finalize_timeout: float = 5.0
    spares: int = 0                   # the last K ranks wait and take dead ranks' slots (shrink mode)
    replacement: Replace = Replace.NONE   # --replace respawn: spawned processes refill empty slots and the spares
    device: Device = Device.CPU

    # -- from and to the command line -----------------------------------------
    @classmethod
    def from_args(cls, ns: Any) -> TrainJob:
        """The job of a parsed `train` command line (cli.py's parser)."""
        def path(v: str | None) -> Path | None:
            return Path(v) if v else None

        config = TrainConfig(epochs=ns.epochs, batch=ns.batch, lr=ns.lr, momentum=ns.momentum,
                             weight_decay=ns.weight_decay, lr_scaling=LrScaling(ns.lr_scaling), seed=ns.seed,
                             lr_schedule=LrSchedule(ns.lr_schedule), dropout=ns.dropout, amp=ns.amp,
                             reload=Reload(ns.reload),
                             data_policy=DataPolicy(ns.data_policy), audit=ns.audit, bucket_bytes=ns.bucket_bytes,
                             overlap=ns.overlap, progress=not ns.no_progress, step_timeout=ns.step_timeout,
                             straggler=ns.straggler)
        ckpt = CheckpointOptions(path(ns.ckpt_dir), ns.ckpt_every, ns.ckpt_epoch, CheckpointStrategy(ns.ckpt_strategy),
                                 ns.ckpt_inflight, ns.ckpt_keep, ns.resume)
        return cls(path(ns.data), path(ns.train_file), path(ns.test_file), ns.model, config, list(ns.kill),
                   Recovery(ns.recovery), ckpt, Path(ns.out), ns.finalize_timeout, ns.spares, Replace(ns.replace),
                   Device(ns.device))

    def to_argv(self) -> list[str]:
        """The `train ...` command line that from_args turns back into this job."""
        c, k = self.config, self.checkpoint
        argv = ["train"]
        for flag, value in (("--data", self.data), ("--train", self.train_file), ("--test", self.test_file),
                            ("--ckpt-dir", k.directory)):
            if value is not None:
                argv += [flag, str(value)]
        argv += ["--model", self.model, "--epochs", str(c.epochs), "--batch", str(c.batch), "--lr", repr(c.lr),
                 "--momentum", repr(c.momentum), "--weight-decay", repr(c.weight_decay),
                 "--lr-scaling", c.lr_scaling.value, "--lr-schedule", c.lr_schedule.value,
                 "--dropout", repr(c.dropout), "--seed", str(c.seed),
                 "--reload", c.reload.value, "--data-policy", c.data_policy.value,
                 "--bucket-bytes", str(c.bucket_bytes),
                 "--out", str(self.out),
                 "--finalize-timeout", repr(self.finalize_timeout), "--recovery", self.recovery.value,
                 "--ckpt-every", str(k.every), "--ckpt-strategy", k.strategy.value,
                 "--ckpt-inflight", str(k.inflight), "--ckpt-keep", str(k.keep), "--spares", str(self.spares),
                 "--replace", self.replacement.value, "--device", self.device.value]
        for flag, on in (("--audit", c.audit), ("--amp", c.amp), ("--overlap", c.overlap),
                         ("--no-progress", not c.progress), ("--ckpt-epoch", k.epoch), ("--resume", k.resume)):
            if on:
                argv.append(flag)
        for flag, seconds in (("--step-timeout", c.step_timeout), ("--straggler", c.straggler)):
            if seconds is not None:
                argv += [flag, repr(seconds)]
        for spec in self.kill_specs:
            argv += ["--kill", spec]
        return argv

    def replace(self, **changes: Any) -> TrainJob:
        """A copy with some fields changed (config= and checkpoint= take dicts of their own fields)."""
        for name in ("config", "checkpoint"):
            if isinstance(changes.get(name), dict):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    # -- checks and what follows from the flags --------------------------------
    def validate(self) -> None:
        """Raise UsageError naming the problem and the fix for flags that do not go together."""
        c = self.config
        if c.step_timeout is not None and not (math.isfinite(c.step_timeout) and c.step_timeout > 0):
            raise UsageError(f"--step-timeout {c.step_timeout:g}: give a positive number of seconds (the least "
                             "time without progress after which a rank is hung; default 60, or "
                             "$ULFMTRAIN_STEP_TIMEOUT)")
        if c.straggler is not None and not (math.isfinite(c.straggler) and c.straggler > 1):
            raise UsageError(f"--straggler {c.straggler:g}: give a factor above 1 (a rank whose steps take that "
                             "many times its peers' is evicted)")
        if not 0.0 <= self.config.dropout < 1.0:
            raise UsageError(f"--dropout {self.config.dropout:g}: give the probability of zeroing an activation, "
                             "0 <= P < 1 (0: no dropout)")
        for spec in self.kill_specs:
            kill = parse_kill(spec)
            if kill.phase == Phase.CHECKPOINT and kill.rank != 0:
                raise UsageError(f"kill spec {spec!r} never fires: only rank 0 writes checkpoints "
                                 "(use 0@STEP:checkpoint)")
        if self.spares < 0 or (self.spares and self.recovery is not Recovery.SHRINK):
            raise UsageError(f"--spares {self.spares}: spares are a number >= 0 and work with --recovery shrink")
        if self.replacement is Replace.RESPAWN and self.recovery is not Recovery.SHRINK:
            raise UsageError(f"--replace respawn works with --recovery shrink, not {self.recovery}: "
                             "drop --replace or use --recovery shrink")
        k = self.checkpoint
        if k.directory is None:
            if self.recovery.needs_checkpoints:
                raise UsageError(f"--recovery {self.recovery} rolls back to a checkpoint: add --ckpt-dir DIR "
                                 "(and --ckpt-every K or --ckpt-epoch)")
            for flag, val in (("--ckpt-every", k.every), ("--ckpt-epoch", k.epoch), ("--resume", k.resume)):
                if val:
                    raise UsageError(f"{flag} needs a checkpoint directory: add --ckpt-dir DIR")

    def dataset_paths(self) -> tuple[Path, Path | None]:
        """The training file and the optional test file."""
        if self.train_file:
            return self.train_file, self.test_file
        if not self.data:
            raise UsageError("no dataset given: pass --data DIR "
                             "(create one with `python -m ulfmtrain data digits DIR`)")
        from ..data.format import dataset_paths

        return dataset_paths(self.data)

    def checkpointer(self, resume: bool = False) -> Checkpointer | None:
        """The job's Checkpointer (None without a checkpoint directory); resume=True forces a resume."""
        k = self.checkpoint
        if k.directory is None:
            return None
        from ..checkpoint.checkpointer import Checkpointer

        return Checkpointer(k.directory, every=k.every, epoch=k.epoch or not k.every, strategy=k.strategy,
                            max_inflight=k.inflight, keep=k.keep, resume=resume or k.resume)
