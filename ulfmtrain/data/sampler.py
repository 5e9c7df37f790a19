"""Exactly-once epoch queues: which records each rank trains on, step by step.

Every rank keeps an identical EpochSampler for *all* alive ranks (it is
deterministic), so any survivor can work out what a dead rank had not yet
committed.  Each epoch, each rank works through a seeded permutation of the
records it holds.  A step takes up to `batch` ids from every queue; it
advances the cursors only when it commits.  When ranks die, their records not
yet committed this epoch (their in-flight batch included) go to the survivors
that now hold them (exactly-once) or are skipped this epoch (lossy).  There is
no padding: a short queue gives a short or empty batch.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.modes import DataPolicy, parse
from .plan import Ranges, holdings_of, merge_ranges, plan_recovery

if TYPE_CHECKING:
    from ..training.optim import DistributedOptimizer
    from ..transport.comm import Comm


def ids_of(ranges: Iterable[tuple[int, int]]) -> np.ndarray:
    """The record ids in ranges, ascending."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in ranges]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _held_by(ids: np.ndarray, ranges: Ranges) -> np.ndarray:
    """Mask of the ids that lie in (merged, sorted) ranges."""
    if not ranges:
        return np.zeros(len(ids), dtype=bool)
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    stops = np.array([b for _, b in ranges], dtype=np.int64)
    i = np.searchsorted(starts, ids, side="right") - 1
    return (i >= 0) & (ids < stops[np.maximum(i, 0)])


class EpochSampler:
    """Exactly-once epoch queues over the records each alive rank holds.

    Args:
        holdings: world rank -> record ranges, one entry per alive rank.
        batch: records per rank and step (at most).
        seed: the permutations' seed.
        policy: "exactly-once" or "lossy" (what happens to a dead rank's
            uncommitted records of the current epoch).
    """

    def __init__(self, holdings: Mapping[int, Ranges], batch: int, seed: int,
                 policy: str = DataPolicy.EXACTLY_ONCE) -> None:
        if batch < 1:
            raise ValueError(f"the batch must be at least 1 record per rank, got {batch}")
        self.batch, self.seed = batch, seed
        self.policy: DataPolicy = parse(DataPolicy, policy, "data policy")
        self.holdings = {int(w): merge_ranges(r) for w, r in holdings.items()}
        held = ids_of(r for rs in self.holdings.values() for r in rs)
        if len(np.unique(held)) != len(held):
            raise ValueError("holdings overlap: a record is held by two ranks")
        self.epoch = -1
        self.queues: dict[int, np.ndarray] = {}
        self.cursors: dict[int, int] = {}
        self.dropped: dict[int, int] = {}        # epoch -> records skipped (lossy)
        # The batch sizes of the step in flight, fixed when its batches are drawn: a failure appends the dead
        # rank's records to the survivors' queues, and their redo reduces the batches they drew before.
        self.taken: dict[int, int] | None = None

    def start_epoch(self, epoch: int) -> None:
        """Each rank's queue: a permutation of its records seeded by (seed, epoch, its slot)."""
        self.epoch = epoch
        self.queues = {w: np.random.default_rng([self.seed, epoch, slot]).permutation(ids_of(self.holdings[w]))
                       for slot, w in enumerate(sorted(self.holdings))}
        self.cursors = {w: 0 for w in self.queues}
        self.taken = None

    def batch_ids(self, rank: int) -> np.ndarray:
        """The ids of rank's next batch (short or empty near the end of its queue); nothing advances."""
        if self.taken is None:
            self.taken = self.batch_sizes()
        c = self.cursors[rank]
        return self.queues[rank][c:c + self.taken.get(rank, 0)]

    def batch_sizes(self) -> dict[int, int]:
        """Every alive rank's next batch size."""
        return {w: min(self.batch, len(q) - self.cursors[w]) for w, q in self.queues.items()}

    def commit(self) -> None:
        """The step committed: every alive rank consumed the batch it drew (not what a failure added since)."""
        sizes = self.batch_sizes() if self.taken is None else self.taken
        for w in self.queues:
            self.cursors[w] += sizes.get(w, 0)
        self.taken = None

    def epoch_done(self) -> bool:
        """Every queue is consumed."""
        return all(self.cursors[w] >= len(q) for w, q in self.queues.items())

    def steps_left(self) -> int:
        """Steps to the end of the epoch if nothing fails."""
        return max((-(-(len(q) - self.cursors[w]) // self.batch) for w, q in self.queues.items()), default=0)

    def remove(self, dead: Iterable[int], new_holdings: Mapping[int, Ranges]) -> dict[int, np.ndarray]:
        """Dead ranks leave: their uncommitted records of this epoch go to the survivors that now hold them.

        Args:
            dead: world ranks that died.
            new_holdings: the survivors' holdings after the data plan (which
                gave them the dead ranks' records for later epochs).

        Returns:
            The ids each survivor gained this epoch (none in lossy mode).
        """
        new = {int(w): merge_ranges(r) for w, r in new_holdings.items()}
        gained = {s: np.empty(0, dtype=np.int64) for s in new}
        for d in sorted(set(dead)):
            if d not in self.queues:
                continue
            remaining = self.queues.pop(d)[self.cursors.pop(d):]
            if self.policy == DataPolicy.LOSSY:
                self.dropped[self.epoch] = self.dropped.get(self.epoch, 0) + len(remaining)
                continue
            placed = np.zeros(len(remaining), dtype=bool)
            for s in sorted(new):
                mine = _held_by(remaining, new[s])
                placed |= mine
                # In the dead rank's order: no extra disk reads, and the same on every survivor.
                gained[s] = np.concatenate([gained[s], remaining[mine]])
                self.queues[s] = np.concatenate([self.queues[s], remaining[mine]])
            if not placed.all():
                raise ValueError(f"records {remaining[~placed][:5].tolist()} of dead rank {d} are held by no survivor")
        self.holdings = new
        return gained

    def rebalance(self, new_holdings: Mapping[int, Ranges]) -> None:
        """Hand every id still to be consumed this epoch to the rank that holds it in another world.  The batches
        of a step in flight (drawn: a join at its start) stay with the ranks that drew them and train in it; a
        rank new to the world draws nothing in it.  (Before, they were dealt again: a newcomer trained records
        that a survivor trained in the same step.)"""
        flight = self.taken or {}
        drawn = {w: self.queues[w][self.cursors[w]:self.cursors[w] + flight.get(w, 0)] for w in self.queues}
        remaining = [self.queues[w][self.cursors[w] + flight.get(w, 0):] for w in sorted(self.queues)]
        self.holdings = {int(w): merge_ranges(r) for w, r in new_holdings.items()}
        remaining += [b for w, b in drawn.items() if w not in self.holdings]     # (a rank gone: its batch is dealt)
        rest = np.concatenate(remaining) if remaining else np.empty(0, dtype=np.int64)
        none = np.empty(0, dtype=np.int64)
        self.queues = {w: np.concatenate([drawn.get(w, none), rest[_held_by(rest, self.holdings[w])]])
                       for w in sorted(self.holdings)}
        self.cursors = {w: 0 for w in self.queues}
        self.taken = None if self.taken is None else {w: len(drawn.get(w, none)) for w in self.queues}

    def state(self) -> dict[str, Any]:
        """Everything needed to continue identically (saved with the replica and in checkpoints)."""
        return {"epoch": self.epoch, "holdings": {w: list(r) for w, r in self.holdings.items()},
                "queues": {w: q.copy() for w, q in self.queues.items()}, "cursors": dict(self.cursors),
                "dropped": dict(self.dropped), "policy": str(self.policy), "batch": self.batch, "seed": self.seed,
                "taken": None if self.taken is None else dict(self.taken)}   # a spare may join a redo

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take a state made by state()."""
        self.epoch = state["epoch"]
        self.holdings = {int(w): [tuple(r) for r in rs] for w, rs in state["holdings"].items()}
        self.queues = {int(w): np.asarray(q, dtype=np.int64) for w, q in state["queues"].items()}
        self.cursors = {int(w): int(c) for w, c in state["cursors"].items()}
        self.dropped = {int(e): int(n) for e, n in state["dropped"].items()}
        taken = state.get("taken")
        self.taken = None if taken is None else {int(w): int(n) for w, n in taken.items()}


def distributed_sampler(comm: Comm, opt: DistributedOptimizer, count: int, batch: int, *, seed: int = 0,
                        policy: str = DataPolicy.EXACTLY_ONCE) -> EpochSampler:
    """An EpochSampler for a loop of your own over records 0..count-1 held in memory on every rank.

    It advances when a step of `opt` (a DistributedOptimizer) commits, hands a
    dead rank's uncommitted records to the survivors after a repair of `comm`,
    rebalances when a respawned process joins (a RespawnComm), and is part of
    the replicated state.  Epoch 0 is started; call `start_epoch(e)` for the
    next ones and train while `not epoch_done()`.
    """
    sampler = EpochSampler(holdings_of(count, comm.alive), batch, seed, policy)

    def replan(event: Any) -> None:
        if event.removed:
            sampler.remove(event.removed, plan_recovery(sampler.holdings, event.removed).holdings)

    sampler.start_epoch(0)      # before it is registered: a replacement loads the survivors' state there
    opt._add_commit_hook(sampler.commit)
    opt._register_extra_state("sampler", sampler.state, sampler.load_state)
    comm.add_listener(replan)
    if hasattr(comm, "add_join_listener"):       # a RespawnComm: a newcomer's slot gets its share again
        comm.add_join_listener(lambda rec: sampler.rebalance(holdings_of(count, comm.alive))
                               if rec["status"] == "joined" and rec["slots"] else None)
    return sampler
