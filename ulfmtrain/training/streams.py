"""The streams and events of the staged device path: CUDA's, or a CPU stand-in that records their order.

A device bucket is staged to pinned host memory on a side stream, reduced by
MPI on the host, and copied back (buckets.py).  The same code runs with two
kinds of stream objects:

* `CudaStreams`: a side CUDA stream per bucket, blocking events (a waiting
  thread sleeps instead of spinning a core), pinned host buffers.
* `StandInStreams`: CPU tensors, and a side stream that *defers* the work
  enqueued on it until an event recorded after it is waited for, as a GPU
  would run it later.  A host read of a buffer whose copy was not waited for
  is an `OrderError` (and would see stale values); `log` keeps the order of
  every operation.  CI runs the device path through it (`ULFMTRAIN_STAGING=standin`
  or `make_buckets(..., streams=StandInStreams())`).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

STAGING_ENV = "ULFMTRAIN_STAGING"     # "standin": CPU buckets take the staged path through StandInStreams


class OrderError(RuntimeError):
    """A host buffer was read before the device-to-host copy that fills it was waited for."""


class CudaStreams:
    """The real thing: a side stream per bucket on `device`, blocking events, pinned buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def event(self) -> Any:
        # blocking=True: synchronize() sleeps on the driver instead of spinning a core (the default).
        return torch.cuda.Event(blocking=True)

    def empty(self, n: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        if pinned:
            return torch.zeros(n, dtype=dtype, pin_memory=True)
        return torch.zeros(n, dtype=dtype, device=self.device)

    def enqueue(self, stream: Any, fn: Callable[[], None]) -> None:
        """Run fn's tensor operations on `stream`, after everything queued so far on the current stream."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()

    def wait_on_current(self, event: Any) -> None:
        """Order the current stream after `event` (the finish's writes after the side stream's reads)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def bind_thread(self) -> None:
        """On a thread of ours (the communication thread): use this device, not a context on GPU 0."""
        torch.cuda.set_device(self.device)

    def staged(self, tensor: torch.Tensor, event: Any) -> None:
        """`tensor` (host) is written by work before `event`."""

    def read(self, tensor: torch.Tensor, what: str) -> None:
        """The host is about to read `tensor` (MPI)."""


class _StandInEvent:
    def __init__(self, owner: StandInStreams, n: int) -> None:
        self.owner, self.n, self.done = owner, n, True
        self.stream: _StandInStream | None = None

    def record(self, stream: _StandInStream) -> None:
        with self.owner.lock:
            self.stream, self.done = stream, False
            stream.pending.append(self)
            self.owner.note("record", self.n)

    def synchronize(self) -> None:
        self.owner.note("sync", self.n)
        if self.stream is not None:
            self.stream.run_until(self)


class _StandInStream:
    def __init__(self, owner: StandInStreams, n: int) -> None:
        self.owner, self.n = owner, n
        self.pending: list[Callable[[], None] | _StandInEvent] = []

    def record_event(self, event: _StandInEvent | None = None) -> _StandInEvent:
        ev = event or self.owner.event()
        ev.record(self)
        return ev

    def run_until(self, event: _StandInEvent) -> None:
        with self.owner.lock:
            if event.done:
                return
            while self.pending:
                op = self.pending.pop(0)
                if isinstance(op, _StandInEvent):
                    op.done = True
                    self.owner.note("complete", op.n)
                    if op is event:
                        return
                else:
                    self.owner.note("run", self.n)
                    op()


class StandInStreams:
    """CPU stand-in: the side stream runs its work only when an event after it is waited for."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.lock = threading.RLock()
        self.errors: list[str] = []
        self._pending: dict[int, _StandInEvent] = {}
        self._n = 0
        self.bound_threads: set[str] = set()
        self.blocking_events = True      # what CudaStreams asks of CUDA (asserted by the tests)

    def note(self, what: str, arg: Any) -> None:
        with self.lock:
            self.log.append((what, arg))

    def _next(self) -> int:
        with self.lock:
            self._n += 1
            return self._n

    def stream(self) -> _StandInStream:
        return _StandInStream(self, self._next())

    def event(self) -> _StandInEvent:
        return _StandInEvent(self, self._next())

    def empty(self, n: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    def enqueue(self, stream: _StandInStream, fn: Callable[[], None]) -> None:
        # The host thread is the current stream: what it did before is done, so the side stream's work
        # sees it.  The work itself is deferred, as on a GPU.
        with self.lock:
            self.note("enqueue", stream.n)
            stream.pending.append(fn)

    def wait_on_current(self, event: _StandInEvent) -> None:
        self.note("wait_on_current", event.n)
        if event.stream is not None:
            event.stream.run_until(event)   # the current stream is the host thread: its next op comes after

    def bind_thread(self) -> None:
        self.bound_threads.add(threading.current_thread().name)

    def staged(self, tensor: torch.Tensor, event: _StandInEvent) -> None:
        with self.lock:
            self._pending[tensor.data_ptr()] = event

    def read(self, tensor: torch.Tensor, what: str) -> None:
        with self.lock:
            ev = self._pending.get(tensor.data_ptr())
            self.log.append(("read", what))
            if ev is not None and not ev.done:
                msg = f"{what} read before its device-to-host copy was waited for"
                self.errors.append(msg)
                raise OrderError(msg)


Streams = CudaStreams | StandInStreams


def streams_for(device: torch.device, streams: Streams | None = None) -> Streams | None:
    """The stream objects for buckets on `device` (None: a CPU bucket, reduced in place)."""
    if streams is not None:
        return streams
    if device.type == "cuda":
        return CudaStreams(device)
    if device.type == "cpu" and os.environ.get(STAGING_ENV, "") == "standin":
        return _shared_standin()
    if os.environ.get(STAGING_ENV, "") not in ("", "standin"):
        raise ValueError(f"{STAGING_ENV}={os.environ[STAGING_ENV]!r}: the only value is 'standin' "
                         "(CPU buckets staged as on a GPU, for tests)")
    return None


_STANDIN: StandInStreams | None = None


def _shared_standin() -> StandInStreams:
    global _STANDIN
    if _STANDIN is None:
        _STANDIN = StandInStreams()
    return _STANDIN


@contextlib.contextmanager
def no_errors(streams: StandInStreams) -> Iterator[None]:
    """Assert that no OrderError was raised (also on another thread) within the block."""
    before = len(streams.errors)
    yield
    assert streams.errors[before:] == [], streams.errors[before:]
