"""The random-number state a replacement needs: torch (CPU and CUDA), numpy's and Python's global generators.

No rank holds a dead rank's own generator state, so two ways make a replacement draw what the dead rank
would have drawn (its dropout masks):

* the hand-over carries the lowest survivor's state as it was when the step in flight began (its first
  training forward of any of the job's models: JobRng): exact when every rank draws alike (the same seed, the
  same calls);
* `DistributedOptimizer(..., seed=S)`: at each step's first training forward every rank seeds the three
  generators from (S, its slot, the step: StepSeed), so any rank's state at any step is known: exact whatever
  each rank draws.
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


class JobRng:
    """The generator state a replacement takes: kept at the first training forward of any of the job's models in
    each of its steps (the hand-over sends it, so the replacement draws from where the step began), and taken,
    when handed over, at the replacement's first training forward."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep                  # only where a replacement can come (spares, respawn): capture costs
        self.began = False
        self.at_step: dict[str, Any] | None = None
        self.pending: dict[str, Any] | None = None

    def forward(self) -> None:
        if self.began:
            return
        self.began = True
        if self.pending is not None:
            restore(self.pending)
            self.pending = None
        if self.keep:
            self.at_step = capture()

    def advanced(self) -> None:
        """The job's step committed: the next forward begins the next one."""
        self.began = False

    def state(self) -> dict[str, Any]:
        """The state to hand over: as the step in flight began (the replacement redoes it), or as it is now."""
        return self.at_step if self.began and self.at_step is not None else capture()


class StepSeed:
    """DistributedOptimizer(seed=...): at its step's first training forward of the model, seed the three
    generators from (seed, this rank's slot, the step)."""

    def __init__(self, seed: int, slot: Callable[[], int], step: Callable[[], int]) -> None:
        self.seed, self.slot, self.step = seed, slot, step
        self.began = False

    def forward(self) -> None:
        if not self.began:
            self.began = True
            seed_all(self.seed, self.slot(), self.step())

    def committed(self) -> None:
        self.began = False


def on_forward(model: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> None:
    """Call fn(module) before each forward of `model` or of any module inside it: a loop may never call the model
    itself (a ModuleDict of a GAN's two networks, `vae.encode(x)`, `model.backbone(x)`); fn acts once a step.

    A global hook, not one on the module: torch.save(model) pickles a module's own hooks, and ours refer to the
    optimizer (and its communicator), which cannot be pickled.
    """
    parts = weakref.WeakSet(model.modules())

    def hook(module: torch.nn.Module, _args: Any) -> None:
        if module in parts:
            fn(module)

    torch.nn.modules.module.register_module_forward_pre_hook(hook)
