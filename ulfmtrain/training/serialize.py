"""The replicated state as bytes and back, without running code: what a checkpoint and a hand-over hold.

torch.save writes it; torch.load(weights_only=True) reads it, which builds tensors, numbers, strings, bytes,
lists, tuples, sets and dicts, and numpy's arrays and scalars (the sampler's queues, numpy's generator state:
only their reconstructors are allowed, and an array of objects is built from the same restricted load), and
refuses anything else.  So bytes that someone else could write (a checkpoint directory) cannot run code as
the user who loads them.  A registered object whose state holds other objects opts in by name
(`register_state(name, obj, pickle=True)`): its state travels as pickled bytes that only its own setter
unpickles (docs/security.md).
"""
from __future__ import annotations

import io
import pickle
import warnings
from typing import Any

import numpy as np
import torch

# What numpy's arrays, dtypes and scalars pickle as (found from the objects: their module moved in numpy 2); the
# dtypes of numbers and booleans only; and bytes(), which an empty array's data pickles as (it builds bytes and
# runs nothing).
_NUMPY: list[Any] = [np.arange(1).__reduce__()[0], np.ndarray, np.dtype, np.int64(0).__reduce__()[0],
          *{type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}, bytes]


class UnsafeState(ValueError):
    """Bytes that a safe load refuses (objects other than data: a pickle that would run code), or that are not
    a saved state at all."""


def dumps(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(blob: bytes) -> Any:
    """What dumps() wrote, on the CPU; UnsafeState (with one line of why) for anything else."""
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(_NUMPY):
            warnings.simplefilter("ignore")       # torch's remarks on pickle protocols of bytes it refuses anyway
            return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, KeyError) as exc:
        raise UnsafeState(_why(exc)) from None


def _why(exc: BaseException) -> str:
    """The line of torch's message that names what was refused (it runs to a page)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [type(exc).__name__]
    at = next((i for i, x in enumerate(lines) if "WeightsUnpickler error:" in x), 0)
    # The problem follows "WeightsUnpickler error:", on its line or the next.
    lines[at] = lines[at].split("WeightsUnpickler error:")[-1].strip() or lines[min(at + 1, len(lines) - 1)]
    named = next((x for x in lines if any(w in x for w in ("GLOBAL", "but got", "failed reading"))), lines[at])
    return named.split(" Please use ")[0].split(" This is an internal")[0].rstrip(".")


def check_loadable(name: str, state: Any) -> None:
    """TypeError, with the fix, unless `state` comes back from dumps() through loads() (a registered object's
    state_dict(), checked when it is registered rather than at a resume or a hand-over)."""
    try:
        loads(dumps(state))
    except UnsafeState as exc:
        raise TypeError(f"comm.track({name}=...): its state_dict() holds what a safe load refuses ({exc}): keep "
                        "tensors, numbers, strings, lists and dicts in it, or register it with "
                        f"opt.register_state({name!r}, obj, pickle=True) if you trust whoever can write your "
                        "checkpoints (docs/security.md)") from None


class Pickled:
    """An object whose state travels pickled (register_state(..., pickle=True)): only its own setter unpickles."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> bytes:
        return pickle.dumps(self.obj.state_dict())

    def load_state_dict(self, blob: bytes) -> None:
        self.obj.load_state_dict(pickle.loads(blob))
