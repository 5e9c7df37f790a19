"""supervise's attempt runner: the bounds it puts on a launch and on a whole attempt (local commands, no MPI)."""
import sys
import time

import pytest

from ulfmtrain.cli import _train_job
from ulfmtrain.launching.supervise import SuperviseError, run_attempt, supervise

# Writes rank0.jsonl with a start record after `delay` seconds, then sleeps `after` seconds.
STARTS = ("import json, sys, time; d = sys.argv[1]; time.sleep(float(sys.argv[2])); "
          "open(d + '/rank0.jsonl', 'w').write(json.dumps({'event': 'start', 'count': 1, 'config': {}}) + '\\n'); "
          "time.sleep(float(sys.argv[3]))")


def test_a_launch_that_never_starts_is_ended_by_the_start_timeout(tmp_path):
    t0 = time.monotonic()
    res = run_attempt([sys.executable, "-c", "import time; time.sleep(60)"], None, tmp_path, start_timeout=1.0)
    assert res["start_timed_out"] and not res["timed_out"] and res["rc"] == -9
    assert time.monotonic() - t0 < 30


def test_an_attempt_that_started_is_left_to_the_whole_attempt_timeout(tmp_path):
    res = run_attempt([sys.executable, "-c", STARTS, str(tmp_path), "0.2", "3"], None, tmp_path, start_timeout=1.5)
    assert not res["start_timed_out"] and not res["timed_out"] and res["rc"] == 0
    assert res["t_exit"] - res["t_launch"] >= 3.0          # it ran past the start timeout: not killed
    res = run_attempt([sys.executable, "-c", STARTS, str(tmp_path), "0", "60"], 2.0, tmp_path, start_timeout=1.0)
    assert res["timed_out"] and not res["start_timed_out"] and res["rc"] == -9


def test_a_start_timeout_that_is_not_positive_is_refused(tmp_path):
    job = _train_job(["train", "--data", str(tmp_path), "--out", str(tmp_path / "out"),
                      "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5"])
    with pytest.raises(SuperviseError, match="--start-timeout must be positive"):
        supervise(2, job, start_timeout=0)
    assert not (tmp_path / "out").exists()
