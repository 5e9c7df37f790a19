"""Reduce gradient buckets while backward is still running (DDP's overlap), as the first attempt of a step.

A post-accumulate-grad hook per parameter counts the gradients of its bucket;
when a bucket is complete it is staged (weighted, and copied to pinned host
memory on a GPU) and handed to one communication thread, which reduces the
buckets strictly in bucket order (the same on every rank) with the GIL
released.  A reduction that meets a failure revokes the communicator, so the
later ones fail at once (their copies are still waited for: the redo reads
every send buffer); the step's transaction then sees the failure at its
commit agree and redoes the step synchronously from the send buffers.

As DDP's reducer does, the step is finished in the autograd engine's final
callback (`queue_callback`): when backward returns, every reduction is done,
the step's transaction has committed (a redo after a failure included), and
`p.grad` holds the global mean gradient.  Nothing writes `p.grad` after that.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch
from mpi4py import MPI

from ..core.refusal import refuse
from ..transport.comm import AttemptFailed
from .buckets import GradBucket


class OverlapError(RuntimeError):
    """A gradient arrived after its bucket had been sent (accumulate inside no_sync())."""


class Overlap:
    """The hooks and the communication thread of one DistributedOptimizer.

    Args:
        buckets: the optimizer's gradient buckets, in reduction order.
        begin: called once per step, before the first bucket is staged (the
            attempt hooks: the audit line comes before any contribution).
        reduce: reduce_one(bucket_index) -> status (0: completed); runs on the
            communication thread.
        done: called in the autograd engine's final callback of a backward that
            reduced (the transaction and its commit); None: the caller calls wait().
        committed: whether the step is reduced and not yet applied (a second
            backward then is refused).
    """

    def __init__(self, buckets: list[GradBucket], begin: Callable[[], float],
                 reduce: Callable[[int], int], done: Callable[[], None] | None = None,
                 committed: Callable[[], bool] = lambda: False) -> None:
        self.buckets, self._begin, self._reduce = buckets, begin, reduce
        self._done_cb, self._committed = done, committed
        self._task = -1                   # the graph task (backward) this step's hooks fired in
        self._where = {id(p): b.index for b in buckets for p in b.params}
        self._fired: set[int] = set()
        self._count = [0] * len(buckets)
        self._next = 0                    # the next bucket to hand to the thread (bucket order)
        self._weight: float | None = None  # set by begin(): this step has started
        self._enabled = True
        self.quiet_backwards = 0          # backward passes inside no_sync() since the last step
        self._quiet_task = -1
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._done = threading.Semaphore(0)
        self._status = 0                     # the step's first failed reduction (0: none yet)
        self.started = self.failed = 0.0     # MPI.Wtime() of this step's first bucket, and of its first error
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ulfmtrain-allreduce", daemon=True)
        self._thread.start()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in buckets for p in b.params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (every micro-batch but the last)."""
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._enabled:
            task = torch._C._current_graph_task_id()
            if task != self._quiet_task:
                self._quiet_task, self.quiet_backwards = task, self.quiet_backwards + 1
            return
        if self._weight is not None and torch._C._current_graph_task_id() != self._task:
            self.abandon()                 # the backward that started this step raised (an OOM)
        if self._committed():
            # Every rank's loop does the same: a refusal of one line, not a traceback on each rank.
            refuse("overlap=True reduced the gradients and finished the step in the last backward, and another "
                   "backward came before opt.step(): accumulate micro-batches with the backward of every one but "
                   "the last inside `with opt.no_sync():` (or the DDP model's no_sync()), or call opt.step() first")
        if id(p) in self._fired:
            raise OverlapError("a gradient was accumulated twice in one step: accumulate micro-batches "
                               "inside `with opt.no_sync():` and step after the last backward")
        if self._weight is None:
            self._start()
        self._fired.add(id(p))
        i = self._where[id(p)]
        self._count[i] += 1
        self._launch_ready()

    def _start(self) -> None:
        self._weight, self.started, self.failed = self._begin(), MPI.Wtime(), 0.0
        self._task = torch._C._current_graph_task_id()
        if self._done_cb is not None and self._task >= 0:
            # DDP's reducer: finish the step when the engine is done with this backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._done_cb)

    @property
    def dirty(self) -> bool:
        """A step was started by hooks and not finished."""
        return self._weight is not None

    def abandon(self) -> None:
        """Forget a step whose backward raised before its final callback (an OOM): the next starts afresh.

        Only while nothing was sent: the peers then wait in this step's first reduction, and the
        backward that is tried again joins it.  Once a bucket is sent, this rank cannot take it back.
        """
        if self._next:
            raise OverlapError(f"backward raised after {self._next} of {len(self.buckets)} gradient buckets were "
                               "sent; the peers are inside this step's reduction and this rank cannot join it "
                               "again: let the exception end the process (the others recover without it)")
        self._fired.clear()
        self._count = [0] * len(self.buckets)
        self._weight, self._task = None, -1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._count[self._next] == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            assert self._weight is not None
            b.prepare(self._weight)
            self._queue.put(self._next)
            self._next += 1

    def wait(self) -> AttemptFailed | None:
        """After backward: hand over the buckets still incomplete (unused parameters), wait for every
        reduction; return the step's failure (None: all completed); the next step starts afresh."""
        if self._weight is None:
            self._start()
        for i in range(self._next, len(self.buckets)):
            self._count[i] = len(self.buckets[i].params)
        self._launch_ready()
        for _ in self.buckets:
            self._done.acquire()
        outcome = AttemptFailed(self._status, self.started, self.failed) if self._status else None
        self._status = 0
        self._fired.clear()
        self._count = [0] * len(self.buckets)
        self._next, self._weight, self._task = 0, None, -1
        self.quiet_backwards, self._quiet_task = 0, -1
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return outcome

    def _run(self) -> None:
        if self.buckets and self.buckets[0].streams is not None:
            self.buckets[0].streams.bind_thread()     # this rank's GPU, not a context on GPU 0
        while (i := self._queue.get()) is not None:
            if self._status:
                # After a failure the communicator is revoked: skip the reduction, but the redo
                # reads this send buffer, so its copy must be complete.
                try:
                    self.buckets[i].wait_staged()
                except BaseException as exc:  # noqa: BLE001  # raised again on the caller's thread by wait()
                    self._error = exc
            else:
                try:
                    self.buckets[i].wait_staged()
                    status = self._reduce(i)
                except BaseException as exc:  # noqa: BLE001  # raised again on the caller's thread by wait()
                    self._error, status = exc, -1
                if status:
                    self._status, self.failed = status, MPI.Wtime()
            self._done.release()

    def close(self) -> None:
        """Remove the hooks and end the thread."""
        for h in self._handles:
            h.remove()
        self._queue.put(None)
        self._thread.join()
