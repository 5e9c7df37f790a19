from typing import Any

from mpi4py import MPI

OK: int
RECOVERED: int
DIVERGED: int
KILL_NONE: int
KILL_AFTER_REVOKE: int
KILL_AFTER_SHRINK: int

Report = dict[str, Any]
Result = tuple[int, MPI.Intracomm | None, Report | None]

class FaultPathError(RuntimeError): ...

def allreduce(comm: MPI.Comm, sendbuf: Any, recvbuf: Any, op: MPI.Op, tag: int) -> Result: ...
def agree(comm: MPI.Comm, flag: int, tag: int) -> tuple[int, Result]: ...
def recover(comm: MPI.Comm, tag: int) -> Result: ...
def finalize(timeout: float, exit_code: int) -> None: ...
def set_killpoint(point: int) -> None: ...
