"""A step with a closure (`opt.step(closure)`: LBFGS, or any optimizer that takes one), as one transaction.

A mixin of DistributedOptimizer (optim.py).  An optimizer that calls its closure once (SGD, Adam, ...: ONE_CALL)
runs it, then the usual step.  Any other (LBFGS, one of your own): the wrapped optimizer's own step runs inside
the transaction's attempt, on a closure that returns the global mean loss and leaves the global mean gradient
after each call, so that every rank takes the same line-search branches and calls the closure as often
(checked: the call's number travels with the loss).  LBFGS changes the parameters between two calls: the state
at the step's start is kept, a failure rolls the step back to it and redoes it whole on the repaired
communicator, and a replacement is handed that state (the job's state reads `_snapshot`).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from ..core.modes import Phase
from ..transport import faults, phase
from . import rng

if TYPE_CHECKING:
    from ..transport.comm import Comm
    from .buckets import BufferBucket, GradBucket
    from .job_state import JobState
    from .overlap import Overlap


# torch's optimizers that call the closure once, first thing, and update after it.
ONE_CALL = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
            torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
            torch.optim.Rprop)


class ClosureStep:
    """opt.step(closure): see the module's docstring."""

    comm: Comm
    job: JobState
    optimizer: torch.optim.Optimizer
    buckets: list[GradBucket]
    overlap: Overlap | None
    step_count: int
    _tag: tuple[np.ndarray, np.ndarray]
    _weight_sent: float
    _samples: int | None
    _snapshot: dict[str, Any] | None
    _skipping: bool

    if TYPE_CHECKING:      # DistributedOptimizer's and ReplicatedState's (optim.py, replicated.py)
        def _skip(self) -> bool: ...
        def _step_start(self) -> None: ...
        def _weight(self, samples: int | None) -> float: ...
        def _attempt(self, attempt: int) -> None: ...
        def _check_phase(self) -> None: ...
        def _kill_index(self) -> int: ...
        def _step_buffers(self) -> list[BufferBucket]: ...
        def _finish_scale(self) -> float: ...
        def _committed(self, scale: float) -> None: ...
        def _entry(self, live: bool = False) -> dict[str, Any]: ...
        def _load_entry(self, entry: dict[str, Any]) -> None: ...

    def _closure_step(self, closure: Callable[[], Any], samples: int | None) -> Any:
        if type(self.optimizer) in ONE_CALL:
            # It calls the closure once, before it updates: the closure, then the usual step (a failure redoes
            # the reduction from the send buffers; nothing to roll back).  The loss is this rank's, as in DDP.
            with torch.enable_grad():
                loss = closure()
            self.step(samples=samples)      # type: ignore[attr-defined]  # DistributedOptimizer's
            return loss
        if self._skip():
            self._skipping = False
            with torch.enable_grad():
                return closure()        # its peers committed this step: nothing is reduced nor updated
        self._step_start()
        self._weight_sent = self._weight(samples)
        self._samples = None
        # A failure between two calls of the closure (LBFGS updates the parameters between them) rolls the step
        # back to here; a replacement is handed this state.
        self._snapshot = {"entry": copy.deepcopy(self._entry()), "rng": rng.capture()}
        ran = False

        def attempt(n: int) -> Any:
            nonlocal ran
            if ran:
                self._restore_snapshot()
            ran = True
            self._attempt(n)
            self._check_phase()
            with self.overlap.no_sync() if self.overlap is not None else contextlib.nullcontext():
                loss = self.optimizer.step(self._reduced(closure))
            lowest = self.comm.rank == 0
            for bb in self._step_buffers():
                bb.prepare(self._weight_sent, lowest)
                self.comm.reduce_try(bb.send.numpy(), bb.recv.numpy(), MPI.SUM)
            return loss

        return self.comm.transaction(attempt, lambda _: self._committed(self._finish_scale()), what="step",
                                     before_agree=lambda: faults.point(self.step_count, Phase.COMMIT))

    def _reduced(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure the wrapped optimizer calls: this rank's loss and gradients, then their global means."""
        calls = 0
        total = float(self._tag[1][phase.WEIGHT])
        scale = 1.0 / total if total > 0 else 0.0

        def reduced() -> Any:
            nonlocal calls
            with torch.enable_grad():
                loss = closure()
            calls += 1
            w = self._weight_sent
            for b in self.buckets:
                b.prepare(w)
            for i, b in enumerate(self.buckets):
                b.wait_staged()
                if i + 1 == self._kill_index() and calls == 2:      # between two calls: LBFGS moved already
                    faults.point(self.step_count, Phase.ALLREDUCE)
                self.comm.reduce_try(*b.arrays(), MPI.SUM)
            # The loss's mean, and the call's number: every rank must call the closure alike (phase.py).
            # detach(): a closure may return the loss with its graph (LBFGS's documented habit)
            value = 0.0 if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            send = np.array([w * value, calls, calls * calls])
            recv = np.zeros(3)
            self.comm.reduce_try(send, recv, MPI.SUM)
            if recv[1] * recv[1] != recv[2] * self.comm.size:
                self.job.stopped = True
                raise phase.stop(phase.report(None, self.job.name_of) if self.comm.rank == 0 else None)
            for b in self.buckets:
                b.finish(scale)
            mean = recv[0] * scale
            return torch.tensor(mean, dtype=loss.dtype) if isinstance(loss, torch.Tensor) else mean

        return reduced

    def _restore_snapshot(self) -> None:
        assert self._snapshot is not None
        self._load_entry(copy.deepcopy(self._snapshot["entry"]))
        rng.restore(self._snapshot["rng"])
