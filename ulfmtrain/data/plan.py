"""Pure range planning: which records each rank holds, and who reads which lost records after a failure.

Ranges of records are half-open ``(start, stop)`` integer tuples everywhere.
Nothing here touches files or MPI, so every survivor computes the same plan
from the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..core.modes import Reload, parse

__all__ = [
    "Ranges",
    "checked_ranges",
    "merge_ranges",
    "ranges_len",
    "split_ranges",
    "initial_holdings",
    "RecoveryPlan",
    "plan_recovery",
    "check_coverage",
]

Ranges = list[tuple[int, int]]


def checked_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Return ``ranges`` as a list of int tuples, rejecting reversed or negative ones."""
    out: Ranges = []
    for r in ranges:
        start, stop = (int(v) for v in r)
        if start < 0 or stop < start:
            raise ValueError(f"invalid range ({start}, {stop}): need 0 <= start <= stop")
        out.append((start, stop))
    return out


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort ranges and coalesce adjacent or overlapping ones, dropping empty ones."""
    out: Ranges = []
    for start, stop in sorted(r for r in checked_ranges(ranges) if r[1] > r[0]):
        if out and start <= out[-1][1]:
            if stop > out[-1][1]:
                out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def ranges_len(ranges: Iterable[tuple[int, int]]) -> int:
    """Return the total number of records in ``ranges`` (overlaps counted twice)."""
    return sum(stop - start for start, stop in ranges)


def split_ranges(ranges: Iterable[tuple[int, int]], parts: int) -> list[Ranges]:
    """Split the concatenation of ``ranges`` into ``parts`` contiguous, balanced pieces.

    Part ``i`` gets items ``[L*i//parts, L*(i+1)//parts)`` of the concatenation,
    where ``L`` is the total length; a part may be empty.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    rs = [r for r in checked_ranges(ranges) if r[1] > r[0]]
    total = ranges_len(rs)
    out: list[Ranges] = []
    idx, offset = 0, 0  # current range and position inside it
    for i in range(parts):
        want = total * (i + 1) // parts - total * i // parts
        piece: Ranges = []
        while want:
            start, stop = rs[idx]
            take = min(want, stop - start - offset)
            piece.append((start + offset, start + offset + take))
            want -= take
            offset += take
            if start + offset == stop:
                idx, offset = idx + 1, 0
        out.append(piece)
    return out


def initial_holdings(count: int, world_size: int) -> dict[int, Ranges]:
    """Return each rank's contiguous shard ``[r*count//W, (r+1)*count//W)`` (empty list if empty)."""
    if world_size < 1 or count < 0:
        raise ValueError(f"need world_size >= 1 and count >= 0, got {world_size}, {count}")
    out: dict[int, Ranges] = {}
    for r in range(world_size):
        a, b = r * count // world_size, (r + 1) * count // world_size
        out[r] = [(a, b)] if b > a else []
    return out


def holdings_of(count: int, alive: list[int]) -> dict[int, Ranges]:
    """The partition of a world whose live slots are `alive`, in order: what a fresh start of it holds."""
    shards = initial_holdings(count, len(alive))
    return {w: shards[i] for i, w in enumerate(alive)}


@dataclass(frozen=True)
class RecoveryPlan:
    """Who holds and who must read which records after some ranks died.

    Attributes:
        holdings: New holdings of every survivor (keys are surviving world ranks).
        reads: What each survivor must read from disk.
        lost: Merged records the dead ranks held.
        mode: ``"partial"`` (read only the share of lost records) or ``"full"``
            (re-read the whole new shard).
    """

    holdings: dict[int, Ranges]
    reads: dict[int, Ranges]
    lost: Ranges
    mode: str = "partial"
    dead: tuple[int, ...] = field(default=())

    @property
    def survivors(self) -> list[int]:
        """Return the surviving world ranks in ascending order."""
        return sorted(self.holdings)




def plan_recovery(
    holdings: Mapping[int, Ranges], dead: Iterable[int], mode: str = "partial"
) -> RecoveryPlan:
    """Redistribute the dead ranks' records over the survivors in ascending world-rank order.

    Raises:
        ValueError: unknown ``mode``, a dead rank not in ``holdings``, or no survivors.
    """
    mode = parse(Reload, mode, "reload mode")
    dead_set = {int(d) for d in dead}
    unknown = sorted(dead_set - set(holdings))
    if unknown:
        raise ValueError(f"dead ranks {unknown} are not in the holdings (ranks {sorted(holdings)})")
    survivors = sorted(r for r in holdings if r not in dead_set)
    if not survivors:
        raise ValueError(f"no survivors: all ranks {sorted(holdings)} are dead")
    lost = merge_ranges(r for d in dead_set for r in holdings[d])
    shares = split_ranges(lost, len(survivors))
    new_holdings: dict[int, Ranges] = {}
    reads: dict[int, Ranges] = {}
    for s, share in zip(survivors, shares):
        new_holdings[s] = merge_ranges(list(holdings[s]) + share)
        reads[s] = share if mode == "partial" else list(new_holdings[s])
    return RecoveryPlan(new_holdings, reads, lost, mode, tuple(sorted(dead_set)))


def check_coverage(holdings: Mapping[int, Ranges], count: int) -> None:
    """Raise ValueError naming the first gap or overlap unless ``holdings`` cover ``[0, count)`` exactly once."""
    pieces = sorted((a, b, rank) for rank, rs in holdings.items() for a, b in checked_ranges(rs) if b > a)
    pos, prev_rank = 0, None
    for a, b, rank in pieces:
        if a > pos:
            raise ValueError(f"records [{pos}, {a}) are held by no rank")
        if a < pos:
            raise ValueError(
                f"records [{a}, {min(b, pos)}) are held twice (ranks {prev_rank} and {rank})"
            )
        if b > count:
            raise ValueError(f"rank {rank} holds records [{max(a, count)}, {b}) past the end ({count})")
        pos, prev_rank = b, rank
    if pos < count:
        raise ValueError(f"records [{pos}, {count}) are held by no rank")
