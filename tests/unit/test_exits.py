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


QUIET = """
import signal, sys
from torch.utils.data._utils import signal_handling
from ulfmtrain.transport import exits
signal_handling._set_SIGCHLD_handler()          # a DataLoader with workers sets it
def dead():
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")
signal_handling._error_if_any_worker_fails = dead   # a worker died: every SIGCHLD raises
exits.quiet_torch_sigchld()
exits.quiet_torch_sigchld()                     # (once: the second call finds its own handler)
handler = signal.getsignal(signal.SIGCHLD)
def raised():
    n = 0
    for _ in range(3):
        try:
            handler(signal.SIGCHLD, None)
        except RuntimeError:
            n += 1
    return n
before = raised()
def callback():
    raise ValueError("a library's callback")
try:
    callback()
except ValueError as e:       # as a library's PyErr_Print sets them: the callback's frames only
    sys.last_value, sys.last_traceback = e, e.__traceback__.tb_next
callback = raised()
try:
    raise ValueError("the program's end")
except ValueError as e:
    sys.last_value, sys.last_traceback = e, e.__traceback__          # as Python sets them before the hook
print(before, callback, raised())
"""


def test_torchs_sigchld_handler_is_kept_from_raising_once_the_program_ends_by_an_exception():
    """Once a DataLoader worker died, torch's handler raised at every SIGCHLD; one raised as the exception hook
    began and cut it short (the rank ended as if its program had).  Wrapped, it raises as before until an
    exception reached the program's top level (sys.last_traceback, set before the hook runs), then no more."""
    proc = subprocess.run([sys.executable, "-P", "-c", QUIET], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["3", "3", "0"], proc.stderr
