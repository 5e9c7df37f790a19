"""The overlapped strategy's background writer: snapshots become durable while training goes on."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .format import Snapshot

__all__ = ["WriteResult", "OverlappedWriter"]


@dataclass
class WriteResult:
    """The outcome of one checkpoint write."""

    step: int
    path: str | None
    write_ms: float
    nbytes: int
    t_done: float
    error: str | None = None
    pruned: list[str] = field(default_factory=list)


class OverlappedWriter:
    """Persist snapshots on a background thread with at most `max_inflight` not yet durable.

    submit() blocks only when that many writes are already in flight: that
    wait is the whole stall training sees beyond the snapshot itself.
    """

    def __init__(self, write: Callable[[Snapshot], WriteResult], max_inflight: int = 2) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self._write = write
        self._slots = threading.Semaphore(max_inflight)
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._done: list[WriteResult] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ulfmtrain-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> float:
        """Queue snap; return the milliseconds spent waiting for a free slot."""
        t0 = time.perf_counter()
        self._slots.acquire()
        self._queue.put(snap)
        return (time.perf_counter() - t0) * 1e3

    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            if snap is None:
                return
            try:
                res = self._write(snap)
            finally:
                self._slots.release()
            with self._lock:
                self._done.append(res)

    def finished(self) -> list[WriteResult]:
        """Results of the writes completed since the last call."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def close(self) -> list[WriteResult]:
        """Wait for every queued write; return the results not yet collected."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        return self.finished()
