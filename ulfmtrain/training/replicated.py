"""The replicated state: what every replica keeps identical, and what a replacement (a spare, a newcomer) receives.

A mixin of DistributedOptimizer (optim.py): the model, the optimizer, the step, the registered extra state
(schedulers, GradScaler, the sampler, your own objects) and the RNG states, serialized; the initial broadcast,
the hand-over to replacements, and the checksum that proves the replicas identical.
"""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..transport import faults
from ..transport.comm import StartOver
from . import serialize
from .buckets import crc32_tensors

if TYPE_CHECKING:
    from ..transport.comm import Comm
    from .extra_state import ExtraState
    from .rng import StepRng


class ReplicatedState:
    """Serialize, broadcast, hand over and checksum the state of a DistributedOptimizer."""

    comm: Comm
    model: torch.nn.Module | None
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    step_count: int
    _extra: ExtraState
    _rng: StepRng | None
    _received_at_init: bool
    _deferring: bool              # inside defer_handover()
    _committed_buffers: dict[str, torch.Tensor] | None

    def hand_over_pending(self) -> None:
        """After a newcomer joined at a step boundary (the step committed): hand over once the update is applied,
        or at the next synchronize if the update was skipped (a GradScaler's inf step), or at the end."""
        if self._deferring:
            return
        if getattr(self.comm, "pending_handover", False):
            setattr(self.comm, "pending_handover", False)  # noqa: B010  # a SpareComm's
            self.comm.hand_over()       # type: ignore[attr-defined]

    @contextlib.contextmanager
    def defer_handover(self) -> Iterator[None]:
        """Hand a newcomer that joined at this step's commit the state as it is when the block ends, not right
        after the update: wrap step() and what your loop does after it, e.g. `scaler.step(opt);
        scaler.update(); scheduler.step()`, so that the newcomer gets the stepped schedule and the updated
        scale (else it starts one step behind the survivors)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        self.hand_over_pending()

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
        state["extra"] = self._extra.get() if extra else {}
        if extra and self._rng is not None:
            state["rng"] = self._rng.state()
        return serialize.dumps(state)

    def set_state(self, blob: bytes) -> None:
        """Take a state made by get_state(): loaded as data only (serialize.loads: UnsafeState for anything else)."""
        # On the host: load_state_dict copies to the parameters' device (which may differ from the sender's).
        state = serialize.loads(blob)
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        else:
            with torch.no_grad():
                for p, v in zip(self.params, state["model"]):
                    p.copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = state["step"]
        self._extra.load(state["extra"], state["optimizer"])
        if self._rng is not None and state.get("rng") is not None:
            self._rng.pending = state["rng"]      # taken at this rank's next training forward
        if self._committed_buffers is not None:
            self._keep_committed_buffers()

    def handover(self, root: int = 0, attempt: int = 0, *, receive: bool = False) -> None:
        """A rank that took a dead rank's slot (a spare, a newcomer): take the survivors' committed state.

        A spare that took its slot during start-up joins the initial broadcast instead, as the survivors
        start it over with it.  (root, attempt, receive: kept for callers of the older signature; the
        communicator picks the sender and tells the attempt.)
        """
        if receive and self._received_at_init:
            self._received_at_init = False      # received when this optimizer was made
            return
        if (getattr(self.comm, "takeover", None) or {}).get("startup"):
            self.broadcast_state()
        else:
            self.comm.hand_over()       # type: ignore[attr-defined]  # a SpareComm's

    def handover_payload(self) -> bytes:
        """The committed state a sender hands over (buffers as of the last update)."""
        return self.get_state(buffers=self._committed_buffers)

    def take_handover(self, blob: bytes) -> None:
        """A receiver takes the state handover_payload() made."""
        self.set_state(blob)

    def _keep_committed_buffers(self) -> None:
        named = self.model.named_buffers() if self.model is not None else ()
        self._committed_buffers = {k: b.detach().clone() for k, b in named}

    def broadcast_state(self, extra: bool = False, *, finish_startup: bool = True) -> None:
        """Start every rank from the lowest survivor's state (Horovod's broadcast_parameters, fault-tolerant).

        extra: with the extra state (the sampler, which then re-plans itself for this world); without it,
        every rank builds it alike.  finish_startup: the start-up ends here (comm.started); a repair that gave
        slots to spares meanwhile starts the broadcast over with them.  False: the caller starts over
        (StartOver), its start-up has more to it.
        """
        faults.point(self.step_count, "init")
        while True:
            try:
                self.set_state(self.comm.bcast_bytes(lambda: self.get_state(extra=extra)))
                break
            except StartOver:
                if not finish_startup:
                    raise
        if finish_startup:
            self.comm.started = True

    def checksum(self) -> int:
        """CRC32 of parameters, buffers, optimizer state and step: equal on consistent replicas."""
        crc = zlib.crc32(self.step_count.to_bytes(8, "little", signed=True))
        return crc32_tensors(_walk_tensors(self._tensors()), crc)


def _walk_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _walk_tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v)
