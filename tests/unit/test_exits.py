"""The exit protocol's hooks, without MPI: what reaches stderr from an exception nothing can catch."""
from __future__ import annotations

import subprocess
import sys

PROGRAM = """
from ulfmtrain.transport import exits
exits.install()
ns = {}
exec(compile("def handler():\\n    raise RuntimeError('DataLoader worker (pid 1) is killed by signal')\\n",
             "/site/torch/utils/data/_utils/signal_handling.py", "exec"), ns)
class Torn:
    def __del__(self):
        ns["handler"]()        # torch's SIGCHLD handler, raising inside a __del__ as the first exception unwinds
class Broken:
    def __del__(self):
        raise ValueError("a finalizer of the program's own")
Torn()
Broken()
"""


def test_only_torchs_repeated_worker_death_is_kept_out_of_a_ranks_traceback():
    """torch's SIGCHLD handler raising again inside a __del__ printed "Exception ignored" into a rank's one
    traceback (test_failure_kinds' worker kill, now and then); any other exception in a finalizer still shows."""
    proc = subprocess.run([sys.executable, "-P", "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "is killed by signal" not in proc.stderr, proc.stderr
    assert "Exception ignored" in proc.stderr and "a finalizer of the program's own" in proc.stderr, proc.stderr
