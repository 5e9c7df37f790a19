"""The records one rank holds in memory, grown after a recovery without copying what it had."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from ..core.modes import Reload
from .format import BLOCK_BYTES, DatasetFile
from .plan import Ranges, RecoveryPlan, checked_ranges, merge_ranges, ranges_len

__all__ = ["LocalShard", "subtract_ranges"]


def subtract_ranges(a: Ranges, b: Ranges) -> Ranges:
    """The records of merged ranges ``a`` that are not in merged ranges ``b``, merged."""
    out: Ranges = []
    for start, stop in a:
        for bs, be in b:
            if be <= start or bs >= stop:
                continue
            if bs > start:
                out.append((start, bs))
            start = max(start, be)
            if start >= stop:
                break
        if start < stop:
            out.append((start, stop))
    return merge_ranges(out)


class LocalShard:
    """The records one rank holds in memory, grown after a recovery without copying what it had.

    Records are kept in segments, one per load: a partial reload appends one
    segment, so its cost follows the lost records, not the whole shard.
    Index i counts through the segments in the order they were loaded
    (``order`` gives the record ranges in that order).

    Attributes:
        holdings: Merged ranges held, in ascending order.
        order: The same records as ranges, in storage (index) order.
    """

    def __init__(self, dataset: DatasetFile, holdings: Iterable[tuple[int, int]]) -> None:
        """Load ``holdings`` (merged and sorted) from ``dataset``."""
        self.dataset = dataset
        self.holdings: Ranges = merge_ranges(holdings)
        self.order: Ranges = list(self.holdings)
        self._segments = [self._load(self.holdings)]
        self._starts = np.zeros(1, dtype=np.int64)

    def __len__(self) -> int:
        return ranges_len(self.holdings)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every held record as contiguous per-field arrays, in index order (a copy once there are segments)."""
        if len(self._segments) == 1:
            return self._segments[0]
        return {k: np.concatenate([seg[k] for seg in self._segments]) for k in self._segments[0]}

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gather the records at indices idx (a batch)."""
        if len(self._segments) == 1:
            return {k: v[idx] for k, v in self._segments[0].items()}
        seg = np.searchsorted(self._starts, idx, side="right") - 1
        out = {k: np.empty((len(idx), *v.shape[1:]), v.dtype) for k, v in self._segments[0].items()}
        for s in np.unique(seg):
            mask = seg == s
            local = idx[mask] - self._starts[s]
            for k in out:
                out[k][mask] = self._segments[s][k][local]
        return out

    def _load(self, ranges: Ranges) -> dict[str, np.ndarray]:
        """Read ``ranges`` into freshly allocated contiguous arrays in bounded pieces."""
        ds = self.dataset
        out = ds.empty(ranges_len(ranges))
        # Reading in blocks keeps the transient read buffer small even when the
        # shard is many GiB; each block is still a single positioned read.
        step = max(1, BLOCK_BYTES // ds.record_size)
        pos = 0
        for start, stop in ranges:
            for lo in range(start, stop, step):
                hi = min(stop, lo + step)
                part = ds.read(lo, hi)
                for name in out:
                    out[name][pos : pos + hi - lo] = part[name]
                pos += hi - lo
        return out

    def apply(self, plan: RecoveryPlan, rank: int) -> tuple[int, float]:
        """Bring this shard to ``plan.holdings[rank]``, reading only what the plan's mode requires.

        Returns:
            Bytes read from the dataset and the seconds spent.

        Raises:
            ValueError: ``rank`` is not a survivor, or the plan was not made from
                this shard's holdings.
        """
        if rank not in plan.holdings:
            raise ValueError(f"rank {rank} is not a survivor in this plan (survivors {plan.survivors})")
        target = merge_ranges(plan.holdings[rank])
        reads = checked_ranges(plan.reads[rank])
        t0 = time.perf_counter()
        before = self.dataset.bytes_read
        if plan.mode == Reload.FULL:
            if merge_ranges(reads) != target or ranges_len(reads) != ranges_len(target):
                raise ValueError(f"plan reads for rank {rank} do not equal its new holdings")
            # Release the old copy first so peak memory is one shard, not two.
            self._segments = []
            self._segments = [self._load(reads)]
            self._starts = np.zeros(1, dtype=np.int64)
            self.order = list(reads)
        elif plan.mode == Reload.PARTIAL:
            if merge_ranges(self.holdings + reads) != target or ranges_len(self.holdings) + ranges_len(
                reads
            ) != ranges_len(target):
                raise ValueError(
                    f"plan for rank {rank} was not made from this shard's holdings {self.holdings}"
                )
            if reads:
                self._starts = np.append(self._starts, len(self))
                self._segments.append(self._load(reads))
                self.order = self.order + list(reads)
        else:
            raise ValueError(f"unknown recovery mode {plan.mode!r}")
        self.holdings = target
        return self.dataset.bytes_read - before, time.perf_counter() - t0

    def retarget(self, target: Iterable[tuple[int, int]]) -> tuple[int, float]:
        """Hold exactly ``target`` (a respawned rank joined): keep what is held, read only the rest.

        Returns:
            Bytes read from the dataset and the seconds spent.
        """
        target = merge_ranges(target)
        t0, before = time.perf_counter(), self.dataset.bytes_read
        reads = subtract_ranges(target, self.holdings)
        kept = subtract_ranges(target, reads)
        ids = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in kept] or [np.empty(0, np.int64)])
        segments = [self.take(self.index_of(ids))] if kept else []
        if reads:
            segments.append(self._load(reads))
        self._segments = segments or [self.dataset.empty(0)]
        self._starts = np.array([0, ranges_len(kept)][:len(self._segments)], dtype=np.int64)
        self.order = kept + reads
        self.holdings = target
        return self.dataset.bytes_read - before, time.perf_counter() - t0

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        """Storage indices of record ids (the same records whatever the reload mode stored them in)."""
        starts = np.array([a for a, _ in self.order], dtype=np.int64)
        stops = np.array([b for _, b in self.order], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(stops - starts)[:-1]]).astype(np.int64)
        by_start = np.argsort(starts)
        ids = np.asarray(ids, dtype=np.int64)
        i = by_start[np.searchsorted(starts[by_start], ids, side="right") - 1] if len(starts) else by_start
        if len(ids) and (len(starts) == 0 or np.any(ids >= stops[i]) or np.any(ids < starts[i])):
            missing = sorted(set(ids.tolist()) - set(self.ids().tolist()))[:5]
            raise ValueError(f"records {missing} are not in this shard")
        return offsets[i] + ids - starts[i]

    def ids(self) -> np.ndarray:
        """Every held record id, in storage order."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.order] or [np.empty(0, np.int64)])
