"""ExactlyOnceSampler: exactly-once batches for torch's DataLoader over any map-style Dataset.

It plans each epoch the way the `train` command does (data/sampler.py's EpochSampler: each slot works
through a seeded permutation of the records it holds; plan.py: who holds what after a failure) and cuts
every slot's queue into the same number of steps of `accumulate` micro-batches (steps.py), so every rank
takes part in every step.  Every rank keeps the plan of every slot, so when ranks die the survivors know
which records the dead ranks had not committed: those go to the survivors as extra steps at the end of the
epoch, read through the same Dataset (nothing else is read again).  The plan of a step is fixed once made: a
batch that a DataLoader worker fetched ahead of time is never lost nor changed.  Its weight in the gradient
mean is its size (a step where a slot has nothing left is a placeholder, weighted 0).

DataLoader asks for the next batch before the step in flight commits (with workers, several ahead); the
extra steps go after every batch a rank may have asked for, and while the step in flight is not the epoch's
last, every rank's loop still asks once more (its iterator says StopIteration at the plan's end, and goes on
if the plan grew).  A failure in the very last step of an epoch is the exception: a DataLoader with workers
has decided to end the loop already, so the dead rank's last records are trained at the start of the next
epoch (logged, and audited, under their own epoch), or, after the last epoch of `sampler.epochs()`, in one
more pass of it.

The loop must step the optimizer once every `accumulate` micro-batches; a loop that does not (accumulation
the sampler was not told of) is found (verdict.py) and the job ends with one line naming `accumulate=k`.
"""
from __future__ import annotations

import atexit
import os
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..core.modes import DataPolicy
from ..core.refusal import refuse
from ..transport import exits
from .hooks import SamplerHooks
from .plan import holdings_of, plan_recovery
from .sampler import EpochSampler
from .steps import Step, is_placeholder, min_size, pad, placeholder_step, plan_epoch, share
from .taken import loader_iterator, out_of_order, taken_by
from .verdict import Books

if TYPE_CHECKING:
    from ..training.optim import DistributedOptimizer
    from ..transport.comm import Comm

_live: weakref.WeakSet[ExactlyOnceSampler] = weakref.WeakSet()
_judged = False


class ExactlyOnceSampler:
    """A batch sampler: `DataLoader(dataset, batch_sampler=ExactlyOnceSampler(len(dataset), comm, ...))`.

    Every record is trained on exactly once per epoch, across failures, with any num_workers and
    prefetching.  It advances when a step of `opt` commits (default: the job's step, comm.step: with several
    optimizers, when the one that stepped least steps) and is part of the state a replacement receives.
    Do not pass samples to opt.step(): the sampler gives each step's weight.  At the end of the script the
    ranks judge that every epoch was exact; a job that was not ends with status 1 and one line.

    Args:
        count: the number of records (len(dataset)); indices 0..count-1.
        comm: the communicator (ulfmtrain.connect()).
        opt: the DistributedOptimizer whose steps consume the batches (default: the job's steps, those of the
            optimizers made before the sampler or after it).
        batch_size: records per micro-batch (at most).
        seed: the permutations' seed (the same on every rank).
        accumulate: micro-batches per optimizer step (gradient accumulation: the loop steps once every
            `accumulate` batches; len(loader) is a multiple of it).
        drop_last: every micro-batch full; the records that fill no whole step are dropped (logged, and
            audited as dropped), as DistributedSampler's and DataLoader's drop_last=True.
    """

    def __init__(self, count: int, comm: Comm, opt: DistributedOptimizer | None = None, *, batch_size: int,
                 seed: int = 0, accumulate: int = 1, drop_last: bool = False) -> None:
        if count < 1:
            raise ValueError(f"ExactlyOnceSampler needs at least one record, got count={count}")
        if batch_size < 1 or accumulate < 1:
            raise ValueError(f"ExactlyOnceSampler(batch_size={batch_size}, accumulate={accumulate}): give "
                             "positive numbers")
        self.count, self.comm, self.batch, self.k, self.drop_last = count, comm, batch_size, accumulate, drop_last
        self.hooks = SamplerHooks(opt, comm)
        self.queues = EpochSampler(holdings_of(count, comm.alive), batch_size, seed)
        self.epoch = 0
        self.plan: dict[int, list[Step]] = {}          # slot -> its micro-batches at each step of this epoch
        self.step_epoch: list[int] = []                 # the epoch each step's records belong to
        self.carry: dict[int, list[Step]] = {}         # a failure in an epoch's last step: for the next pass
        self.carry_epoch: list[int] = []
        self.done = 0                                   # steps of this plan committed
        self.books = Books(count)                       # records committed per epoch: the end's verdict
        self.job = os.environ.get("PMIX_NAMESPACE") or uuid.uuid4().hex   # this run's lines in a log
        self.generation = 0                             # a new plan: older iterators stop
        self.items_read = 0                             # records this rank's DataLoader was given
        self.replanned: list[dict[str, Any]] = []       # per failure: records re-planned, and a full re-read's
        self.free_steps = 0                             # steps of an epoch of the first plan (the whole world)
        self.replans = 0                                # failures that re-planned records (replicated)
        self._placeholder = list(range(min(batch_size if drop_last else min_size(batch_size), count)))
        self._pass: _Batches | None = None              # this rank's latest pass (its DataLoader's iterator)
        self._pass_backwards = 0                        # backward passes before it began
        self._handed = 0                                # micro-batches of this plan handed to the DataLoader
        self._checked = -1                              # the step whose accumulation was checked (overlap)
        self._per_step: int | None = None               # backward passes before this pass's first commit
        self._told = False                              # this rank's loop calls set_epoch (or epochs())
        self._log = getattr(comm, "event_log", None) or None
        self._start(0)
        self.free_steps = len(self.step_epoch)
        self.hooks.on_commit(self._committed)
        self.hooks.on_attempt(self._attempt)
        # A replacement's loads here.  Not put back after a skipped step (a GAN's D step, whose peers committed it
        # while the job's step stayed): nothing moved the plan, and a reload would start the pass over.
        self.hooks.track("sampler", self.state, self.load_state, restore=False)
        # First among the listeners, so that the recovery's log line carries what was re-planned.
        getattr(comm, "_listeners").insert(0, self._replan)  # noqa: B009  # not in the Comm protocol
        if hasattr(comm, "add_join_listener"):       # a RespawnComm: a newcomer fills an empty slot
            comm.add_join_listener(self._joined)
        if self._log:
            self._log("start", count=count, job=self.job,
                      config={"data_policy": str(DataPolicy.EXACTLY_ONCE), "batch": batch_size, "seed": seed,
                              "accumulate": accumulate, "drop_last": drop_last})
        if not _live:
            # At a first sampler: after the exit protocol's own step (registered when MPI started), so this
            # one runs before it (atexit runs the last registered first).
            atexit.unregister(_judge_at_exit)
            atexit.register(_judge_at_exit)
        exits.at_script_end(_judge_at_exit)     # also at the script's own MPI.Finalize(), once
        _live.add(self)

    # -- epochs ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Plan `epoch` (DistributedSampler's convention); the epoch in progress (a replacement's) is kept."""
        self._told = True
        if epoch == self.epoch:
            return
        if epoch < self.epoch and getattr(self.comm, "takeover", None) is not None:
            # This rank alone: it leaves, and the survivors go on without it.
            refuse(f"set_epoch({epoch}) on a replacement while the job is in epoch {self.epoch}: the loop restarted "
                   f"its own epoch counter; loop with `for epoch in sampler.epochs(0, E)` (it starts a "
                   f"replacement at the job's epoch)", speak=True)
        self._end_pass()
        self._start(epoch)

    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """`for epoch in sampler.epochs(1, E + 1):` instead of range(): set_epoch for each, a replacement
        starts at the epoch the survivors are in, and records of ranks that died in the last epoch's last
        step are trained in one more pass of that epoch."""
        for epoch in range(max(start, self.epoch), stop):
            self.set_epoch(epoch)
            yield epoch
        if self.carry_epoch and stop > start:
            self._end_pass()
            self._start_carried()
            yield self.epoch

    def _start(self, epoch: int) -> None:
        self.queues.start_epoch(epoch)
        try:
            plan, dropped = plan_epoch(self.queues.queues, self.batch, self.k, self.drop_last)
        except ValueError:
            least = min(len(q) for q in self.queues.queues.values())
            self._refuse(f"ExactlyOnceSampler: a rank holds {least} records in epoch {epoch}, fewer than the "
                         f"accumulate={self.k} micro-batches of a step: use fewer ranks or a smaller accumulate")
        steps = len(next(iter(plan.values()), []))
        carried = len(self.carry_epoch)
        self.plan = {w: self.carry.get(w, [placeholder_step(self.k)] * carried) + plan[w] for w in plan}
        self.step_epoch = self.carry_epoch + [epoch] * steps
        self.carry, self.carry_epoch = {}, []
        self.epoch = epoch
        self.books.open(epoch, dropped)
        if not steps:
            self._closed(epoch)
        self._new_plan()

    def _start_carried(self) -> None:
        """A pass of the carried steps alone (after the last epoch)."""
        self.plan, self.step_epoch = self.carry, self.carry_epoch
        self.carry, self.carry_epoch = {}, []
        self._new_plan()

    def _new_plan(self) -> None:
        self.done, self._handed, self.generation = 0, 0, self.generation + 1
        self._pass = None
        self._expect()

    def __len__(self) -> int:
        """Micro-batches in this epoch (every rank takes the same number): accumulate per step."""
        return len(self.step_epoch) * self.k

    def __iter__(self) -> Iterator[list[int]]:
        self._end_pass()
        if self.done >= len(self.step_epoch):
            if not self._told and getattr(self.comm, "takeover", None) is not None:
                # This rank alone: it leaves, and the survivors go on without it.
                return _refusing(f"a loop without set_epoch on a replacement: it cannot tell which of the script's "
                                 f"epochs follows the job's epoch {self.epoch}; loop with `for epoch in "
                                 "sampler.epochs(0, E)` (it starts a replacement at the job's epoch)")
            self._start(self.epoch + 1)          # a loop without set_epoch: the next epoch (carried steps first)
        owner = loader_iterator(sys._getframe(1))   # DataLoader's iterator: it counts the batches the loop took
        exits.quiet_torch_sigchld()              # (set by now where it has workers)
        if out_of_order(owner):
            return _refusing("DataLoader(..., in_order=False) hands batches to the loop out of the plan's order, so "
                             "that a failure's survivors cannot tell which were trained: leave in_order at True",
                             speak=self.comm.rank == 0)
        self._pass = batches = _Batches(self)
        batches.taken = taken_by(owner, lambda: batches.at - batches.start)
        self.hooks.count_backwards()
        self._pass_backwards, self._per_step = self.hooks.backwards, None
        return self._pass

    def _step(self, step: int) -> Step:
        return self.plan[self.comm.world_rank][step]

    # -- steps --------------------------------------------------------------------------
    def _expect(self) -> None:
        # The weight of the step in flight: its records (0 for a placeholder).
        if self.done < len(self.step_epoch) and self.comm.world_rank in self.plan:
            self.hooks.expect(sum(len(m) for m in self._step(self.done)))

    def _committed(self) -> None:
        if self.done >= len(self.step_epoch):
            self._refuse(f"opt.step() after the {len(self.step_epoch)} steps of epoch {self.epoch}'s plan: the "
                         f"loop {self._loop_says()}")
        if self._handed < (self.done + 1) * self.k and self.comm.world_rank in self.plan:
            self._refuse(f"opt.step() after {self._handed - self.done * self.k} of the {self.k} micro-batches the "
                         f"sampler planned for step {self.done} of epoch {self.epoch}: the loop {self._loop_says()}")
        if self._per_step is None and self._pass is not None:
            self._per_step = self.hooks.backwards - self._pass_backwards
        epoch = self.step_epoch[self.done]
        self.books.trained(epoch, [np.concatenate(s[self.done]) for s in self.plan.values()
                                   if not is_placeholder(s[self.done])])
        self.done += 1
        if epoch not in self.step_epoch[self.done:] and epoch not in self.carry_epoch:
            self._closed(epoch)
        self._expect()

    def _closed(self, epoch: int) -> None:
        dropped = self.books.close(epoch)
        if self._log:
            self._log("epoch", epoch=epoch, step=self.hooks.step, dropped=dropped.tolist())

    def _attempt(self, step: int, attempt: int) -> None:
        if self.done >= len(self.step_epoch) or self.comm.world_rank not in self.plan:
            return
        it = self._pass
        if it is not None and it.taken is not None and it.generation == self.generation:
            taken = it.taken()
            if taken is not None:   # the same on every rank that tells, unless a loop left a batch unstepped
                self.hooks.lead(it.start + taken - (self.done + 1) * self.k)
        if self.hooks.overlapped and self.k > 1 and self._checked != step:
            self._checked = step
            quiet = self.hooks.quiet_backwards()
            if quiet < self.k - 1:
                self._refuse(f"overlap=True reduces the gradients at every backward outside no_sync(), and this "
                             f"step began after {quiet + 1} of its accumulate={self.k} micro-batches: run the backward "
                             f"of the first {self.k - 1} inside `with opt.no_sync():` (or the DDP model's no_sync())")
        if self._log:
            ids = np.concatenate(self._step(self.done))
            self._log("audit", step=step, attempt=attempt, epoch=self.step_epoch[self.done], ids=ids.tolist())

    # -- the loop in phase with the plan -------------------------------------------------
    def _refuse(self, line: str) -> NoReturn:
        """Every rank meets this alike (the plan is replicated, the loop the same): the lowest survivor says it."""
        refuse(line, speak=self.comm.rank == 0)

    def _end_pass(self) -> None:
        line = self._pass_mismatch()
        if line:
            self._refuse(line)

    def _pass_mismatch(self) -> str | None:
        """A pass of the DataLoader ends (a new one, a new epoch, the script's end): a pass that was handed the
        whole plan and ran a backward for every micro-batch, with steps left uncommitted, stepped the optimizer
        less often than the plan says."""
        it, left = self._pass, len(self.step_epoch) - self.done
        if it is None or not left or it.generation != self.generation or it.at < len(self):
            return None
        if self.hooks.backwards - self._pass_backwards < len(self) - it.start:
            return None                         # the loop stopped early (a step count): nothing to judge
        return (f"the loop trained all {len(self) - it.start} micro-batches of epoch {self.epoch} with {left} of "
                f"the plan's steps uncommitted: it {self._loop_says()}")

    def _loop_says(self) -> str:
        """What the loop does against the plan (the backward passes before its first step), and the fix."""
        per = self._per_step
        if per is None:
            per = self.hooks.backwards - self._pass_backwards
        if per == self.k or per < 1:
            return (f"steps once every {self.k} micro-batch{'es' if self.k > 1 else ''}, but not in phase with "
                    f"the plan: step after every `accumulate` batches, with `(i + 1) % {self.k} == 0 or "
                    "i + 1 == len(loader)`")
        return (f"steps once every {per} micro-batches where the sampler planned {self.k}: pass "
                f"ExactlyOnceSampler(..., accumulate={per})")

    # -- failures and joins ------------------------------------------------------------
    def _replan(self, event: Any) -> None:
        dead = [d for d in event.removed if d in self.plan]
        if not dead:
            return
        # The dead ranks' records left, by the epoch they belong to (carried steps of the last one come first).
        lost: dict[int, list[np.ndarray]] = {}
        for i in range(self.done, len(self.step_epoch)):
            lost.setdefault(self.step_epoch[i], []).extend(m for d in dead for m in self.plan[d][i])
        # Their batch of the step in flight went into the steps that optimizers ahead of the job committed (D's,
        # of a GAN whose rank died before G's): trained again here, so twice by those if they train on it.  No
        # replay could be exact for both: a replacement finishes the step instead (it skips D's).
        ahead = self.hooks.ahead() if self.done < len(self.step_epoch) else []
        again = sum(len(m) for d in dead for m in self.plan[d][self.done]) if ahead else 0
        for d in dead:
            del self.plan[d]
        self.replans += 1
        self.queues.holdings = plan_recovery(self.queues.holdings, dead).holdings   # later epochs
        survivors = sorted(self.plan)
        record: dict[str, Any] = {"replanned": sum(len(m) for ms in lost.values() for m in ms),
                  "full_reread": sum(int(b - a) for s in survivors for a, b in self.queues.holdings[s])}
        if again:
            record["replayed_committed"] = {"epoch": self.step_epoch[self.done], "records": again,
                                            "step": self.hooks.step, "optimizers": ahead}
            self.books.replayed(record["replayed_committed"])
        self.replanned.append(record)
        event.extra.update(record)
        # Every rank has asked for the step after the one in flight at least, while there is one: its loop asks
        # for steps added at the end too.  The step in flight is the epoch's last: every loop has ended; the next
        # pass starts with them.
        later = self.done + 1 < len(self.step_epoch)
        for epoch, micro in lost.items():
            if not any(len(m) for m in micro):
                continue
            steps, dropped = share(np.concatenate(micro), survivors, self.batch, self.k, self.drop_last)
            self.books.drop(epoch, dropped)
            extra = len(steps[survivors[0]])
            for s in survivors:
                if later:
                    self.plan[s] += steps[s]
                else:
                    self.carry[s] = pad(self.carry.get(s, []), len(self.carry_epoch), self.k) + steps[s]
            (self.step_epoch if later else self.carry_epoch).extend([epoch] * extra)

    def _joined(self, rec: dict[str, Any]) -> None:
        if rec["status"] != "joined" or not rec["slots"]:
            return
        for slot in rec["slots"]:      # placeholder steps for the rest of this epoch; its share from the next
            self.plan[slot] = [placeholder_step(self.k)] * len(self.step_epoch)
            self.carry[slot] = [placeholder_step(self.k)] * len(self.carry_epoch)
        self.queues.holdings = holdings_of(self.count, self.comm.alive)

    # -- the end of the script ------------------------------------------------------------
    def verdict(self) -> str | None:
        """At the end: why this job was not exactly-once per epoch (one line), or None.  Every rank that ran
        the loop to its end judges alike: the plan and the records committed are replicated."""
        carried: dict[int, int] = {}
        for i, e in enumerate(self.carry_epoch):
            carried[e] = carried.get(e, 0) + sum(len(m) for steps in self.carry.values() for m in steps[i])
        return self._pass_mismatch() or self.books.verdict(carried) or self._cut_short()

    def _cut_short(self) -> str | None:
        """The script ended inside an epoch that failures made longer (the dead ranks' records, fewer ranks), at a
        step count where a failure-free run ends an epoch: its loop stopped on a count of steps fixed before them
        (Hugging Face's `max_train_steps`), and the epoch's last records were never trained.  A count that ends
        mid-epoch without failures too stops there on purpose: not judged."""
        left, step = len(self.step_epoch) - self.done, self.hooks.step
        if not self.replans or not left or not self.free_steps or step % self.free_steps:
            return None
        return (f"the script ended in epoch {self.epoch} with {left} of its steps untrained, after step {step}, "
                f"where a failure-free run ends epoch {step // self.free_steps - 1}: failures made the epochs longer "
                "(the dead ranks' records, fewer ranks) and the loop stopped on a step count fixed before them "
                "(max_train_steps?); loop over the loader (`for epoch in sampler.epochs(0, E): for batch in "
                "loader:`), or keep a spare (launch --spares 1)")

    # -- the replicated state -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "done": self.done, "plan": self.plan, "step_epoch": self.step_epoch,
                "carry": self.carry, "carry_epoch": self.carry_epoch, "queues": self.queues.state(),
                "books": self.books.state(), "job": self.job, "free_steps": self.free_steps,
                "replans": self.replans}

    def load_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.done, self.job = state["epoch"], state["done"], state["job"]
        self.free_steps = state.get("free_steps", self.free_steps)
        self.replans = state.get("replans", self.replans)
        self.plan = {int(w): [[np.asarray(m, dtype=np.int64) for m in s] for s in ss]
                     for w, ss in state["plan"].items()}
        self.carry = {int(w): [[np.asarray(m, dtype=np.int64) for m in s] for s in ss]
                      for w, ss in state["carry"].items()}
        self.step_epoch, self.carry_epoch = list(state["step_epoch"]), list(state["carry_epoch"])
        self.queues.load_state(state["queues"])
        self.books.load_state(state["books"])
        self.generation += 1
        self._handed, self._pass = self.done * self.k, None
        self._expect()


def _refusing(line: str, speak: bool = True) -> Iterator[list[int]]:
    """Refuse at the first batch asked for, not in iter(): DataLoader's iterator is made by then, so it shuts its
    workers down (refused in iter(), its half-made iterator printed an AttributeError from __del__)."""
    refuse(line, speak=speak)
    yield from ()


class _Batches:
    """One pass of a DataLoader: this rank's micro-batches from the first uncommitted step.  It may say
    StopIteration and later go on (DataLoader asks again after each batch it hands out): the steps a failure
    adds are asked for by the same loop."""

    def __init__(self, sampler: ExactlyOnceSampler) -> None:
        self.s, self.generation = sampler, sampler.generation
        self.start = self.at = sampler.done * sampler.k
        self.taken: Callable[[], int | None] | None = None      # how many of them the loop took (taken.py)

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> list[int]:
        s = self.s
        step, j = divmod(self.at, s.k)
        if self.generation != s.generation or step >= len(s.step_epoch) or s.comm.world_rank not in s.plan:
            raise StopIteration
        ids = s._step(step)[j]
        self.at += 1
        s._handed = max(s._handed, self.at)
        s.items_read += len(ids)
        # A placeholder is read and weighted 0, so that collate_fn never sees an empty batch.
        return ids.tolist() if len(ids) else s._placeholder


def _judge_at_exit() -> None:
    """The end of a script: each sampler's verdict (verdict.py says what ends the job and how), once."""
    from .verdict import judge_at_exit

    global _judged
    if _judged:
        return
    _judged = True
    for sampler in list(_live):
        judge_at_exit(sampler)
