"""FT-SGD and the wrapper that makes any torch optimizer fault-tolerant.

A step is one transaction (see comm.py): every gradient bucket is reduced
with errors returned, then one uniform agree decides commit or redo.  An
aborted step is redone as a whole on the repaired communicator, from the send
buffers that still hold this rank's contribution.  Each rank weights its
gradient by the samples it used, so the update is the mean over the samples
that actually contributed, whatever the world size and the batch sizes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from .. import _ftcoll
from ..core.modes import Phase
from ..core.refusal import refuse
from ..transport import faults, hangs, phase
from ..transport.comm import AttemptFailed
from . import ddp, rng, serialize
from .buckets import BufferBucket, make_buckets
from .closure import ClosureStep
from .config import DEFAULT_BUCKET_BYTES
from .job_state import BCAST, JobState
from .overlap import Overlap
from .replicated import ReplicatedState
from .streams import Streams

if TYPE_CHECKING:
    from ..transport.comm import Comm

LR_WORLD = "lr_world"     # a param group's key under scale_lr: the world size its lr is set for


class DistributedOptimizer(ClosureStep, ReplicatedState, torch.optim.Optimizer):
    """Wrap a torch optimizer: average gradients over the survivors as one transaction, then step.

    It is a torch.optim.Optimizer (torchft's OptimizerWrapper convention):
    param_groups and state are the wrapped optimizer's, so LR schedulers and
    torch.amp.GradScaler drive it.  With a GradScaler, reduce first so that
    every rank sees the same gradients (Horovod's convention)::

        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.step(opt)
        scaler.update()

    `step(closure)` works with any optimizer, LBFGS included: each call of the closure returns the global mean
    loss and leaves the global mean gradient, and the whole step is one transaction (a failure rolls it back to
    its start and redoes it).  Each DistributedOptimizer is part of the job's named state (`comm.track`).

    Args:
        optimizer: any torch.optim.Optimizer over the model's parameters.
        comm: the communicator (ulfmtrain.connect()).
        model: the module the parameters belong to (required for nn.Parameters): its buffers are kept identical
            and replicated, its training forwards begin each step (the random state a replacement receives).
        name: its name in the job's state (default: "opt", "opt1", ... in construction order, which every rank
            and every replacement shares because they run the same script).
        seed: at each step's first training forward, seed torch, numpy and random from (seed, this rank's slot,
            the step), so a replacement draws exactly the dropout masks the dead rank would have (needs model).
        bucket_bytes: gradients travel in buckets of about this size.
        broadcast: start every rank from the lowest rank's state (at construction).
        overlap: reduce each bucket as soon as backward has filled it, on a
            communication thread, and finish the step inside backward (DDP's
            semantics: when backward returns, the step is committed and p.grad
            is the global mean gradient, so clip_grad_norm_ goes right after
            backward); accumulate micro-batches inside no_sync().  Bit-identical
            to overlap=False, where the reduction happens in synchronize() or
            step() (clip after opt.synchronize()).  Default: on for a
            DistributedDataParallel model (training/ddp.py), else off.
        staging: the stream objects of staged buckets (streams.py); None picks
            them by the parameters' device (CUDA's on a GPU).
        scale_lr: after a shrink or a join, scale each group's lr with the world size before the
            update (the linear scaling rule: an update averages size x batch samples).  The size the
            lr is set for travels in param_groups (LR_WORLD), so hand-overs and checkpoints carry it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Comm, *,
                 model: torch.nn.Module | None = None, name: str | None = None, seed: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, broadcast: bool = True, overlap: bool | None = None,
                 scale_lr: bool = False, staging: Streams | None = None) -> None:
        # Not Optimizer.__init__: param_groups and state stay the wrapped optimizer's own.
        if overlap is None:
            overlap = ddp.wraps_ddp(model)         # DDP's semantics for a DDP model: the mean after backward
        self.optimizer = optimizer
        self.comm = comm
        self.model = model
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if seed is not None and model is None:
            raise ValueError("DistributedOptimizer(seed=...) seeds each step at the model's forward: pass model=")
        if model is None and any(isinstance(p, torch.nn.Parameter) for p in self.params):   # Horovod's convention
            refuse("DistributedOptimizer(optimizer, comm) needs the module its parameters belong to: pass model=model "
                   "(its buffers and each step's random state are part of the job's state, which a replacement "
                   "receives and the end check compares)")
        self.buckets = make_buckets(self.params, bucket_bytes, staging)
        bufs = [b for b in model.buffers()] if model is not None else []
        self._buffer_buckets = [BufferBucket(group, floating, staging) for floating in (True, False)
                                if (group := [b for b in bufs if b.is_floating_point() == floating])]
        # The phase check's tag, which carries this rank's samples: sent first in every attempt (phase.py).
        self._tag = (np.zeros(phase.SIZE), np.zeros(phase.SIZE))
        self.step_count = 0
        self.samples_total = 0.0
        self._synchronized = False
        self._skipping = False                     # a replacement's step that its peers committed already
        self._samples: int | None = None           # declared by _begin_step()
        self._overlapped = False                   # this step's first attempt ran during backward
        self._overlap_failure: AttemptFailed | None = None
        self._weight_sent = 1.0
        self._weight_synced = 1.0                  # the weight of the step reduced and not yet applied
        self._snapshot: dict[str, Any] | None = None   # a closure step in flight: the state at its start
        self.overlap = Overlap(self.buckets, self._begin_overlapped, self._reduce_bucket,
                               done=self.synchronize, committed=lambda: self._synchronized) if overlap else None
        # The hang watch measures each step: its time (the bound follows it) and this rank's own work in it.
        self._commit_hooks: list[Callable[[], None]] = [hangs.step_committed]
        self._attempt_hooks: list[Callable[[int, int], None]] = [hangs.step_attempted]
        if scale_lr:
            for g in optimizer.param_groups:
                g.setdefault(LR_WORLD, comm.size)
            self._commit_hooks.append(self._follow_world)
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        self.job = JobState.of(comm)
        # A SpareComm: survivors hand over the buffers as of the last update, not as this step's forward left them.
        self._committed_buffers: dict[str, torch.Tensor] | None = None
        if hasattr(comm, "handover"):
            self._keep_committed_buffers()
        # The step a forward belongs to: on a replacement that replays a step its peers committed (a GAN's D step),
        # that step, not the count it received.
        self._seed = rng.StepSeed(seed, lambda: self.comm.world_rank,
                                  lambda: self.step_count - self.job.skips(self.name)) if seed is not None else None
        if model is not None:
            # The RNG and the forward kill phase, in a loop of your own (the trainer has its own point).
            rng.on_forward(model, self._forward)
        ddp.adopt(self)                         # a DistributedDataParallel model: its reducer off, no_sync ours
        self.index = len(self.job.optimizers)
        self.name = name or ("opt" if not self.index else f"opt{self.index}")
        self.job.add_optimizer(self)            # a replacement receives the job's state here
        if broadcast and self.job.joins(BCAST, self.name):
            self._broadcast_state()

    # -- the torch.optim.Optimizer surface ---------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups to the wrapped optimizer before wrapping it")

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place, so they stay views of the buckets."""
        self._synchronized = False        # a reduced step whose update was skipped (a GradScaler's inf step)
        self._skipping = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # -- hooks (the sampler, the trainer) --------------------------------------
    def _add_commit_hook(self, fn: Callable[[], None]) -> None:
        """Call fn() on every rank when a step of this optimizer commits."""
        self._commit_hooks.append(fn)

    def _add_attempt_hook(self, fn: Callable[[int, int], None]) -> None:
        """Call fn(step, attempt) before this rank's first contribution to each attempt (e.g. the audit)."""
        self._attempt_hooks.append(fn)

    def _register_extra_state(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Make more state (the trainer's sampler) part of the job's state, under `name`."""
        self.job.register(name, get, set)

    def register_state(self, name: str, obj: Any, *, pickle: bool = False) -> None:
        """comm.track(name=obj), with an opt-in for a state that holds other objects than data: pickle=True makes
        it travel pickled, and loading it runs whatever the bytes say, so only if you trust whoever can write
        your checkpoints (docs/security.md)."""
        self.job.track(**{name: serialize.Pickled(obj) if pickle else obj})

    def _expect_samples(self, samples: int | None) -> None:
        self.job.samples = samples

    def _seed_each_step(self, seed: int) -> None:
        """seed= after construction (the trainer's --dropout, on an optimizer it was given)."""
        if self.model is None:
            raise ValueError("seeding each step needs the module: DistributedOptimizer(..., model=model)")
        self._seed = rng.StepSeed(seed, lambda: self.comm.world_rank, lambda: self.step_count)

    # -- the step --------------------------------------------------------------
    def _forward(self, module: torch.nn.Module) -> None:
        if module.training:
            faults.point(self.step_count, Phase.FORWARD)
            self.job.forward()
            if self._seed is not None:
                self._seed.forward()

    def _step_start(self) -> None:
        """This rank enters this optimizer's step: a slot a repair left vacant is refilled, a ready respawned
        process joins, a replacement waiting for the state gets it (the communicator's); a replacement that
        caught up takes part from here."""
        self.job.in_flight = (phase.STEP, self.name)
        at_step_start = getattr(self.comm, "at_step_start", None)
        if at_step_start is not None:
            at_step_start()
        self.job.joined()

    def _skip(self) -> bool:
        """A replacement's step that its peers committed already in this iteration: no reduction, no update."""
        if self._skipping:
            return True
        if self.job.skip(self):
            self._skipping = True
            if self._seed is not None:
                self._seed.committed()
            return True
        return False

    def _begin_step(self, samples: int | None = None) -> None:
        """Start a step, before backward: this rank's samples in it (its gradient's weight; the trainer's, where
        overlap=True weights buckets as backward fills them)."""
        if self._skip():
            return
        self._step_start()
        self._samples = samples
        self._synchronized = False
        if self.overlap is not None and self.overlap.dirty:
            self.overlap.abandon()        # the last backward raised before it finished the step

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reducing (DDP's convention): every micro-batch but the last.

        With overlap=True, the backward outside no_sync() reduces the accumulated gradients and finishes
        the step; without overlap, synchronize() or step() does (no_sync() then changes nothing).
        """
        return self.overlap.no_sync() if self.overlap is not None else contextlib.nullcontext()

    def _weight(self, samples: int | None) -> float:
        if samples is None:
            samples = self._samples if self._samples is not None else self.job.samples
        return 1.0 if samples is None else float(samples)

    def _begin_overlapped(self) -> float:
        """The first bucket of this step is ready (on the thread running backward): audit, then weigh."""
        if self._skip():
            return 1.0
        self._step_start()
        attempt = self.comm.next_attempt
        self._attempt(attempt)
        self._weight_sent = self._weight(None)
        return self._weight_sent

    def _attempt(self, attempt: int) -> None:
        self.job.attempt(self, attempt)
        for fn in self._attempt_hooks:
            fn(self.step_count, attempt)

    def _check_phase(self) -> None:
        """The attempt's first reduction: the tag (kind, this optimizer, its step) and this rank's samples."""
        send, recv = self._tag
        phase.tag(phase.STEP, self.index, self.step_count, weight=self._weight_sent,
                  problem=self.job.problem is not None, lead=self.job.lead, out=send)
        check = getattr(self.comm, "check_phase", None)
        if check is not None:
            check(send, recv)
        else:               # a stand-in communicator of the unit tests
            self.comm.reduce_try(send, recv)

    def _reduce_bucket(self, i: int) -> int:
        """One bucket of the overlapped first attempt, on the communication thread (the tag before the first)."""
        if self._skipping:
            return 0
        if i + 1 == self._kill_index():
            faults.point(self.step_count, Phase.ALLREDUCE)
        try:
            if i == 0:
                self._check_phase()
            self.comm.reduce_try(*self.buckets[i].arrays(), MPI.SUM)
        except AttemptFailed as exc:
            return exc.status
        except phase.PeerLeft:      # every rank of this step sees it: the commit agree, then the repair
            return _ftcoll.FAILED
        return 0

    def _kill_index(self) -> int:
        # The ALLREDUCE kill point, an index into [tag, buckets..., buffers...]: inside the reduction.
        return max(1, (len(self.buckets) + 1 + len(self._step_buffers())) // 2)

    def synchronize(self, samples: int | None = None) -> None:
        """Average the gradients over the survivors: one transaction, committed on every rank.

        Then p.grad is the mean gradient until step(); a second call before step() does nothing
        (with overlap=True, backward already called it).

        Args:
            samples: this rank's samples in the batch (the weight of its
                gradient); None: ExactlyOnceSampler's, else every rank counts alike.
        """
        if self._synchronized:
            self._check_weight(samples)
            return
        if self._skip():
            if self.overlap is not None and self.overlap.dirty:
                self.overlap.wait()
            self._synchronized = True
            return
        if self.overlap is not None:
            self._overlap_failure, self._overlapped = self.overlap.wait(), True
            if self._skipping:        # (the hooks found this step skipped)
                self._synchronized = True
                return
            if samples is not None and self._weight(samples) != self._weight_sent:
                raise ValueError(f"step(samples={samples}) after backward was weighted with {self._weight_sent}: "
                                 "with overlap=True a step's weight must be known before backward (the "
                                 "ExactlyOnceSampler sets it; without it every rank counts alike)")
        else:
            self._step_start()
            self._weight_sent = self._weight(samples)
            for b in self.buckets:
                b.prepare(self._weight_sent)
            for b in self.buckets:          # on a GPU: the copies to pinned memory, queued above, are done
                b.wait_staged()
        self._samples = None
        self.comm.transaction(self._reduce, self._commit, what="step",
                              before_agree=lambda: faults.point(self.step_count, Phase.COMMIT))
        self._synchronized, self._weight_synced = True, self._weight_sent

    def _check_weight(self, samples: int | None) -> None:
        if samples is not None and not self._skipping and float(samples) != self._weight_synced:
            raise ValueError(f"step(samples={samples}) after a step reduced with weight {self._weight_synced}: "
                             "with overlap=True a step's weight must be known before backward (the "
                             "ExactlyOnceSampler sets it; without it every rank counts alike)")

    def _reduce(self, attempt: int) -> None:
        # The tag, buckets in order, then the module buffers: the overlapped first attempt and a synchronous
        # redo issue the same reductions in the same order (a spare that joins a redo may be overlapping while
        # the survivors are not).
        overlapped, self._overlapped = self._overlapped, False
        if overlapped and self._overlap_failure is not None:
            raise self._overlap_failure         # the communicator is already revoked
        kill_at = self._kill_index()
        if not overlapped:
            self._attempt(attempt)
            self._check_phase()
        lowest = self.comm.rank == 0
        buffers = self._step_buffers()
        for bb in buffers:                    # the world may have shrunk since the last attempt
            bb.prepare(self._weight_sent, lowest)
        for b in self.buckets:                # a redo after an overlapped failure: copies still in flight
            b.wait_staged()
        pairs = [*(b.arrays() for b in self.buckets), *((bb.send.numpy(), bb.recv.numpy()) for bb in buffers)]
        # The overlapped attempt reduced the tag and the gradient buckets during backward.
        for i in range(len(self.buckets) if overlapped else 0, len(pairs)):
            if i + 1 == kill_at:
                faults.point(self.step_count, Phase.ALLREDUCE)
                faults.point(self.step_count, Phase.ERROR)     # raises faults.InjectedError, if scheduled
            self.comm.reduce_try(*pairs[i], MPI.SUM)

    def _commit(self, _: Any) -> None:
        scale = self._finish_scale()
        for b in self.buckets:
            b.finish(scale)
        self._committed(scale)

    def _finish_scale(self) -> float:
        total = float(self._tag[1][phase.WEIGHT])
        self.samples_total += total
        return 1.0 / total if total > 0 else 0.0

    def _committed(self, scale: float) -> None:
        """Every rank, once a step of this optimizer commits: the buffers, the counts, the hooks, the job."""
        self._finish_buffers(scale)
        self.step_count += 1
        self._snapshot = None
        if self._seed is not None:
            self._seed.committed()
        for fn in self._commit_hooks:
            fn()
        self.job.committed(self)

    def _follow_world(self) -> None:
        # At the commit, so the redo of a step aborted by a failure already updates at the new size; every
        # rank holds the same groups and size, so the lr stays uniform.
        size = self.comm.size
        for g in self.param_groups:
            world = g.setdefault(LR_WORLD, size)
            if world != size:
                g["lr"], g[LR_WORLD] = g["lr"] * size / world, size

    def step(self, closure: Callable[[], Any] | None = None, *, samples: int | None = None) -> Any:
        """Average the gradients over the survivors as one transaction, and update; with a closure (LBFGS, or
        any optimizer that takes one), run the wrapped optimizer's step on the global mean of every call."""
        if closure is not None:
            return self._closure_step(closure, samples)
        self.synchronize(samples)         # nothing if backward (overlap) or the user already reduced
        self._synchronized = False
        if self._skipping:
            self._skipping = False
            return None
        faults.point(self.step_count - 1, Phase.UPDATE)
        self.optimizer.step()
        return None

    def close(self) -> None:
        """End the communication thread of overlap=True (also at interpreter exit: it is a daemon)."""
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None


class FTSGD(DistributedOptimizer):
    """SGD with momentum and weight decay whose gradients survive rank failures."""

    def __init__(self, params: Iterable[torch.Tensor], comm: Comm, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 model: torch.nn.Module | None = None, name: str | None = None, seed: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, broadcast: bool = True, overlap: bool = False,
                 scale_lr: bool = False, staging: Streams | None = None) -> None:
        sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(sgd, comm, model=model, name=name, seed=seed, bucket_bytes=bucket_bytes,
                         broadcast=broadcast, overlap=overlap, scale_lr=scale_lr, staging=staging)
