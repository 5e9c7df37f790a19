"""ulfmtrain: fault-tolerant data-parallel PyTorch training on Open MPI ULFM.

Names are imported on first use, so that `python -m ulfmtrain demo` and the
data tools do not initialize MPI in a process that mpirun did not start.

In a rank that mpirun started, importing the package initializes MPI, within
$ULFMTRAIN_INIT_TIMEOUT seconds (60): a rank that died during start-up would
otherwise leave the others waiting in MPI_Init for ever.  Programs that use
MPI.COMM_WORLD directly after `import ulfmtrain` find MPI initialized as
mpi4py would have left it; see transport/lifecycle.start_at_import.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .transport import exits, hangs, lifecycle  # noqa: F401  # hangs: its watch starts when exits is armed

# Before anything imports mpi4py.MPI, which would initialize MPI with no bound.
if lifecycle.start_at_import():
    exits.arm_at_exit()

try:
    __version__ = version("ulfmtrain")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The layers, lowest first, each with its packages: a module imports only from its own layer and the ones below
# (tests/test_style.py holds it, imports inside functions included).  The extension _ftcoll is below them all;
# cli, __main__ and this file are above.  Each package's docstring says what it holds.
_LAYERS = (("core",), ("transport",), ("training", "data", "checkpoint"), ("membership",), ("job",),
           ("launching",), ("tools",))

# The public API of a training script: connect() (the job), DistributedOptimizer, ExactlyOnceSampler; with
# comm.track, opt.synchronize and comm.allreduce, the six things a script calls beyond plain PyTorch (README.md
# lists these names).  The rest stays importable, not advertised: the `train` command's pieces, the older
# communicator API (FaultTolerantComm, FTSGD: tests and the train command use them) and the errors; everything
# else from its module (ulfmtrain.data, ulfmtrain.checkpoint, ulfmtrain.transport.faults, ...).
_EXPORTS = {
    "connect": "job.script", "DistributedOptimizer": "training.optim", "ExactlyOnceSampler": "data.loader",
}
_IMPORTABLE = {
    "FaultTolerantComm": "transport.comm", "FaultToleranceUnavailable": "transport.comm",
    "FaultPathError": "transport.comm", "FTSGD": "training.optim", "distributed_sampler": "data",
    "Trainer": "training.trainer", "TrainConfig": "training.config",
    "Checkpointer": "checkpoint", "CheckpointError": "checkpoint",
    "digits_to_dataset": "data", "arrays_to_dataset": "data", "DatasetError": "data",
    "parse_kills": "transport.faults", "KillSpecError": "transport.faults",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _IMPORTABLE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ulfmtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
