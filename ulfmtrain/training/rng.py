"""The random-number state a replacement needs: torch (CPU and CUDA), numpy's and Python's global generators.

No rank holds a dead rank's own generator state, so two ways make a replacement draw what the dead rank
would have drawn (its dropout masks):

* the hand-over carries the lowest survivor's state as it was when the step in flight began (its first
  training forward): exact when every rank draws alike (the same seed, the same calls);
* `seed_each_step(seed)`: at each step's first training forward every rank seeds the three generators from
  (seed, its slot, the step), so any rank's state at any step is known: exact whatever each rank draws.
"""
from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's generator states (CUDA's only where CUDA is initialized: reading it would initialize it)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(), "random": random.getstate()}


def restore(state: dict[str, Any]) -> None:
    """Take states made by capture() (CUDA's where both sides have it)."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])


def seed_all(seed: int, slot: int, step: int) -> None:
    """Seed torch (every device), numpy and random from (seed, slot, step)."""
    s = int(np.random.SeedSequence([seed, slot, step]).generate_state(1)[0])
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


class StepRng:
    """At each step's first forward in training mode: seed (seed_each_step) or take a handed-over state, then
    keep the state as the step began, for a hand-over."""

    def __init__(self, model: torch.nn.Module, slot: Any, step: Any, keep: bool) -> None:
        self.slot, self.step, self.keep = slot, step, keep    # callables: this rank's slot, the step in flight
        self.seed: int | None = None
        self.began = False
        self.at_step: dict[str, Any] | None = None
        self.pending: dict[str, Any] | None = None           # handed over, taken at the first forward
        on_forward(model, self._forward)

    def _forward(self, module: torch.nn.Module) -> None:
        if self.began or not module.training:
            return
        self.began = True
        if self.seed is not None:
            seed_all(self.seed, self.slot(), self.step())
        elif self.pending is not None:
            restore(self.pending)
        self.pending = None
        if self.keep:
            self.at_step = capture()

    def committed(self) -> None:
        self.began = False

    def state(self) -> dict[str, Any]:
        """The state to hand over: as the step in flight began (the newcomer redoes it), or as it is now."""
        return self.at_step if self.began and self.at_step is not None else capture()


def on_forward(model: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> None:
    """Call fn(model) before each forward of `model`.

    A global hook, not one on the module: torch.save(model) pickles a module's own hooks, and ours refer to the
    optimizer (and its communicator), which cannot be pickled.
    """
    ref = weakref.ref(model)

    def hook(module: torch.nn.Module, _args: Any) -> None:
        if module is ref():
            fn(module)

    torch.nn.modules.module.register_module_forward_pre_hook(hook)
