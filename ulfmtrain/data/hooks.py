"""What ExactlyOnceSampler needs of the job, in one place: the only seam between the sampler and the optimizer.

The steps that consume batches are one DistributedOptimizer's, or the job's (training/job_state.py: with several
optimizers, the one that stepped least); the sampler's state is part of the job's named state ("sampler").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..training.optim import DistributedOptimizer
    from ..transport.comm import Comm


class SamplerHooks:
    """The commits, attempts, replicated state and step weights of the optimizer whose steps consume batches."""

    def __init__(self, opt: DistributedOptimizer | None, comm: Comm) -> None:
        import torch  # here: ulfmtrain.data imports without torch

        from ..training.job_state import JobState

        self.job = JobState.of(comm)
        self._opt = opt
        self.steps: Any = opt if opt is not None else self.job       # whose commits advance the sampler
        self._graph_task = torch._C._current_graph_task_id
        self._task, self.backwards = -1, 0
        self._counted: list[Any] = []
        self.count_backwards()

    @property
    def opts(self) -> list[Any]:
        """The optimizers whose steps consume batches: the one given, else the job's, also those made after the
        sampler (the data first, as examples/dcgan does)."""
        return [self._opt] if self._opt is not None else list(self.job.optimizers)

    def count_backwards(self) -> None:
        """Count the backward passes through the models, on their parameters (a pass fires several: one count
        each), of every optimizer not counted yet: at the making and at each pass of the loader."""
        for o in self.opts:
            if not any(o is c for c in self._counted):
                self._counted.append(o)
                for p in o.params:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: torch.Tensor) -> None:
        task = self._graph_task()
        if task != self._task:
            self._task, self.backwards = task, self.backwards + 1

    def on_commit(self, fn: Callable[[], None]) -> None:
        """fn() on every rank when a step commits."""
        self.steps._add_commit_hook(fn)

    def on_attempt(self, fn: Callable[[int, int], None]) -> None:
        """fn(step, attempt) before this rank's first contribution to each attempt of a step."""
        self.steps._add_attempt_hook(fn)

    def track(self, name: str, get: Callable[[], Any], set: Callable[[Any], None], *, restore: bool = True) -> None:
        """Part of the state every replica keeps and a replacement receives (loaded here on a replacement);
        restore: see JobState.register."""
        self.job.register(name, get, set, restore=restore)

    def expect(self, samples: int) -> None:
        """This rank's samples in the next step: its weight in the gradient mean."""
        self.steps._expect_samples(samples)

    def lead(self, batches: int) -> None:
        """The batches this rank's loop took past the plan's step in flight, for the attempt's tag (phase.py)."""
        self.job.lead = batches

    @property
    def step(self) -> int:
        """The committed steps (the optimizer's, or the job's)."""
        return self.steps.step_count if self.steps is not self.job else self.job.step

    def ahead(self) -> list[str]:
        """The names (and models) of the optimizers other than the one the sampler follows that committed a step
        since the job's step advanced (several stepping in turn: a GAN's D before its G), with the batches of the
        sampler's step in flight."""
        return [repr(o.name) + (f" ({type(o.model).__name__})" if o.model is not None else "")
                for o in self.job.committed_ahead() if o is not self._opt]

    @property
    def overlapped(self) -> bool:
        """Backward reduces the gradients (outside no_sync())."""
        return any(o.overlap is not None for o in self.opts)

    def quiet_backwards(self) -> int:
        """Backward passes inside no_sync() since the last step (with overlap; 0 without)."""
        return max((o.overlap.quiet_backwards for o in self.opts if o.overlap is not None), default=0)
