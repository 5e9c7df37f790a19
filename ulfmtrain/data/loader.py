"""ExactlyOnceSampler: exactly-once batches for torch's DataLoader over any map-style Dataset.

It plans each epoch the way the `train` command does (data/sampler.py's EpochSampler: each slot works
through a seeded permutation of the records it holds; plan.py: who holds what after a failure) and cuts
every slot's queue into the same number of non-empty batches of at most `batch_size`, so every rank takes
part in every step.  Every rank keeps the plan of every slot, so when ranks die the survivors know which
records the dead ranks had not committed: those go to the survivors as extra steps at the end of the epoch,
read through the same Dataset (nothing else is read again).  The plan of a step is fixed once made: a batch
that a DataLoader worker fetched ahead of time is never lost nor changed.  Its weight in the gradient mean is
its size (a step where a slot has nothing left gets one placeholder record, weighted 0).

DataLoader asks for the next batch before the step in flight commits (with workers, several ahead); the
extra steps go after every batch a rank may have asked for, and while the step in flight is not the epoch's
last, every rank's loop still asks once more (its iterator says StopIteration at the plan's end, and goes on
if the plan grew).  A failure in the very last step of an epoch is the exception: a DataLoader with workers
has decided to end the loop already, so the dead rank's last batch is trained at the start of the next
epoch (logged, and audited, under its own epoch).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.modes import DataPolicy
from ..training.job_state import JobState
from .plan import holdings_of, plan_recovery
from .sampler import EpochSampler

if TYPE_CHECKING:
    from ..training.optim import DistributedOptimizer
    from ..transport.comm import Comm

EMPTY = np.empty(0, dtype=np.int64)


def cut(queue: np.ndarray, steps: int, batch: int) -> list[np.ndarray]:
    """`queue` in `steps` batches of at most `batch`: full ones first, then one record a step while any is left
    (empty batches, the steps' placeholders, last)."""
    out, at = [], 0
    for i in range(steps):
        left = len(queue) - at
        size = max(min(1, left), min(batch, left - (steps - i - 1)))
        out.append(queue[at:at + size])
        at += size
    return out


class ExactlyOnceSampler:
    """A batch sampler: `DataLoader(dataset, batch_sampler=ExactlyOnceSampler(len(dataset), comm, ...))`.

    Every record is trained on exactly once per epoch, across failures, with any num_workers and
    prefetching.  It advances when the job's step commits (comm.step; with several optimizers, when the one
    that stepped least steps) and is part of the state a replacement receives ("sampler").
    Do not pass samples to opt.step(): the sampler gives each step's weight.

    Args:
        count: the number of records (len(dataset)); indices 0..count-1.
        comm: the communicator (ulfmtrain.connect()).
        opt: the DistributedOptimizer whose steps consume the batches (default: the job's steps).
        batch_size: records per rank and step (at most).
        seed: the permutations' seed (the same on every rank).
    """

    def __init__(self, count: int, comm: Comm, opt: DistributedOptimizer | None = None, *, batch_size: int,
                 seed: int = 0) -> None:
        if count < 1:
            raise ValueError(f"ExactlyOnceSampler needs at least one record, got count={count}")
        self.count, self.comm, self.batch = count, comm, batch_size
        # The steps whose commits consume batches: one optimizer's, or the job's (training/job_state.py).
        self.opt: Any = opt if opt is not None else JobState.of(comm)
        self.queues = EpochSampler(holdings_of(count, comm.alive), batch_size, seed)
        self.epoch = 0
        self.plan: dict[int, list[np.ndarray]] = {}   # slot -> its batch at each step of this epoch
        self.step_epoch: list[int] = []                # the epoch each step's records belong to
        self.carry: dict[int, list[np.ndarray]] = {}   # a failure in an epoch's last step: for the next epoch
        self.carry_epoch: list[int] = []
        self.done = 0                                  # steps of this epoch committed
        self.generation = 0                            # a new plan: older iterators stop
        self.items_read = 0                            # records this rank's DataLoader was given
        self.replanned: list[dict[str, int]] = []      # per failure: records re-planned, and a full re-read's
        self._log = getattr(comm, "event_log", None) or None
        self._start(0)
        self.opt._add_commit_hook(self._committed)
        self.opt._add_attempt_hook(self._audit)
        self.opt._register_extra_state("sampler", self.state, self.load_state)   # a replacement's loads here
        # First among the listeners, so that the recovery's log line carries what was re-planned.
        getattr(comm, "_listeners").insert(0, self._replan)  # noqa: B009  # not in the Comm protocol
        if hasattr(comm, "add_join_listener"):       # a RespawnComm: a newcomer fills an empty slot
            comm.add_join_listener(self._joined)
        if self._log:
            self._log("start", count=count, config={"data_policy": str(DataPolicy.EXACTLY_ONCE),
                                                    "batch": batch_size, "seed": seed})

    # -- epochs ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Plan `epoch` (DistributedSampler's convention); the epoch in progress (a replacement's) is kept."""
        if epoch != self.epoch:
            self._start(epoch)

    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """`for epoch in sampler.epochs(1, E + 1):` instead of range(): set_epoch for each, and a replacement
        starts at the epoch the survivors are in."""
        for epoch in range(max(start, self.epoch), stop):
            self.set_epoch(epoch)
            yield epoch

    def _start(self, epoch: int) -> None:
        self.queues.start_epoch(epoch)
        queues = self.queues.queues
        steps = max((math.ceil(len(q) / self.batch) for q in queues.values()), default=0)
        carried = len(self.carry_epoch)
        self.plan = {w: self.carry.get(w, [EMPTY] * carried) + cut(q, steps, self.batch) for w, q in queues.items()}
        self.step_epoch = self.carry_epoch + [epoch] * steps
        self.carry, self.carry_epoch = {}, []
        self.epoch, self.done, self.generation = epoch, 0, self.generation + 1
        self._expect()

    def __len__(self) -> int:
        """Steps in this epoch (every rank takes the same number)."""
        return len(self.step_epoch)

    def __iter__(self) -> Iterator[list[int]]:
        if self.done >= len(self.step_epoch) and not self.carry_epoch:
            self._start(self.epoch + 1)          # a loop without set_epoch: the next epoch
        return _Batches(self)

    def _mine(self, step: int) -> np.ndarray:
        return self.plan[self.comm.world_rank][step]

    # -- steps --------------------------------------------------------------------------
    def _expect(self) -> None:
        # The weight of the step in flight: its records (0 for a placeholder).
        if self.done < len(self.step_epoch) and self.comm.world_rank in self.plan:
            self.opt._expect_samples(len(self._mine(self.done)))

    def _committed(self) -> None:
        if self.done >= len(self.step_epoch):
            return                                # a step outside the plan (the loop ran past it)
        epoch = self.step_epoch[self.done]
        self.done += 1
        if self._log and (self.done == len(self.step_epoch) or self.step_epoch[self.done] != epoch):
            self._log("epoch", epoch=epoch, step=self.comm.step)
        self._expect()

    def _audit(self, step: int, attempt: int) -> None:
        if self._log and self.done < len(self.step_epoch) and self.comm.world_rank in self.plan:
            self._log("audit", step=step, attempt=attempt, epoch=self.step_epoch[self.done],
                      ids=self._mine(self.done).tolist())

    # -- failures and joins ------------------------------------------------------------
    def _replan(self, event: Any) -> None:
        dead = [d for d in event.removed if d in self.plan]
        if not dead:
            return
        left = [b for d in dead for b in self.plan[d][self.done:]]
        lost = np.concatenate(left) if left else EMPTY
        for d in dead:
            del self.plan[d]
        self.queues.holdings = plan_recovery(self.queues.holdings, dead).holdings   # later epochs
        survivors = sorted(self.plan)
        record = {"replanned": int(len(lost)),
                  "full_reread": sum(int(b - a) for s in survivors for a, b in self.queues.holdings[s])}
        self.replanned.append(record)
        event.extra.update(record)
        if not len(lost):
            return
        n = len(survivors)
        extra = math.ceil(len(lost) / (n * self.batch))
        pieces = np.array_split(lost, n * extra)
        steps = {s: [pieces[k * n + i] for k in range(extra)] for i, s in enumerate(survivors)}
        if self.done + 1 < len(self.step_epoch):
            # Every rank has asked for the step after the one in flight at least: its loop asks for these too.
            for s in survivors:
                self.plan[s] += steps[s]
            self.step_epoch += [self.step_epoch[self.done]] * extra
        else:
            # The step in flight is the epoch's last: every loop has ended; the next epoch starts with these.
            for s in survivors:
                self.carry[s] = self.carry.get(s, []) + steps[s]
            self.carry_epoch += [self.step_epoch[-1]] * extra

    def _joined(self, rec: dict[str, Any]) -> None:
        if rec["status"] != "joined" or not rec["slots"]:
            return
        for slot in rec["slots"]:      # a placeholder at each step left of this epoch; its share from the next
            self.plan[slot] = [EMPTY] * len(self.step_epoch)
            self.carry[slot] = [EMPTY] * len(self.carry_epoch)
        self.queues.holdings = holdings_of(self.count, self.comm.alive)

    # -- the replicated state -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "done": self.done, "plan": self.plan, "step_epoch": self.step_epoch,
                "carry": self.carry, "carry_epoch": self.carry_epoch, "queues": self.queues.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.done = state["epoch"], state["done"]
        self.plan = {int(w): [np.asarray(b, dtype=np.int64) for b in bs] for w, bs in state["plan"].items()}
        self.carry = {int(w): [np.asarray(b, dtype=np.int64) for b in bs] for w, bs in state["carry"].items()}
        self.step_epoch, self.carry_epoch = list(state["step_epoch"]), list(state["carry_epoch"])
        self.queues.load_state(state["queues"])
        self.generation += 1
        self._expect()


class _Batches:
    """One pass of a DataLoader: this rank's batches from the first uncommitted step.  It may say StopIteration
    and later go on (DataLoader asks again after each batch it hands out): the steps a failure adds are asked
    for by the same loop."""

    def __init__(self, sampler: ExactlyOnceSampler) -> None:
        self.s, self.at, self.generation = sampler, sampler.done, sampler.generation

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> list[int]:
        s = self.s
        if self.generation != s.generation or self.at >= len(s.step_epoch) or s.comm.world_rank not in s.plan:
            raise StopIteration
        ids = s._mine(self.at)
        self.at += 1
        s.items_read += len(ids)
        # A placeholder is read and weighted 0, so that collate_fn never sees an empty batch.
        return ids.tolist() if len(ids) else [0]
