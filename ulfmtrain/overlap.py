"""Reduce gradient buckets while backward is still running (DDP's overlap), as the first attempt of a step.

A post-accumulate-grad hook per parameter counts the gradients of its bucket;
when a bucket is complete it is staged (weighted, and copied to pinned host
memory on a GPU) and handed to one communication thread, which reduces the
buckets strictly in bucket order (the same on every rank) with the GIL
released.  A reduction that meets a failure revokes the communicator, so the
later ones fail at once; the step's transaction then sees the failure at its
commit agree and redoes the step synchronously from the send buffers.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch
from mpi4py import MPI

from .buckets import GradBucket
from .comm import AttemptFailed


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
    """

    def __init__(self, buckets: list[GradBucket], begin: Callable[[], float],
                 reduce: Callable[[int], int]) -> None:
        self.buckets, self._begin, self._reduce = buckets, begin, reduce
        self._where = {id(p): b.index for b in buckets for p in b.params}
        self._fired: set[int] = set()
        self._count = [0] * len(buckets)
        self._next = 0                    # the next bucket to hand to the thread (bucket order)
        self._weight: float | None = None  # set by begin(): this step has started
        self._enabled = True
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
            return
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
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        outcome = AttemptFailed(self._status, self.started, self.failed) if self._status else None
        self._status = 0
        self._fired.clear()
        self._count = [0] * len(self.buckets)
        self._next, self._weight = 0, None
        return outcome

    def _run(self) -> None:
        while (i := self._queue.get()) is not None:
            if not self._status:             # after a failure the communicator is revoked: skip the rest
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
