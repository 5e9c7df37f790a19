"""What ExactlyOnceSampler needs of the job, in one place: the only seam between the sampler and the optimizer.

Today these are the DistributedOptimizer's hooks (add_commit_hook, add_attempt_hook, register_extra_state,
expect_samples) and its overlap; a per-job state that holds the sampler by name replaces them here, and
nowhere else.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..training.optim import DistributedOptimizer


class SamplerHooks:
    """The commits, attempts, replicated state and step weights of the optimizer whose steps consume batches."""

    def __init__(self, opt: DistributedOptimizer) -> None:
        import torch  # here: ulfmtrain.data imports without torch

        self.opt = opt
        self._graph_task = torch._C._current_graph_task_id
        self._task, self.backwards = -1, 0
        # Backward passes through the model, counted on its parameters (a pass fires several: one count each).
        for p in opt.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: torch.Tensor) -> None:
        task = self._graph_task()
        if task != self._task:
            self._task, self.backwards = task, self.backwards + 1

    def on_commit(self, fn: Callable[[], None]) -> None:
        """fn() on every rank when a step commits."""
        self.opt.add_commit_hook(fn)

    def on_attempt(self, fn: Callable[[int, int], None]) -> None:
        """fn(step, attempt) before this rank's first contribution to each attempt of a step."""
        self.opt.add_attempt_hook(fn)

    def track(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Part of the state every replica keeps and a replacement receives (loaded here on a replacement)."""
        self.opt.register_extra_state(name, get, set)

    def expect(self, samples: int) -> None:
        """This rank's samples in the next step: its weight in the gradient mean."""
        self.opt.expect_samples(samples)

    @property
    def step(self) -> int:
        """The optimizer's committed steps."""
        return self.opt.step_count

    @property
    def overlapped(self) -> bool:
        """Backward reduces the gradients (outside no_sync())."""
        return self.opt.overlap is not None

    def quiet_backwards(self) -> int:
        """Backward passes inside no_sync() since the last step (with overlap; 0 without)."""
        return self.opt.overlap.quiet_backwards if self.opt.overlap is not None else 0
