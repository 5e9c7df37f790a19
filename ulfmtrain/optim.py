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
import io
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from . import faults
from .job import DEFAULT_BUCKET_BYTES
from .modes import Phase

if TYPE_CHECKING:
    from .comm import Comm

# MPI has no bfloat16 and Open MPI's float16 reduction is not portable: half
# precision travels as float32 (exact for the values, and a sum of N halves is
# better in float32 anyway).
_STAGED = (torch.float16, torch.bfloat16)


class _Bucket:
    """Tensors that travel in one flat buffer.

    Gradients are views of `grad`, so backward accumulates straight into the
    buffer (DDP's gradient_as_bucket_view).  For float32/float64, `grad` is
    the send buffer itself; half precision is staged through float32.  After a
    failed reduction `send` still holds this rank's weighted contribution.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        n, dtype = sum(self.sizes), params[0].dtype
        self.grad = torch.zeros(n, dtype=dtype)
        wire = torch.float32 if dtype in _STAGED else dtype
        self.send = self.grad if wire == dtype else torch.zeros(n, dtype=wire)
        self.recv = torch.zeros(n, dtype=wire)
        self._views_set = False

    def _grads_are_views(self) -> bool:
        base, off = self.grad.data_ptr(), 0
        for p, size in zip(self.params, self.sizes):
            if p.grad is None or p.grad.data_ptr() != base + off * self.grad.element_size():
                return False
            off += size
        return True

    def prepare(self, weight: float) -> None:
        """Gather the gradients into the send buffer, weighted by this rank's samples."""
        if not self._grads_are_views():
            grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                     for p in self.params]
            torch.cat(grads, out=self.grad)
            for p, g in zip(self.params, self.grad.split(self.sizes)):
                p.grad = g.view_as(p)
        if self.send is not self.grad:
            self.send.copy_(self.grad)
        if weight != 1.0:
            self.send.mul_(weight)

    def finish(self, scale: float) -> None:
        """Hand the reduced mean back as the gradients."""
        self.recv.mul_(scale)
        if self.send is self.grad:
            # The reduced buffer becomes the gradients, and next step's send buffer.
            self.grad, self.send, self.recv = self.recv, self.recv, self.grad
            for p, g in zip(self.params, self.grad.split(self.sizes)):
                p.grad = g.view_as(p)
        else:
            self.grad.copy_(self.recv)


class _BufferBucket:
    """Module buffers kept identical: floating ones averaged with the gradients, integer ones from rank 0."""

    def __init__(self, buffers: list[torch.Tensor], floating: bool) -> None:
        self.buffers, self.floating = buffers, floating
        self.sizes = [b.numel() for b in buffers]
        dtype = torch.float64 if floating else torch.int64
        self.send = torch.zeros(sum(self.sizes), dtype=dtype)
        self.recv = torch.zeros_like(self.send)

    def prepare(self, weight: float, lowest: bool) -> None:
        torch.cat([b.detach().reshape(-1).to(self.send.dtype) for b in self.buffers], out=self.send)
        if self.floating:
            self.send.mul_(weight)
        elif not lowest:
            self.send.zero_()          # a sum in which only rank 0 speaks is rank 0's value

    def finish(self, scale: float) -> None:
        if self.floating:
            self.recv.mul_(scale)
        with torch.no_grad():
            for b, v in zip(self.buffers, self.recv.split(self.sizes)):
                b.copy_(v.view_as(b))


def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
    # Reverse registration order: about the order backward makes gradients
    # ready, the same on every rank (DDP's convention).
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes or p.dtype != out[-1][0].dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [_Bucket(b) for b in out]


class DistributedOptimizer(torch.optim.Optimizer):
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
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Comm, *,
                 model: torch.nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 broadcast: bool = True) -> None:
        # Not Optimizer.__init__: param_groups and state stay the wrapped optimizer's own.
        self.optimizer = optimizer
        self.comm = comm
        self.model = model
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.buckets = _buckets(self.params, bucket_bytes)
        bufs = [b for b in model.buffers()] if model is not None else []
        self._buffer_buckets = [_BufferBucket(group, floating) for floating in (True, False)
                                if (group := [b for b in bufs if b.is_floating_point() == floating])]
        self._count = (np.zeros(1), np.zeros(1))       # samples: this rank's, and the survivors' sum
        self.step_count = 0
        self.samples_total = 0.0
        self._synchronized = False
        self._skip_sync = False
        self._commit_hooks: list[Callable[[], None]] = []
        self._attempt_hooks: list[Callable[[int, int], None]] = []
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        # A SpareComm: survivors hand the committed state (buffers as of the last update, not as this
        # step's forward left them) to the spares that join.
        self._committed_buffers: dict[str, torch.Tensor] | None = None
        if hasattr(comm, "handover"):
            setattr(comm, "handover", self.handover)  # noqa: B010  # a SpareComm's
            self._keep_committed_buffers()
        if broadcast:
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
        """Make more state (e.g. the sampler) part of what survivors keep identical."""
        self._extra[name] = (get, set)

    # -- the step --------------------------------------------------------------
    def synchronize(self, samples: int | None = None) -> None:
        """Average the gradients over the survivors: one transaction, committed on every rank.

        Args:
            samples: this rank's samples in the batch (the weight of its
                gradient); None counts every rank alike.
        """
        self._pending_handover()
        weight = 1.0 if samples is None else float(samples)
        self._count[0][0] = weight
        for b in self.buckets:
            b.prepare(weight)
        self.comm.step = self.step_count
        self.comm.transaction(self._reduce, self._commit, what="step",
                              before_agree=lambda: faults.point(self.step_count, Phase.COMMIT))
        self._synchronized = True

    def _reduce(self, attempt: int) -> None:
        for fn in self._attempt_hooks:
            fn(self.step_count, attempt)
        lowest = self.comm.rank == 0
        for bb in self._buffer_buckets:       # the world may have shrunk since the last attempt
            bb.prepare(self._count[0][0], lowest)
        pairs = [self._count, *((b.send.numpy(), b.recv.numpy()) for b in self.buckets),
                 *((bb.send.numpy(), bb.recv.numpy()) for bb in self._buffer_buckets)]
        kill_at = max(1, len(pairs) // 2)     # inside the reduction, even with one gradient bucket
        for i, (send, recv) in enumerate(pairs):
            if i == kill_at:
                faults.point(self.step_count, Phase.ALLREDUCE)
            self.comm.reduce_try(send, recv, MPI.SUM)

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

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block, step() applies the update without reducing again (after synchronize())."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Callable[[], Any] | None = None, *, samples: int | None = None) -> Any:
        """Compute gradients (closure), average them over the survivors as one transaction, and update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not (self._skip_sync and self._synchronized):
            self.synchronize(samples)
        self._synchronized = False
        faults.point(self.step_count - 1, Phase.UPDATE)
        self.optimizer.step()
        self._pending_handover()
        return loss

    def _pending_handover(self) -> None:
        """After a failure after the last bucket (the step committed): hand over once the update is applied,
        or at the next synchronize if the update was skipped (a GradScaler's inf step)."""
        pending = getattr(self.comm, "pending_handover", None)
        if pending is not None:
            setattr(self.comm, "pending_handover", None)  # noqa: B010  # a SpareComm's
            self.handover(*pending)

    # -- the replicated state ----------------------------------------------------
    def _tensors(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict() if self.model is not None else [p.detach() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }

    def get_state(self, extra: bool = True, buffers: dict[str, torch.Tensor] | None = None) -> bytes:
        """Model, optimizer, step and (unless extra=False) the registered extra state, serialized.

        buffers: the model's buffers to send instead of their current values.
        """
        state = self._tensors()
        if buffers:
            state["model"].update(buffers)
        state["step"] = self.step_count
        state["extra"] = {k: get() for k, (get, _) in self._extra.items()} if extra else {}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def set_state(self, blob: bytes) -> None:
        """Take a state made by get_state()."""
        state = torch.load(io.BytesIO(blob), weights_only=False)
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        else:
            with torch.no_grad():
                for p, v in zip(self.params, state["model"]):
                    p.copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = state["step"]
        for k, v in state["extra"].items():
            self._extra[k][1](v)
        if self._committed_buffers is not None:
            self._keep_committed_buffers()

    def handover(self, root: int, attempt: int = 0, *, receive: bool = False) -> None:
        """Hand the committed state to ranks that take dead ranks' places (spares), from comm rank `root`.

        Survivors send (attempt: the number of the attempt that comes next, so a
        newcomer's audit lines line up); a newcomer calls it with receive=True.
        """
        blob = self.comm.bcast_bytes(
            lambda: self.get_state(buffers=self._committed_buffers) + attempt.to_bytes(8, "little"), root=root)
        if receive:
            self.set_state(blob[:-8])
            self.comm.start_attempts_at(int.from_bytes(blob[-8:], "little"))

    def _keep_committed_buffers(self) -> None:
        named = self.model.named_buffers() if self.model is not None else ()
        self._committed_buffers = {k: b.detach().clone() for k, b in named}

    def broadcast_state(self) -> None:
        """Start every rank from the lowest survivor's state (Horovod's broadcast_parameters, fault-tolerant)."""
        faults.point(self.step_count, "init")
        # Without the extra state: every rank builds it (the sampler) alike, and it may already have been re-planned.
        self.set_state(self.comm.bcast_bytes(lambda: self.get_state(extra=False)))

    def checksum(self) -> int:
        """CRC32 of parameters, buffers, optimizer state and step: equal on consistent replicas."""
        crc = zlib.crc32(self.step_count.to_bytes(8, "little", signed=True))
        for t in _walk_tensors(self._tensors()):
            # Bytes of any dtype (bfloat16 has no numpy type).
            crc = zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        return crc


def _walk_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _walk_tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v)


class FTSGD(DistributedOptimizer):
    """SGD with momentum and weight decay whose gradients survive rank failures."""

    def __init__(self, params: Iterable[torch.Tensor], comm: Comm, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 model: torch.nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 broadcast: bool = True) -> None:
        sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(sgd, comm, model=model, bucket_bytes=bucket_bytes, broadcast=broadcast)
