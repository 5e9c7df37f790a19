"""What a training script calls on its communicator besides the optimizer: a metric over the ranks
(`comm.allreduce`), a barrier, the committed step (`comm.step`), and the job's named state (`comm.track`).

A mixin of every communicator (comm.py).  Each collective here is one transaction that starts with the phase
check (phase.py), so a rank that calls it while its peers do something else stops the job with one line; a
failure inside one is repaired like a step's (with spares: the dead slot is refilled at the next step, see
membership/spares.py), and nothing internal (StartOver, AttemptFailed) reaches the script.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from .. import _ftcoll
from . import phase

T = TypeVar("T")
OPS = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}     # in phase.OPS's order
# What a repair's or a join's pickled collective (mpi4py's allgather, bcast) raises when a process dies in it: an
# MPI error, or, now and then, success with bytes that do not unpickle (a 1000-failure soak: twice, in the
# repair's allgather).  Either is a failed attempt of that collective; the agree after it decides for everyone.
EXCHANGE_FAILED = (MPI.Exception, pickle.UnpicklingError, EOFError)


def agree_all_ok(comm: MPI.Comm, ok: bool) -> bool:
    """True on every survivor iff every survivor's `ok` held and none met a failure in the agree (uniform).

    The agree's flag is uniform, its return code is not: a second agree on "my first one returned OK" turns
    the return code into a shared decision.  A death in the second agree is left to the next collective.
    """
    flag, status = _ftcoll.agree(comm, 1 if ok else 0)
    clean, _ = _ftcoll.agree(comm, 1 if status == _ftcoll.OK else 0)
    return bool(flag and clean)


class ScriptCollectives:
    """comm.allreduce, comm.barrier, comm.step and comm.track (see the module's docstring)."""

    comm: MPI.Intracomm
    world_rank: int
    # The job's named state (training/job_state.py attaches it: that layer knows torch); None before it.
    job: Any = None
    _step = 0

    def transaction(self, attempt: Callable[[int], T], commit: Callable[[T], None] | None = None, *,
                    what: str = "step", before_agree: Callable[[], None] | None = None) -> T:
        raise NotImplementedError  # pragma: no cover - the communicator's

    def reduce_try(self, send: np.ndarray, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        raise NotImplementedError  # pragma: no cover - the communicator's

    @property
    def rank(self) -> int:
        raise NotImplementedError  # pragma: no cover - the communicator's

    @property
    def step(self) -> int:
        """Steps the job has committed (read-only for a script): with several optimizers, those of the one that
        stepped least (a GAN's iterations).  A replacement reads the survivors' count: start a step loop here,
        `for step in range(comm.step, max_steps)`."""
        return self.job.step if self.job is not None else self._step

    @step.setter
    def step(self, value: int) -> None:     # a communicator used without a job (benchmarks, unit tests)
        self._step = value

    def track(self, **named: Any) -> Any:
        """Register named state that every replica keeps and a replacement receives (Horovod Elastic's State).

        Objects with state_dict()/load_state_dict() (LR schedulers, a GradScaler, an EMA model, your own) and
        plain values (int, float, str, bool, and lists and dicts of those).  Returns the state object: each name
        is an attribute (`state.global_step += 1`).  A replacement's call loads the survivors' values; calling it
        again adds names.
        """
        if self.job is None:
            raise RuntimeError("comm.track() needs the job's state: make the communicator with ulfmtrain.connect()")
        return self.job.track(**named)

    # -- the phase check -----------------------------------------------------------
    def check_phase(self, send: np.ndarray, recv: np.ndarray) -> None:
        """The first reduction of a transaction: every rank's tag (phase.py).  On a mismatch (uniform: every
        rank sees the same sums) each rank ends with status 1; the lowest says why, in one line."""
        self.reduce_try(send, recv, MPI.SUM)
        if recv[phase.PROBLEM] > 0:        # a replacement could not take the state: it said why
            raise phase.stop(getattr(self.job, "problem", None))
        if phase.agreed(recv, self.comm.Get_size()):
            return
        tags = self._tags(send)
        early = phase.left_early(tags, phase.decode(send)) if tags else None
        if early is not None:
            raise early
        if self.job is not None:
            self.job.stopped = True
        raise phase.stop(phase.report(tags, self._name_of) if self.rank == 0 else None)

    def _name_of(self, index: int) -> str:
        return self.job.name_of(index) if self.job is not None else f"optimizer {index}"

    def _tags(self, mine: np.ndarray) -> list[phase.Tag] | None:
        """Every rank's (slot, kind, index, step, lead), once a mismatch is found; None on every rank if the
        reduction failed on any (agreed: a rank whose reduction returned may leave at once, LeftEarly, and one whose
        part was still in flight then meets an error; alone it stopped the job while its peers went on)."""
        n, r = self.comm.Get_size(), self.comm.Get_rank()
        send, recv = np.zeros(6 * n), np.zeros(6 * n)
        lead = phase.lead_of(mine)
        send[6 * r:6 * r + 6] = (self.world_rank, *phase.decode(mine), lead is not None, lead or 0)
        try:
            self.reduce_try(send, recv, MPI.SUM)
            ok = True
        except Exception:       # noqa: BLE001  # a failure now: the line says less, the job still ends
            ok = False
        if not agree_all_ok(self.comm, ok):
            return None
        rows = [[int(x) for x in recv[6 * i:6 * i + 6]] for i in range(n)]
        return [(s, kind, index, step, ahead if told else None) for s, kind, index, step, told, ahead in rows]

    def _replaying(self, kind: int) -> bool:
        """A replacement that has not yet reached the transaction the survivors are in (job_state.py)."""
        return self.job is not None and self.job.replaying(kind)

    # -- what a script calls ---------------------------------------------------------
    def allreduce(self, value: Any, op: str = "mean") -> Any:
        """Reduce a metric over the ranks training now: a tensor, an ndarray or a number, returned as given.

        op: "mean" (over the ranks that contributed), "sum", "max" or "min".  A replacement that is catching up
        with the survivors (its script runs the part of the step they have done) gets its own value back.
        """
        if op not in OPS:
            raise ValueError(f"comm.allreduce(op={op!r}): give one of {', '.join(OPS)}")
        array, back = _as_array(value)
        if self._replaying(phase.COLLECTIVE):
            return value
        tag = phase.tag(phase.COLLECTIVE, phase.OPS.index(op), self.step, payload=array.size)
        seen, out = np.zeros_like(tag), np.zeros_like(array)

        def attempt(_: int) -> float:
            self.check_phase(tag, seen)
            self.reduce_try(array, out, OPS[op])
            return float(seen[phase.WEIGHT])

        ranks = self.transaction(attempt, what="allreduce")
        return back(out / ranks if op == "mean" else out)

    def barrier(self) -> None:
        """Return once every rank training now called it; a rank that dies meanwhile is repaired around."""
        if self._replaying(phase.BARRIER):
            return
        tag = phase.tag(phase.BARRIER, 0, self.step)
        seen = np.zeros_like(tag)
        self.transaction(lambda _: self.check_phase(tag, seen), what="barrier")


def _as_array(value: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """value as a float64 array, and how to turn a result back into value's kind."""
    if hasattr(value, "detach") and hasattr(value, "new_tensor"):     # a torch.Tensor, on any device
        t = value.detach()
        return np.array(t.cpu().double().numpy(), dtype=np.float64), t.new_tensor
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value, dtype=np.float64).copy(), lambda a: a.astype(value.dtype)
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        kind = int if isinstance(value, (int, np.integer)) else float
        return np.array([float(value)]), lambda a: float(a[0]) if kind is float else _int_or_float(a[0])
    raise TypeError(f"comm.allreduce(): a {type(value).__name__} is not a tensor, an ndarray or a number")


def _int_or_float(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)
