"""The step watchdog on its own (a process of its own, no MPI) and the --step-timeout check."""
import math
import subprocess
import sys

import pytest

from ulfmtrain.job import TrainConfig, TrainJob
from ulfmtrain.modes import UsageError
from ulfmtrain.stall import STALL_EXIT_CODE

PROGRAM = """
import time
from ulfmtrain.stall import step_watchdog
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
