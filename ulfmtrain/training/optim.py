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
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from ..core.modes import Phase
from ..transport import faults, hangs
from ..transport.comm import AttemptFailed
from . import ddp, serialize
from .buckets import BufferBucket, make_buckets
from .config import DEFAULT_BUCKET_BYTES
from .extra_state import ExtraState
from .overlap import Overlap
from .replicated import ReplicatedState
from .rng import StepRng, on_forward
from .streams import Streams

if TYPE_CHECKING:
    from ..transport.comm import Comm

LR_WORLD = "lr_world"     # a param group's key under scale_lr: the world size its lr is set for


class DistributedOptimizer(ReplicatedState, torch.optim.Optimizer):
    """Wrap a torch optimizer: average gradients over the survivors as one transaction, then step.

    It is a torch.optim.Optimizer (torchft's OptimizerWrapper convention):
    param_groups and state are the wrapped optimizer's, so LR schedulers and
    torch.amp.GradScaler drive it.  With a GradScaler, reduce first so that
    every rank sees the same gradients (Horovod's convention)::

        scaler.scale(loss).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    Args:
        optimizer: any torch.optim.Optimizer over the model's parameters.
        comm: a FaultTolerantComm (or PlainComm) shared by all ranks.
        model: the module, so that its buffers (batch-norm statistics) are kept
            identical and are part of the replicated state; optional.
        bucket_bytes: gradients travel in buckets of about this size.
        broadcast: start every rank from the lowest rank's state (at construction).
        overlap: reduce each bucket as soon as backward has filled it, on a
            communication thread, and finish the step inside backward (DDP's
            semantics: when backward returns, the step is committed and p.grad
            is the global mean gradient, so clip_grad_norm_ goes right after
            backward).  Declare this rank's samples before backward with
            begin_step(samples); accumulate micro-batches inside no_sync().
            Bit-identical to overlap=False, where the reduction happens in
            synchronize() or step() (clip after opt.synchronize()).  Default: on
            for a DistributedDataParallel model (training/ddp.py), else off.
        staging: the stream objects of staged buckets (streams.py); None picks
            them by the parameters' device (CUDA's on a GPU).
        scale_lr: after a shrink or a join, scale each group's lr with the world size before the
            update (the linear scaling rule: an update averages size x batch samples).  The size the
            lr is set for travels in param_groups (LR_WORLD), so hand-overs and checkpoints carry it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Comm, *,
                 model: torch.nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 broadcast: bool = True, overlap: bool | None = None, scale_lr: bool = False,
                 staging: Streams | None = None) -> None:
        # Not Optimizer.__init__: param_groups and state stay the wrapped optimizer's own.
        if overlap is None:
            overlap = ddp.wraps_ddp(model)         # DDP's semantics for a DDP model: the mean after backward
        self.optimizer = optimizer
        self.comm = comm
        self.model = model
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.buckets = make_buckets(self.params, bucket_bytes, staging)
        bufs = [b for b in model.buffers()] if model is not None else []
        self._buffer_buckets = [BufferBucket(group, floating, staging) for floating in (True, False)
                                if (group := [b for b in bufs if b.is_floating_point() == floating])]
        self._count = (np.zeros(1), np.zeros(1))       # samples: this rank's, and the survivors' sum
        self.step_count = 0
        self.samples_total = 0.0
        self._synchronized = False
        self._samples: int | None = None          # declared by begin_step()
        self._overlapped = False                   # this step's first attempt ran during backward
        self._overlap_failure: AttemptFailed | None = None
        self._weight_sent = 1.0
        self._weight_synced = 1.0                  # the weight of the step reduced and not yet applied
        self.overlap = Overlap(self.buckets, self._begin_overlapped, self._reduce_bucket,
                               done=self.synchronize, committed=lambda: self._synchronized) if overlap else None
        # The hang watch measures each step: its time (the bound follows it) and this rank's own work in it.
        self._commit_hooks: list[Callable[[], None]] = [hangs.step_committed]
        self._attempt_hooks: list[Callable[[int, int], None]] = [hangs.step_attempted]
        self._extra = ExtraState(optimizer)
        if scale_lr:
            for g in optimizer.param_groups:
                g.setdefault(LR_WORLD, comm.size)
            self._commit_hooks.append(self._follow_world)
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        # A SpareComm: survivors hand the committed state (buffers as of the last update, not as this
        # step's forward left them) to the spares that join.
        self._committed_buffers: dict[str, torch.Tensor] | None = None
        if hasattr(comm, "handover"):
            setattr(comm, "handover", self)  # noqa: B010  # a SpareComm's: it calls handover_payload/take_handover
            self._keep_committed_buffers()
        self._received_at_init = False
        self._deferring = False
        self._rng = (StepRng(model, lambda: self.comm.world_rank, lambda: self.step_count, hasattr(comm, "handover"))
                     if model is not None else None)
        if model is not None and self._rng is not None:
            self._commit_hooks.append(self._rng.committed)
            # The forward kill phase, in a loop of your own (the trainer has its own point).
            on_forward(model, lambda m: faults.point(self.step_count, Phase.FORWARD) if m.training else None)
        self._commit_hooks.append(self._extra.forget_received)
        ddp.adopt(self)                            # a DistributedDataParallel model: its reducer off, no_sync ours
        if broadcast:
            takeover = getattr(comm, "takeover", None)
            if takeover is not None:      # a spare that took a slot, or a respawned process: the live state
                self.handover(takeover["root"], receive=True)
                self._received_at_init = True
            else:
                self.broadcast_state()

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
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # -- hooks ---------------------------------------------------------------
    def add_commit_hook(self, fn: Callable[[], None]) -> None:
        """Call fn() on every rank when a step commits (e.g. advance the sampler)."""
        self._commit_hooks.append(fn)

    def add_attempt_hook(self, fn: Callable[[int, int], None]) -> None:
        """Call fn(step, attempt) before this rank's first contribution to each attempt (e.g. the audit)."""
        self._attempt_hooks.append(fn)

    def register_extra_state(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Make more state (e.g. the sampler) part of what survivors keep identical and hand over."""
        self._extra.register(name, get, set)

    def register_state(self, name: str, obj: Any, *, pickle: bool = False) -> None:
        """Hand `obj` (anything with state_dict() and load_state_dict(): an LR scheduler, a GradScaler, your
        own object) to every replacement with the model and the optimizer, and keep it in checkpoints.

        A replacement that received the state before `obj` existed loads it here, when you register it.  Its
        state is loaded as data only (tensors, numbers, strings, lists, dicts, numpy arrays), checked here;
        pickle=True is the opt-in for a state that holds other objects: it travels pickled, and loading it runs
        whatever the bytes say, so only if you trust whoever can write your checkpoints (docs/security.md).
        """
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"register_state({name!r}, ...): a {type(obj).__name__} has no state_dict() and "
                            "load_state_dict()")
        if pickle:
            import pickle as pickle_module

            self.register_extra_state(name, lambda: pickle_module.dumps(obj.state_dict()),
                                      lambda blob: obj.load_state_dict(pickle_module.loads(blob)))
            return
        serialize.check_loadable(name, obj.state_dict())
        self.register_extra_state(name, obj.state_dict, obj.load_state_dict)

    def expect_samples(self, samples: int | None) -> None:
        """This rank's samples in the next step, unless begin_step() or step() says otherwise (what a batch
        sampler sets: ExactlyOnceSampler)."""
        self._samples = samples

    def seed_each_step(self, seed: int) -> None:
        """Seed torch, numpy and random at each step's first training forward from (seed, slot, step), so a
        replacement draws exactly the dropout masks the dead rank would have drawn (needs model=...)."""
        if self._rng is None:
            raise ValueError("seed_each_step needs the module: DistributedOptimizer(..., model=model)")
        self._rng.seed = seed

    # -- the step --------------------------------------------------------------
    def begin_step(self, samples: int | None = None) -> None:
        """Start a step, before backward: this rank's samples in it (its gradient's weight).

        Needed with overlap=True, where buckets are weighted as backward fills
        them; without overlap, samples may be given to step() instead.
        """
        self.hand_over_pending()
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
        return 1.0 if samples is None else float(samples)

    def _begin_overlapped(self) -> float:
        """The first bucket of this step is ready (on the thread running backward): audit, then weigh."""
        self.hand_over_pending()
        attempt = self.comm.next_attempt
        for fn in self._attempt_hooks:
            fn(self.step_count, attempt)
        self._weight_sent = self._weight(self._samples)
        return self._weight_sent

    def _reduce_bucket(self, i: int) -> int:
        """One bucket of the overlapped first attempt, on the communication thread."""
        if i == self._kill_index():
            faults.point(self.step_count, Phase.ALLREDUCE)
        try:
            self.comm.reduce_try(*self.buckets[i].arrays(), MPI.SUM)
        except AttemptFailed as exc:
            return exc.status
        return 0

    def _kill_index(self) -> int:
        # The ALLREDUCE kill point: inside the reduction, even with one gradient bucket.
        return max(1, (len(self.buckets) + 1 + len(self._buffer_buckets)) // 2)

    def synchronize(self, samples: int | None = None) -> None:
        """Average the gradients over the survivors: one transaction, committed on every rank.

        Then p.grad is the mean gradient until step(); a second call before step() does nothing
        (with overlap=True, backward already called it).

        Args:
            samples: this rank's samples in the batch (the weight of its
                gradient); None counts every rank alike.
        """
        if self._synchronized:
            self._check_weight(samples)
            return
        if samples is None:
            samples = self._samples
        if self.overlap is not None:
            self._overlap_failure, self._overlapped = self.overlap.wait(), True
            if self._weight(samples) != self._weight_sent:
                raise ValueError(f"step(samples={samples}) after backward was weighted with {self._weight_sent}: "
                                 "with overlap, call begin_step(samples) before backward")
        else:
            self.hand_over_pending()
            for b in self.buckets:
                b.prepare(self._weight(samples))
            for b in self.buckets:          # on a GPU: the copies to pinned memory, queued above, are done
                b.wait_staged()
        self._samples = None
        self._count[0][0] = self._weight(samples)
        self.comm.step = self.step_count
        self.comm.transaction(self._reduce, self._commit, what="step",
                              before_agree=lambda: faults.point(self.step_count, Phase.COMMIT))
        self._synchronized, self._weight_synced = True, self._weight(samples)

    def _check_weight(self, samples: int | None) -> None:
        if samples is not None and self._weight(samples) != self._weight_synced:
            raise ValueError(f"step(samples={samples}) after a step reduced with weight {self._weight_synced}: "
                             "with overlap, call begin_step(samples) before backward")

    def _reduce(self, attempt: int) -> None:
        # Buckets in order, then the sample count and the module buffers: the overlapped first
        # attempt and a synchronous redo issue the same reductions in the same order (a spare
        # that joins a redo may be overlapping while the survivors are not).
        overlapped, self._overlapped = self._overlapped, False
        if overlapped and self._overlap_failure is not None:
            raise self._overlap_failure         # the communicator is already revoked
        if not overlapped:
            for fn in self._attempt_hooks:
                fn(self.step_count, attempt)
        lowest = self.comm.rank == 0
        for bb in self._buffer_buckets:       # the world may have shrunk since the last attempt
            bb.prepare(self._count[0][0], lowest)
        for b in self.buckets:                # a redo after an overlapped failure: copies still in flight
            b.wait_staged()
        pairs = [*(b.arrays() for b in self.buckets), self._count,
                 *((bb.send.numpy(), bb.recv.numpy()) for bb in self._buffer_buckets)]
        kill_at = self._kill_index()
        # The overlapped attempt reduced the gradient buckets during backward.
        for i in range(len(self.buckets) if overlapped else 0, len(pairs)):
            if i == kill_at:
                faults.point(self.step_count, Phase.ALLREDUCE)
                faults.point(self.step_count, Phase.ERROR)     # raises faults.InjectedError, if scheduled
            self.comm.reduce_try(*pairs[i], MPI.SUM)

    def _commit(self, _: None) -> None:
        total = float(self._count[1][0])
        scale = 1.0 / total if total > 0 else 0.0
        for b in self.buckets:
            b.finish(scale)
        for bb in self._buffer_buckets:
            bb.finish(scale)
        self.samples_total += total
        self.step_count += 1
        if self._committed_buffers is not None:    # a SpareComm: what a newcomer gets
            self._keep_committed_buffers()
        for fn in self._commit_hooks:
            fn()

    def _follow_world(self) -> None:
        # At the commit, so the redo of a step aborted by a failure already updates at the new size; every
        # rank holds the same groups and size, so the lr stays uniform.
        size = self.comm.size
        for g in self.param_groups:
            world = g.setdefault(LR_WORLD, size)
            if world != size:
                g["lr"], g[LR_WORLD] = g["lr"] * size / world, size

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block, step() applies the update without reducing again (after synchronize()).

        Kept for Horovod-style code: step() after synchronize() never reduces again anyway, so it only yields.
        """
        yield

    def step(self, closure: Callable[[], Any] | None = None, *, samples: int | None = None) -> Any:
        """Compute gradients (closure), average them over the survivors as one transaction, and update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize(samples)         # nothing if backward (overlap) or the user already reduced
        self._synchronized = False
        faults.point(self.step_count - 1, Phase.UPDATE)
        self.optimizer.step()
        self.hand_over_pending()
        return loss

    def close(self) -> None:
        """End the communication thread of overlap=True (also at interpreter exit: it is a daemon)."""
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None


class FTSGD(DistributedOptimizer):
    """SGD with momentum and weight decay whose gradients survive rank failures."""

    def __init__(self, params: Iterable[torch.Tensor], comm: Comm, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 model: torch.nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 broadcast: bool = True, overlap: bool = False, scale_lr: bool = False,
                 staging: Streams | None = None) -> None:
        sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(sgd, comm, model=model, bucket_bytes=bucket_bytes, broadcast=broadcast, overlap=overlap,
                         scale_lr=scale_lr, staging=staging)
