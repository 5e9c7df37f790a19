"""A rank ends its children and itself once its launcher is gone (jobtree.watch_launcher), without MPI: a
`sleep` stands for `launch`, a Python process for the rank, and another `sleep` for its DataLoader worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ulfmtrain.transport import jobtree

pytestmark = pytest.mark.timeout(60)
RANK = """
import json, subprocess, sys, time
from ulfmtrain.transport import jobtree
jobtree.watch_launcher()
worker = subprocess.Popen(["sleep", "600"], start_new_session=True)   # even in a session of its own
print(json.dumps([worker.pid]), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_under(launcher: int) -> tuple[subprocess.Popen, int]:
    rank = subprocess.Popen([sys.executable, "-P", "-c", RANK], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, jobtree.LAUNCHER_ENV: jobtree.identity(launcher)})
    return rank, json.loads(rank.stdout.readline())[0]


def test_a_rank_whose_launcher_dies_ends_its_children_and_itself():
    launcher = subprocess.Popen(["sleep", "600"])
    rank, worker = rank_under(launcher.pid)
    time.sleep(0.5)
    assert rank.poll() is None and alive(worker)       # the launcher lives: nothing happens
    launcher.kill()
    launcher.wait()
    assert rank.wait(timeout=10) == -9
    end = time.monotonic() + 5
    while alive(worker) and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive(worker)


def test_a_launcher_named_with_another_start_time_is_gone_already():
    """A pid taken by another process since (its start time differs): the rank ends at once."""
    launcher = subprocess.Popen(["sleep", "600"])
    try:
        boot, pid, start = jobtree.identity(launcher.pid).split(":")
        rank = subprocess.Popen([sys.executable, "-P", "-c", RANK], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, jobtree.LAUNCHER_ENV: f"{boot}:{pid}:{int(start) - 1}"})
        assert rank.wait(timeout=30) == -9
    finally:
        launcher.kill()
        launcher.wait()


def test_no_launcher_or_another_machines_changes_nothing():
    for value in ("", f"not-this-boot:{os.getpid()}:1"):
        rank = subprocess.Popen([sys.executable, "-P", "-c", RANK], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, jobtree.LAUNCHER_ENV: value})
        worker = json.loads(rank.stdout.readline())[0]
        time.sleep(0.3)
        assert rank.poll() is None
        rank.kill()
        rank.wait()
        os.kill(worker, 9)


WORKERS = """
import json, multiprocessing, os, sys, threading, time
from ulfmtrain.transport import jobtree
if sys.argv[1] == "on":
    jobtree.workers_die_with_rank()
ctx = multiprocessing.get_context("fork")
main = ctx.Process(target=time.sleep, args=(600,), daemon=True)         # as a DataLoader forks its workers
main.start()
box = []
t = threading.Thread(target=lambda: box.append(ctx.Process(target=time.sleep, args=(600,), daemon=True)))
t.start()
t.join()
box[0].start()                  # (started from the main thread too: the thread only made the object)
print(json.dumps([main.pid, box[0].pid]), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("on", ["on", "off"])
def test_a_ranks_multiprocessing_workers_die_with_it(on):
    """A rank SIGKILLed: its DataLoader workers (multiprocessing children forked from its main thread) die at
    once, not at torch's 5 s check (one caught handing file descriptors over printed a traceback).  "off" shows
    that without the hook they outlive it."""
    rank = subprocess.Popen([sys.executable, "-P", "-c", WORKERS, on], stdout=subprocess.PIPE, text=True)
    workers = json.loads(rank.stdout.readline())
    assert all(alive(w) for w in workers)
    rank.kill()
    rank.wait()
    end = time.monotonic() + 2
    while any(alive(w) for w in workers) and time.monotonic() < end:
        time.sleep(0.05)
    try:
        assert [alive(w) for w in workers] == ([False, False] if on == "on" else [True, True])
    finally:
        for w in workers:
            if alive(w):
                os.kill(w, 9)


def test_a_worker_whose_rank_is_gone_prints_no_traceback_for_the_lost_connection():
    """A DataLoader worker handing a batch's descriptors over when its rank is SIGKILLed sees the connection reset
    (multiprocessing's resource sharer reports it through sys.excepthook) before its own SIGKILL comes (test_stop
    printed that traceback once in a full run).  Once the rank is gone the hook says nothing; while the rank
    lives, and for any other exception, it passes on."""
    seen = []

    def hook(*exc):
        seen.append(exc[0])
    gone = jobtree.quiet_once_orphaned(os.getppid() + 10**6, hook, wait=0.05)    # a parent that is not ours
    gone(ConnectionResetError, ConnectionResetError(104, "reset"), None)
    gone(EOFError, EOFError(), None)
    assert seen == []
    gone(ValueError, ValueError("a bug"), None)
    assert seen == [ValueError]
    alive = jobtree.quiet_once_orphaned(os.getppid(), hook, wait=0.05)           # the rank still runs
    alive(ConnectionResetError, ConnectionResetError(104, "reset"), None)
    assert seen == [ValueError, ConnectionResetError]
