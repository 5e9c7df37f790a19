"""Gradient and buffer buckets: the flat buffers a step reduces, on CPU or staged from a GPU through pinned memory.

MPI here has no CUDA support (the PyPI Open MPI is built without it, and
ULFM excludes UCX), so a device bucket is copied device -> pinned host on a
side CUDA stream, reduced on the host, and copied back.  The pinned send
buffer keeps this rank's weighted contribution: a redone step reduces it
again without recomputing anything.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np
import torch

from .streams import Streams, streams_for

# MPI has no bfloat16 and Open MPI's float16 reduction is not portable: half
# precision travels as float32 (exact for the values, and a sum of N halves is
# better in float32 anyway).
STAGED = (torch.float16, torch.bfloat16)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of `dtype` travels as."""
    return torch.float32 if dtype in STAGED else dtype


class GradBucket:
    """Parameters whose gradients travel in one flat buffer.

    Gradients are views of `grad` (on the parameters' device), so backward
    accumulates straight into the buffer (DDP's gradient_as_bucket_view).  On
    CPU, a float32/float64 `grad` is the send buffer itself; half precision is
    staged through float32.  A staged bucket (a GPU's, or the CPU stand-in's,
    see streams.py) keeps `send` and `recv` in (pinned) host memory: prepare()
    enqueues the weighting and the copy on a side stream, wait_staged() waits
    for it, and nothing reads `send` before that wait.
    """

    def __init__(self, params: list[torch.Tensor], index: int = 0, streams: Streams | None = None) -> None:
        self.params, self.index = params, index
        self.sizes = [p.numel() for p in params]
        n, dtype, self.device = sum(self.sizes), params[0].dtype, params[0].device
        wire = wire_dtype(dtype)
        self.grad = torch.zeros(n, dtype=dtype, device=self.device)
        self.streams = streams_for(self.device, streams)
        self.on_device = self.streams is not None      # staged through host memory
        self._waited = True
        if self.streams is not None:
            self.send = self.streams.empty(n, wire, pinned=True)
            self.recv = self.streams.empty(n, wire, pinned=True)
            # On the device, in the wire dtype: the weighted contribution on its way out, and the
            # reduced sum on its way back (scaled there in float32, then rounded once to the grad's
            # dtype).  Never the grad itself: the grad is not written behind the user's back.
            self._dev_wire = self.streams.empty(n, wire, pinned=False)
            self._stream = self.streams.stream()
            self._staged = self.streams.event()
        else:
            self.send = self.grad if wire == dtype else torch.zeros(n, dtype=wire)
            self.recv = torch.zeros(n, dtype=wire)
        self.set_views()

    def set_views(self) -> None:
        """Make every parameter's .grad a view of the bucket (zeros until backward)."""
        for p, g in zip(self.params, self.grad.split(self.sizes)):
            p.grad = g.view_as(p)

    def _grads_are_views(self) -> bool:
        base, off = self.grad.data_ptr(), 0
        for p, size in zip(self.params, self.sizes):
            if p.grad is None or p.grad.layout != torch.strided or \
                    p.grad.data_ptr() != base + off * self.grad.element_size():
                return False
            off += size
        return True

    def prepare(self, weight: float) -> None:
        """Put this rank's contribution (the gradients times its samples) in the send buffer."""
        if not self._grads_are_views():      # zero_grad(set_to_none=True), or a user who replaced .grad
            # A sparse gradient (an nn.Embedding(sparse=True) after set_to_none) travels dense, and stays dense.
            grads = [torch.zeros_like(p).reshape(-1) if p.grad is None else
                     (p.grad.to_dense() if p.grad.layout != torch.strided else p.grad).reshape(-1)
                     for p in self.params]
            torch.cat(grads, out=self.grad)
            self.set_views()
        if self.streams is None:
            if self.send is not self.grad:
                self.send.copy_(self.grad)
            if weight != 1.0:
                self.send.mul_(weight)
            return

        def stage() -> None:          # on the side stream: the next buckets' backward runs meanwhile
            self._dev_wire.copy_(self.grad)
            if weight != 1.0:
                self._dev_wire.mul_(weight)
            self.send.copy_(self._dev_wire, non_blocking=True)

        self.streams.enqueue(self._stream, stage)
        self._staged.record(self._stream)
        self.streams.staged(self.send, self._staged)
        self._waited = False

    def wait_staged(self) -> None:
        """Block (without the GIL) until the device -> host copy of prepare() is done; idempotent."""
        if self.streams is not None and not self._waited:
            self._staged.synchronize()
            self._waited = True

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(send, recv) as MPI reads and writes them: a staged send buffer only after its copy is waited for."""
        if self.streams is not None:
            self.streams.read(self.send, f"bucket {self.index}'s send buffer")
        return self.send.numpy(), self.recv.numpy()

    def finish(self, scale: float) -> None:
        """Hand the reduced mean back as the gradients (rounded once to their dtype)."""
        if self.streams is not None:
            self.wait_staged()
            # The side stream's reads of grad and writes of _dev_wire come before these writes.
            self.streams.wait_on_current(self._staged)
            self._dev_wire.copy_(self.recv, non_blocking=True)
            self._dev_wire.mul_(scale)                    # in float32: the sum of halves can exceed 65504
            self.grad.copy_(self._dev_wire)
            return
        self.recv.mul_(scale)
        if self.send is self.grad:
            # The reduced buffer becomes the gradients, and next step's send buffer.
            self.grad, self.send, self.recv = self.recv, self.recv, self.grad
            self.set_views()
        else:
            self.grad.copy_(self.recv)


class BufferBucket:
    """Module buffers kept identical: floating ones averaged with the gradients, integer ones from rank 0.

    Device buffers travel through one device tensor and one copy each way per attempt (not one blocking
    copy per buffer: about 60 per ResNet-18 step).
    """

    def __init__(self, buffers: list[torch.Tensor], floating: bool, streams: Streams | None = None) -> None:
        self.buffers, self.floating = buffers, floating
        self.sizes = [b.numel() for b in buffers]
        dtype = torch.float64 if floating else torch.int64
        self.send = torch.zeros(sum(self.sizes), dtype=dtype)
        self.recv = torch.zeros_like(self.send)
        streams = streams_for(buffers[0].device, streams)
        self._dev = streams.empty(sum(self.sizes), dtype, pinned=False) if streams is not None else None

    def prepare(self, weight: float, lowest: bool) -> None:
        flat = [b.detach().reshape(-1) for b in self.buffers]
        if self._dev is not None:
            torch.cat(flat, out=self._dev)               # converts to float64/int64 on the device
            self.send.copy_(self._dev)                    # one blocking copy
        else:
            torch.cat(flat, out=self.send)
        if self.floating:
            self.send.mul_(weight)
        elif not lowest:
            self.send.zero_()          # a sum in which only rank 0 speaks is rank 0's value

    def finish(self, scale: float) -> None:
        if self.floating:
            self.recv.mul_(scale)
        src = self.recv
        if self._dev is not None:
            self._dev.copy_(self.recv)
            src = self._dev
        # Without a new version: a forward in training mode saves batch norm's running statistics for its backward
        # (which does not read them), and another optimizer's commit can come between the two (a GAN's D step
        # averages G's, whose `fake = G(z)` G's step backpropagates).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(self.buffers)):
            for b, v in zip(self.buffers, src.split(self.sizes)):
                b.copy_(v.view_as(b))


def make_buckets(params: list[torch.Tensor], bucket_bytes: int, streams: Streams | None = None) -> list[GradBucket]:
    """Group params into buckets of about bucket_bytes, one dtype and device each.

    Reverse registration order: about the order backward makes gradients
    ready, the same on every rank (DDP's convention).
    """
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if (not out or size + nbytes > bucket_bytes or p.dtype != out[-1][0].dtype
                or p.device != out[-1][0].device):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [GradBucket(b, i, streams) for i, b in enumerate(out)]


def crc32_tensors(tensors: Iterable[torch.Tensor], crc: int = 0, chunk_bytes: int = 2**24) -> int:
    """CRC32 of the tensors' bytes in order; a device tensor is read through one chunk-sized host buffer."""
    staging: torch.Tensor | None = None
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)   # bytes of any dtype (bfloat16 too)
        if flat.device.type == "cpu":
            crc = zlib.crc32(flat.numpy().data, crc)
            continue
        if staging is None:
            staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
        for part in flat.split(chunk_bytes):
            host = staging[:part.numel()]
            host.copy_(part)
            crc = zlib.crc32(host.numpy().data, crc)
    return crc
