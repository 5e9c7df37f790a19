"""The step watchdog on its own (a process of its own, no MPI) and the --step-timeout check."""
import math
import subprocess
import sys

import pytest

from ulfmtrain.core.modes import UsageError
from ulfmtrain.training.config import TrainConfig, TrainJob
from ulfmtrain.transport.stall import STALL_EXIT_CODE

PROGRAM = """
import time
from ulfmtrain.transport.stall import step_watchdog
w = step_watchdog({timeout}, lambda: "rank 7 (after step 41)")
for _ in range({pets}):
    time.sleep(0.1)
    w.pet()
time.sleep({idle})
w.close()
print("closed")
"""


def run(timeout: float, pets: int, idle: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM.format(timeout=timeout, pets=pets, idle=idle)],
                          capture_output=True, text=True, timeout=60)


def test_a_rank_that_commits_no_step_ends_with_one_line_and_status_3():
    proc = run(timeout=0.5, pets=0, idle=30)
    assert proc.returncode == STALL_EXIT_CODE and "closed" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "rank 7 (after step 41) committed no step" in lines[0] and "--step-timeout 0.5" in lines[0]


def test_steps_keep_it_quiet_and_close_stops_it():
    proc = run(timeout=0.5, pets=15, idle=0.2)       # 1.5 s of steps 0.1 s apart, then closed
    assert proc.returncode == 0 and proc.stdout.strip() == "closed" and proc.stderr == ""


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_step_timeout_that_is_not_a_positive_number_is_refused(bad):
    job = TrainJob(config=TrainConfig(step_timeout=bad))
    with pytest.raises(UsageError, match="--step-timeout"):
        job.validate()


USER_LOOP = """
import sys, time
from ulfmtrain.transport import stall
pet = stall.commit_watch(lambda: "world rank 2 (after step 9)")
pet()                              # the first committed step starts it
def in_ulfmtrain():                # the main thread waits in a collective: a frame of the package
    time.sleep({wait})
in_ulfmtrain.__code__ = in_ulfmtrain.__code__.replace(co_filename=stall.__file__)
time.sleep({own})                  # the program's own work after its last step: not a hang
in_ulfmtrain()
print("ended")
"""


def user_loop(env: str, own: float, wait: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", USER_LOOP.format(own=own, wait=wait)], capture_output=True,
                          text=True, timeout=60, env={**__import__("os").environ, "ULFMTRAIN_STEP_TIMEOUT": env})


def test_a_users_loop_is_watched_by_default_only_while_it_waits_in_ulfmtrain():
    # 2 s of its own work past a 0.5 s bound: quiet; then 30 s in a collective: ended with one line and status 3.
    proc = user_loop("0.5", own=2.0, wait=30)
    assert proc.returncode == STALL_EXIT_CODE and "ended" not in proc.stdout, proc.stderr
    assert proc.stderr.count("\n") == 1 and "world rank 2 (after step 9) has waited in a collective" in proc.stderr
    assert user_loop("0.5", own=2.0, wait=0).returncode == 0             # its own work past the bound: quiet
    assert user_loop("off", own=0.1, wait=2.0).returncode == 0           # off
    bad = user_loop("soon", own=0, wait=0)
    assert bad.returncode == 1 and "ULFMTRAIN_STEP_TIMEOUT='soon' is not a positive number" in bad.stderr
