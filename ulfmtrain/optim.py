"""FT-SGD and the wrapper that makes any torch optimizer fault-tolerant.

As in the ULFM paper's MaTEx-Caffe (§6), gradients go through the
fault-tolerant allreduce in a gradients-ready callback and are averaged over
the *current* number of ranks before the update is applied; the local batch
per rank stays what it was, so the global batch shrinks with the world.
"""
from __future__ import annotations

import io
import zlib
from typing import Any, Callable, Iterable

import torch

from .comm import RolledForward

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    """Parameters whose gradients travel in one flat buffer.

    After the first step each gradient is a view into `send`, so backward
    accumulates straight into the buffer the allreduce sends: no copy in, and
    the reduced result is handed back as views too (as DDP's
    gradient_as_bucket_view).  Gradients that are not views (set to None, or
    replaced by the user) are copied in, as before.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        n, dtype = sum(self.sizes), params[0].dtype
        self._offsets = [0]
        for size in self.sizes[:-1]:
            self._offsets.append(self._offsets[-1] + size * params[0].element_size())
        # Out of place: a failed reduction leaves recv undefined, send intact.
        self.send = torch.zeros(n, dtype=dtype)
        self.recv = torch.zeros(n, dtype=dtype)

    def _grads_are_send_views(self) -> bool:
        base = self.send.data_ptr()
        return all(p.grad is not None and p.grad.data_ptr() == base + off
                   for p, off in zip(self.params, self._offsets))

    def flatten(self) -> None:
        if self._grads_are_send_views():
            return
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                 for p in self.params]
        torch.cat(grads, out=self.send)

    def unflatten(self, scale: float) -> None:
        self.recv.mul_(scale)
        for p, g in zip(self.params, self.recv.split(self.sizes)):
            p.grad = g.view_as(p)
        # The reduced gradients become next step's send buffer.
        self.send, self.recv = self.recv, self.send


def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes or p.dtype != out[-1][0].dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [_Bucket(b) for b in out]


class DistributedOptimizer:
    """Wrap a torch optimizer: average gradients over the survivors, then step.

    Args:
        optimizer: any torch.optim.Optimizer over the model's parameters.
        comm: a FaultTolerantComm (or PlainComm) shared by all ranks.
        model: the module, so that buffers (e.g. batch-norm statistics) are
            part of the replicated state; optional.
        bucket_bytes: gradients are flattened into buckets of about this size.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any, *,
                 model: torch.nn.Module | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.optimizer = optimizer
        self.comm = comm
        self.model = model
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.buckets = _buckets(self.params, bucket_bytes)
        self.step_count = 0
        self.fault_point: Callable[[int, str], None] | None = None
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        comm.replica = self

    # The torch.optim.Optimizer surface users reach for.
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place, so they stay views of the allreduce buckets."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def register_extra_state(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Make more state (e.g. the sampler position) part of what survivors keep identical."""
        self._extra[name] = (get, set)

    def on_gradients_ready(self) -> None:
        """Average the gradients over the current survivors (may raise RolledForward)."""
        for i, b in enumerate(self.buckets):
            b.flatten()
            if i == len(self.buckets) // 2:
                self._fault("allreduce")
            self.comm.allreduce(b.send.numpy(), b.recv.numpy())
        scale = 1.0 / self.comm.size
        for b in self.buckets:
            b.unflatten(scale)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Compute gradients (closure), average them over the survivors and apply the update.

        If this rank was behind the others after a failure, it takes their
        state and calls closure again to redo the step from its new position.
        """
        loss = closure() if closure is not None else None
        while True:
            try:
                self.on_gradients_ready()
                break
            except RolledForward:
                if closure is None:
                    raise
                loss = closure()
        self._fault("update")
        self.optimizer.step()
        self.step_count += 1
        return loss

    def _fault(self, phase: str) -> None:
        if self.fault_point is not None:
            self.fault_point(self.step_count, phase)

    # Replica: what survivors keep identical.
    def tag(self) -> int:
        return self.step_count

    def _tensors(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict() if self.model is not None else [p.detach() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }

    def get_state(self) -> bytes:
        state = self._tensors()
        state["step"] = self.step_count
        state["extra"] = {k: get() for k, (get, _) in self._extra.items()}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def set_state(self, blob: bytes) -> None:
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

    def checksum(self) -> int:
        """CRC32 of parameters, buffers, optimizer state and step: equal on consistent replicas."""
        crc = zlib.crc32(self.step_count.to_bytes(8, "little"))
        for t in _walk_tensors(self._tensors()):
            crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
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

    def __init__(self, params: Iterable[torch.Tensor], comm: Any, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 model: torch.nn.Module | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(sgd, comm, model=model, bucket_bytes=bucket_bytes)
