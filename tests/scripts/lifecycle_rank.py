"""One rank of the start-up / shut-down tests (tests/test_lifecycle.py), under mpirun --with-ft ulfm.

    python -P lifecycle_rank.py MODE OUT

Each rank writes OUT/<what>.<world rank>.json (atomically: a rank can die at
any moment) with what it saw and when (time.time()):

die-before-init  rank 1 SIGKILLs itself before `import ulfmtrain`; the others
                 record the start of their MPI_Init, then (never, if the bound
                 works) that it completed.
probe            `import ulfmtrain` initializes MPI: thread level, mpi4py.rc,
                 error handler, an allreduce; never calls finalize.
mpi4py-first     the program imports mpi4py.MPI before ulfmtrain (mpi4py's
                 own, unbounded start-up): ulfmtrain leaves it alone.
finalize-ok      lifecycle.finalize(1 s, 7) completes and returns 7; the rank
                 then outlives the 1 s bound, and exits 0.
finalize-hang    rank 0 finalizes (2 s, hang code 5) while rank 1 sleeps 8 s
                 first: MPI_Finalize waits for every rank, so rank 0's hangs.
peer-dies        FaultTolerantComm; the last rank SIGKILLs itself after one
                 allreduce; the survivors repair, and exit without finalize.

Every mode records, from an atexit handler registered before `import
ulfmtrain` (so it runs after ulfmtrain's), whether MPI was finalized at exit.
"""
# ruff: noqa: I001  (the order of imports is what these tests test)
import atexit
import json
import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])


def record(what: str, **data) -> None:
    path = os.path.join(out, f"{what}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def at_exit() -> None:
    if "mpi4py.MPI" in sys.modules:      # imported by now: this does not initialize MPI
        from mpi4py import MPI
        record("exit", finalized=MPI.Is_finalized(), t=time.time())


atexit.register(at_exit)

if mode == "die-before-init":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    record("init-start", t=time.time())
    import ulfmtrain  # noqa: E402,F401  (MPI_Init, bounded by ULFMTRAIN_INIT_TIMEOUT)
    record("init-done", t=time.time())

elif mode in ("probe", "mpi4py-first"):
    if mode == "mpi4py-first":
        from mpi4py import MPI
    t0 = time.time()
    import mpi4py

    import ulfmtrain  # noqa: F401  # before mpi4py.MPI: the bounded MPI_Init is ulfmtrain's
    from mpi4py import MPI
    init_s = time.time() - t0
    eh = MPI.COMM_WORLD.Get_errhandler()
    record(mode, initialized=MPI.Is_initialized(), thread=MPI.Query_thread(), multiple=MPI.THREAD_MULTIPLE,
           rc_initialize=mpi4py.rc.initialize, rc_finalize=mpi4py.rc.finalize,
           errors_return=eh == MPI.ERRORS_RETURN, sum=MPI.COMM_WORLD.allreduce(rank),
           size=MPI.COMM_WORLD.Get_size(), init_s=init_s)
    eh.Free()

elif mode == "finalize-ok":
    from mpi4py import MPI

    from ulfmtrain.transport import lifecycle

    MPI.COMM_WORLD.Barrier()
    t0 = time.time()
    code = lifecycle.finalize(1.0, 7)
    t1 = time.time()
    time.sleep(2.0)                      # past the bound: a watchdog still armed would end the process now
    record("finalize-ok", code=code, finalize_s=t1 - t0, finalized=MPI.Is_finalized(), t=time.time())
    # Exit 0, not the code: a non-zero exit, even after MPI_Finalize, makes mpirun end the other ranks,
    # and the test wants every rank's own status (a watchdog that fired would show as 7).
    sys.exit(0)

elif mode == "finalize-hang":
    from mpi4py import MPI

    from ulfmtrain.transport import lifecycle

    MPI.COMM_WORLD.Barrier()
    if rank == 1:
        time.sleep(8.0)
    record("finalize-start", t=time.time())
    code = lifecycle.finalize(2.0, 5)
    record("finalize-returned", code=code, t=time.time())
    sys.exit(code)

elif mode == "peer-dies":
    import numpy as np

    from ulfmtrain import FaultTolerantComm

    ft = FaultTolerantComm()
    n = ft.size
    ft.allreduce(np.ones(4), op="sum")
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    total = ft.allreduce(np.ones(4), op="sum")      # meets the failure, repairs, redoes on the survivors
    record("peer-dies", size=ft.size, sum=total.tolist(), n=n, t=time.time())
    # No finalize: the bounded one armed at import runs at interpreter exit.

else:
    sys.exit(f"unknown mode {mode!r}")
