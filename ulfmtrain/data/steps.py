"""The step plan of ExactlyOnceSampler: records cut into steps of `accumulate` micro-batches each.  Pure logic.

A step of one slot is a list of `accumulate` micro-batches (arrays of record ids).  It is either all real
(every micro-batch holds records) or all placeholder (every micro-batch empty: the sampler hands out a few
placeholder records weighted 0): a placeholder micro-batch in a real step would add its gradient to the
step's sum.  No micro-batch holds a single record unless the batch size is 1 or the slot holds fewer than
2 x accumulate records (a batch-norm layer refuses one record in training).  With drop_last every real
micro-batch is full and the records that do not fill a step are dropped (DistributedSampler's and
DataLoader's drop_last=True).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

EMPTY = np.empty(0, dtype=np.int64)
Step = list[np.ndarray]           # one slot's micro-batches of one step


def min_size(batch: int) -> int:
    """The fewest records a real micro-batch holds where the records allow it: 2 (1 for a batch of 1)."""
    return min(2, batch)


def micro_sizes(n: int, batch: int, accumulate: int, drop_last: bool = False) -> list[int]:
    """The sizes of the micro-batches that n records make: a multiple of `accumulate` of them, each at most
    `batch` (full) with drop_last, else spread evenly and at least min_size(batch) where n allows it (which
    can make a micro-batch of 2 x batch... only for batch 2 and an odd count: one of 3).  With drop_last the
    sizes cover only the records that fill whole steps."""
    if n <= 0:
        return []
    unit = accumulate * batch
    if drop_last:
        return [batch] * (accumulate * (n // unit))
    micro = accumulate * math.ceil(n / unit)
    if n // micro < min_size(batch):
        micro = accumulate * max(1, n // (min_size(batch) * accumulate))
    q, r = divmod(n, micro)
    return [q + 1] * r + [q] * (micro - r)


def cut(queue: np.ndarray, batch: int, accumulate: int, drop_last: bool = False) -> tuple[list[Step], np.ndarray]:
    """`queue` in real steps of `accumulate` micro-batches, in order; and the records dropped (drop_last).

    Raises ValueError when the queue holds records but fewer than `accumulate` (a step of them would mix
    empty micro-batches with real ones)."""
    if 0 < len(queue) < accumulate and not drop_last:
        raise ValueError(f"{len(queue)} records cannot make the {accumulate} micro-batches of a step")
    sizes = micro_sizes(len(queue), batch, accumulate, drop_last)
    bounds = np.cumsum([0, *sizes])
    micro = [queue[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [micro[i:i + accumulate] for i in range(0, len(micro), accumulate)], queue[bounds[-1]:]


def placeholder_step(accumulate: int) -> Step:
    """A step of placeholder micro-batches (weighted 0)."""
    return [EMPTY] * accumulate


def is_placeholder(step: Step) -> bool:
    return all(len(m) == 0 for m in step)


def pad(steps: list[Step], count: int, accumulate: int) -> list[Step]:
    """`steps` followed by placeholder steps up to `count` steps."""
    return steps + [placeholder_step(accumulate) for _ in range(count - len(steps))]


def plan_epoch(queues: dict[int, np.ndarray], batch: int, accumulate: int, drop_last: bool = False
               ) -> tuple[dict[int, list[Step]], np.ndarray]:
    """Every slot's queue cut into steps, all slots the same number of steps; and the records dropped.

    Without drop_last, slots with fewer steps end with placeholder steps.  With drop_last every slot takes
    the fewest full steps any slot makes (DistributedSampler gives every rank the same number of full
    batches); the rest is dropped.
    """
    cuts = {w: cut(q, batch, accumulate, drop_last) for w, q in queues.items()}
    dropped = [d for _, d in cuts.values()]
    if drop_last and cuts:
        steps = min(len(s) for s, _ in cuts.values())
        dropped += [np.concatenate(step) for s, _ in cuts.values() for step in s[steps:]]
        plan = {w: s[:steps] for w, (s, _) in cuts.items()}
    else:
        steps = max((len(s) for s, _ in cuts.values()), default=0)
        plan = {w: pad(s, steps, accumulate) for w, (s, _) in cuts.items()}
    return plan, _joined(dropped)


def share(lost: np.ndarray, survivors: Sequence[int], batch: int, accumulate: int, drop_last: bool = False
          ) -> tuple[dict[int, list[Step]], np.ndarray]:
    """Records `lost` (in this order) as extra steps for the survivors; and the records dropped (drop_last).

    Without drop_last, as few survivors (the lowest first) receive a contiguous piece each as keep every
    micro-batch at least min_size(batch) records; with drop_last, whole steps go round the survivors and the
    records that fill no whole step are dropped.  Every survivor gets the same number of steps (placeholder
    steps for the others).
    """
    survivors = sorted(survivors)
    unit = accumulate * batch
    if drop_last:
        whole = len(lost) // unit
        counts = [whole // len(survivors) + (i < whole % len(survivors)) for i in range(len(survivors))]
        bounds = np.cumsum([0, *(c * unit for c in counts)])
        pieces = [lost[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        dropped = lost[bounds[-1]:]
    else:
        receivers = min(len(survivors), max(1, len(lost) // (min_size(batch) * accumulate)))
        pieces = np.array_split(lost, receivers) + [EMPTY] * (len(survivors) - receivers)
        dropped = EMPTY
    steps = {s: cut(piece, batch, accumulate, drop_last)[0] for s, piece in zip(survivors, pieces)}
    longest = max((len(v) for v in steps.values()), default=0)
    return {s: pad(v, longest, accumulate) for s, v in steps.items()}, dropped


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    parts = [p for p in parts if len(p)]
    return np.concatenate(parts).astype(np.int64) if parts else EMPTY
