"""One optimizer's part of the job's replicated state: its model, its optimizer and its step, as an entry of the
job's named state (job_state.py); the initial broadcast; and the checksum that `train` reports.

A mixin of DistributedOptimizer (optim.py).
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from ..transport import faults
from ..transport.comm import StartOver
from . import serialize
from .buckets import crc32_tensors
from .job_state import BCAST

if TYPE_CHECKING:
    from ..transport.comm import Comm
    from .buckets import BufferBucket
    from .job_state import JobState


class ReplicatedState:
    """Serialize, broadcast and checksum the state of a DistributedOptimizer."""

    comm: Comm
    job: JobState
    name: str
    model: torch.nn.Module | None
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    step_count: int
    samples_total: float
    _committed_buffers: dict[str, torch.Tensor] | None
    _snapshot: dict[str, Any] | None
    _buffer_buckets: list[BufferBucket]
    _owners: tuple[int, list[ReplicatedState]] | None = None      # _buffer_owners' answer, and for how many

    def _tensors(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict() if self.model is not None else [p.detach() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }

    def _entry(self, live: bool = False) -> dict[str, Any]:
        """Its entry in the job's state: model (buffers as of the last commit, or `live`: as they are now),
        optimizer, step (a closure step in flight: as the step began)."""
        if self._snapshot is not None:
            return self._snapshot["entry"]
        state = self._tensors()
        if self._committed_buffers and not live:
            state["model"].update(self._committed_buffers)
        return {**state, "step": self.step_count, "samples": self.samples_total}

    def _load_entry(self, entry: dict[str, Any]) -> None:
        """Take an entry made by _entry() (on the host: load_state_dict copies to the parameters' device)."""
        if self.model is not None:
            _load_changed(self.model, entry["model"])
        else:
            if len(entry["model"]) != len(self.params):
                raise ValueError(f"{len(entry['model'])} parameters sent, {len(self.params)} here")
            with torch.no_grad():
                for p, v in zip(self.params, entry["model"]):
                    p.copy_(v)
        self.optimizer.load_state_dict(entry["optimizer"])
        self.step_count, self.samples_total = entry["step"], entry.get("samples", self.samples_total)
        if self._committed_buffers is not None:
            self._keep_committed_buffers()

    def _buffer_owners(self) -> list[ReplicatedState]:
        """The optimizers whose models' buffers this step averages: its own and every other of the job (each
        model once, in construction order: the same on every rank).  A model's buffers move in any training
        forward, also in another optimizer's step (a GAN's D in G's step: `D(G(z))`): so after every commit the
        replicas hold the same buffers, and a hand-over's copy as of the last commit is theirs.  Kept per number of
        the job's optimizers (the list only grows): a step asks at each bucket, on the communication thread."""
        n = len(self.job.optimizers)
        if self._owners is None or self._owners[0] != n:
            owners, seen = [], set()
            for o in [self, *cast("list[ReplicatedState]", self.job.optimizers)]:
                if o._buffer_buckets and id(o.model) not in seen:
                    seen.add(id(o.model))
                    owners.append(o)
            self._owners = (n, owners)
        return self._owners[1]

    def _step_buffers(self) -> list[BufferBucket]:
        """The buffer buckets a step of this optimizer reduces, after its gradients."""
        return [bb for o in self._buffer_owners() for bb in o._buffer_buckets]

    def _finish_buffers(self, scale: float) -> None:
        """At the commit: every reduced buffer takes the mean, and (a SpareComm) the copies a newcomer gets."""
        owners = self._buffer_owners()
        for bb in (bb for o in owners for bb in o._buffer_buckets):
            bb.finish(scale)
        for o in {id(o): o for o in [self, *owners]}.values():
            if o._committed_buffers is not None:
                o._keep_committed_buffers()

    def _keep_committed_buffers(self) -> None:
        named = self.model.named_buffers() if self.model is not None else ()
        self._committed_buffers = {k: b.detach().clone() for k, b in named}

    def _broadcast_state(self, extra: bool = False, *, finish_startup: bool = True) -> None:
        """Start every rank from the lowest survivor's state (Horovod's broadcast_parameters, fault-tolerant).

        extra: the whole job's state (the trainer's start-up: the sampler re-plans itself for this world);
        without it, this optimizer's entry.  finish_startup: the start-up ends here (comm.started); a repair that
        gave slots to spares meanwhile starts the broadcast over with them.  False: the caller starts over
        (StartOver), its start-up has more to it.
        """
        faults.point(self.step_count, "init")
        self.job.in_flight = (BCAST, self.name)
        while True:
            try:
                if extra:
                    self.job.load(self.comm.bcast_bytes(self.job.payload))
                else:
                    self._load_entry(serialize.loads(self.comm.bcast_bytes(lambda: serialize.dumps(self._entry()))))
                break
            except StartOver:
                if not finish_startup:
                    raise
        self.job.joined()
        if finish_startup:
            self.comm.started = True

    def checksum(self) -> int:
        """CRC32 of parameters, buffers, optimizer state and step: equal on consistent replicas."""
        crc = zlib.crc32(self.step_count.to_bytes(8, "little", signed=True))
        return crc32_tensors(_walk_tensors(self._tensors()), crc)


def _load_changed(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """model.load_state_dict(state), writing only the tensors whose values differ.  A replacement's catch-up puts
    the state back at its next forward (job_state.py): a tensor that a graph built before it saved (DCGAN's
    `fake = netG(noise)`, whose backward comes in G's step) must keep its version, or that backward fails."""
    own = model.state_dict()
    if own.keys() != state.keys():
        model.load_state_dict(state)         # its own line: the keys missing or unexpected
        return
    changed = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor) or v.shape != own[k].shape
               or v.dtype != own[k].dtype or not torch.equal(own[k], v.to(own[k].device))}
    # Buffers without a new version, as BufferBucket.finish writes them (a saved running statistic).
    buffers = dict(model.named_buffers())
    with torch.autograd._unsafe_preserve_version_counter(tuple(buffers[k] for k in changed if k in buffers)):
        model.load_state_dict(changed, strict=False)     # a size mismatch raises all the same


def _walk_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _walk_tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v)
