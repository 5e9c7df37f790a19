"""How many of a pass's batches the training loop has taken, where the sampler can know: a pass that torch's
DataLoader asks for (its iterator is the caller of iter(sampler)).  With workers, the iterator's own count of
the batches it gave the loop (or went past, once the loop caught a worker's error), not what the sampler handed
it, which runs ahead by the prefetch; without workers nothing runs ahead: what the sampler handed (a fetch that
raised and that the loop passed over counts too).

A loop that takes a batch and leaves it without its step (`continue` before opt.step()) runs a batch ahead of the
plan from there: the sampler would book the planned batch as trained and the next one as not, and after a failure
the survivors would train again what it trained (a record missing, one twice, status 0).  Each step's tag carries
the lead (phase.py), so the ranks find it in the first step after the skip, before that step commits.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any


def loader_iterator(frame: FrameType | None) -> Any:
    """torch's DataLoader iterator whose method made this frame's call, or None (the sampler iterated otherwise)."""
    try:
        from torch.utils.data.dataloader import _BaseDataLoaderIter
    except ImportError:         # (ulfmtrain.data imports without torch)
        return None
    owner = frame.f_locals.get("self") if frame is not None else None
    return owner if isinstance(owner, _BaseDataLoaderIter) else None


def taken_by(owner: Any, handed: Callable[[], int]) -> Callable[[], int | None] | None:
    """The count of the pass's batches the loop has taken, where `owner` (loader_iterator of iter(sampler)'s
    caller) is a DataLoader iterator; handed: the sampler's own count of the pass.  None elsewhere (a loop over the
    sampler itself, a wrapper that may prefetch): nothing is told."""
    if owner is None:
        return None
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    if not isinstance(owner, _MultiProcessingDataLoaderIter):
        return handed
    ref = weakref.ref(owner)

    def taken() -> int | None:
        it = ref()
        return None if it is None else int(it._rcvd_idx)     # the next batch it gives: past those it went past
    return taken


def out_of_order(owner: Any) -> bool:
    """The DataLoader hands batches out as its workers finish them (in_order=False), not in the plan's order."""
    return owner is not None and getattr(owner, "_in_order", True) is False
