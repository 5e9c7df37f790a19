"""`python tests/mpi/_run_pytest.py ARGS`: pytest.main in each rank, with a per-rank basetemp."""
import sys

import pytest
from mpi4py import MPI

args = sys.argv[1:]
i = args.index("--basetemp")
args[i + 1] += f"-rank{MPI.COMM_WORLD.Get_rank()}"
sys.exit(pytest.main(args))
