"""Open MPI 5.0.10 and later crash a process that learns of a death while it builds a communicator:
ompi_comm_revoke_local calls the communicator's collectives table, which it has only once ompi_comm_activate
ends (a read of address 0x450).  Two survivors inside one split crashed so at the 423rd failure of the
1000-failure soak (benchmarks/README.md 5j), and the job lost every holder of its state.  The guard
(csrc/revoke_guard.h) gives such a communicator an empty table for the call.  The race itself needs a death in
the few ms of a split (2 runs in about 150 of tests/faults/test_pair_kill.py); here the revoke that it runs is
made directly, on a real communicator whose table is taken away, through the entry libmpi's own callers use."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ulfmtrain.launching.launch import mpirun_prefix

pytestmark = pytest.mark.faults
PROGRAM = "import ulfmtrain; from ulfmtrain import _ftcoll; print('revoked', _ftcoll.guard_selftest(), flush=True)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("guard", ["on", "on-mpi4py-first", "off"])
def test_a_communicator_revoked_before_its_collectives_are_chosen(guard):
    """With the guard (every rank has it: importing ulfmtrain puts it in place, also where the program imported
    mpi4py.MPI first), the communicator is revoked and the process goes on; without it
    (ULFMTRAIN_REVOKE_GUARD=0), Open MPI's own code: the soak's crash."""
    env = {**os.environ, "ULFMTRAIN_REVOKE_GUARD": "0" if guard == "off" else "1"}
    program = ("from mpi4py import MPI; " if guard == "on-mpi4py-first" else "") + PROGRAM
    cmd = [*mpirun_prefix(1), "-x", "ULFMTRAIN_REVOKE_GUARD", sys.executable, "-P", "-c", program]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    out = proc.stdout + proc.stderr
    if guard != "off":
        assert proc.returncode == 0 and "revoked 1" in proc.stdout, out[-3000:]
    else:
        assert "ompi_comm_revoke_local" in out and "Failing at address: 0x450" in out, out[-3000:]
        assert "revoked" not in proc.stdout, out[-3000:]
